"""Paged decode, TPU variant: Mosaic pipelines one page at a time through scalar-prefetched
page ids (same math, layouts and in-kernel dequantization as `paged_decode`'s generic kernel).

The generic kernel hands each program a sequence's whole page pool as one block, which a TPU's
VMEM (16-64 MiB) cannot hold. Here the grid is (sequence, page): `lengths` and the page table
are scalar-prefetched into SMEM, and every page leaf (elements and scales) has a BlockSpec whose
index_map returns the page id `page_table[b, i]`, so Mosaic DMAs one page per grid step into
VMEM, double-buffered, while the previous one is consumed. The online-softmax state (m, l, acc)
lives in VMEM scratch across the page axis ("arbitrary"); the output is written on the last
page step.

A page block spans all KV heads: the pool is token-major ([pages, page_size, K, ...], as
looped's caches store it) and Mosaic wants the last two block dims whole or (8, 128)-aligned,
so one head's slice (K squeezed in the second-minor position) is not a legal block. One DMA per
page is also the fewest: each program serves every KV head of its sequence (a static loop).

Steps past the sequence's last page map to that page again (clamped index: Mosaic issues no
DMA when the block index does not change) and are skipped with `pl.when`. A sequence with
length 0 reads its first table entry (clipped into the pool) once and uses none of it. Slots
past the length in the last page are zeroed before use, so they may hold NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_formats, ops
from pallas_kernels.kv_formats import PackedKV

# Sublane count: query rows and own tokens are padded to it, as Mosaic tiles them.
ROWS = 8

_dot = ops.dot_f32


def _head_parts(leaf_refs, h: int, fmt: str):
  """Dequantized float32 column parts [page_size, D / parts] of KV head h of the page block."""
  data = leaf_refs[0][:, h, :]
  if fmt in ("raw", "bf16"):
    return [data.astype(jnp.float32)]
  if fmt == "fp8":  # Scale block [page_size, K]: column h.
    return [data.astype(jnp.float32) * leaf_refs[1][:, pl.ds(h, 1)]]
  if fmt in ("mxfp8", "mxfp8_rceil"):
    return [kv_formats.mx_dequantize(data, leaf_refs[1][:, h, :])]
  # nvfp4: tensor scale block [page_size, 1], one per token, shared by the heads.
  return list(kv_formats.nvfp4_halves(data, leaf_refs[1][:, h, :], leaf_refs[2][...]))


def _own_chunk(q_parts, k_parts, v_parts, group: int, num_new: int, sm_scale: float):
  """Softmax state (m, l, acc) of the rows over their own chunk: row m sees u <= m // group."""
  rows, cols = q_parts[0].shape[0], k_parts[0].shape[0]
  row_t = lax.broadcasted_iota(jnp.int32, (rows, cols), 0) // group
  col_u = lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
  s_QxU = sum(_dot(q, k, 1, 1) for q, k in zip(q_parts, k_parts)) * sm_scale
  s_QxU = jnp.where((col_u <= row_t) & (col_u < num_new), s_QxU, -jnp.inf)
  m_Qx1 = jnp.max(s_QxU, axis=1, keepdims=True)
  p_QxU = jnp.exp(s_QxU - m_Qx1)
  l_Qx1 = jnp.sum(p_QxU, axis=1, keepdims=True)
  dtype = q_parts[0].dtype
  return m_Qx1, l_Qx1, [_dot(p_QxU.astype(dtype), v) for v in v_parts]


def _page_step(q_parts, k_parts, v_parts, valid, state, sm_scale: float):
  """One page into the online softmax; unused slots are zeroed (NaN-safe) and masked."""
  (valid_Sx1, valid_1xS), (m_Qx1, l_Qx1, accs) = valid, state
  dtype = q_parts[0].dtype
  # Rounded to the compute dtype (as a cache read is), then unused slots zeroed.
  k_parts = [jnp.where(valid_Sx1, x.astype(dtype), 0) for x in k_parts]
  v_parts = [jnp.where(valid_Sx1, x.astype(dtype), 0) for x in v_parts]
  s_QxS = sum(_dot(q, k, 1, 1) for q, k in zip(q_parts, k_parts)) * sm_scale
  s_QxS = jnp.where(valid_1xS, s_QxS, -jnp.inf)
  m_new = jnp.maximum(m_Qx1, jnp.max(s_QxS, axis=1, keepdims=True))
  alpha = jnp.exp(m_Qx1 - m_new)
  p_QxS = jnp.exp(s_QxS - m_new)
  l_Qx1 = l_Qx1 * alpha + jnp.sum(p_QxS, axis=1, keepdims=True)
  accs = [a * alpha + _dot(p_QxS.astype(dtype), v) for a, v in zip(accs, v_parts)]
  return m_new, l_Qx1, accs


def _kernel(len_ref, pt_ref, *refs, fmt, n_parts, n_leaves, group, num_new, sm_scale):
  del pt_ref  # Only the index maps read the page table.
  q_refs, k_new_refs, v_new_refs = (refs[i * n_parts : (i + 1) * n_parts] for i in range(3))
  rest = refs[3 * n_parts :]
  k_leaf_refs, v_leaf_refs = rest[:n_leaves], rest[n_leaves : 2 * n_leaves]
  o_refs = rest[2 * n_leaves : 2 * n_leaves + n_parts]
  m_ref, l_ref, *acc_refs = rest[2 * n_leaves + n_parts :]
  kv_heads, page_size = q_refs[0].shape[0], k_leaf_refs[0].shape[0]
  i = pl.program_id(1)
  length = len_ref[pl.program_id(0)]

  def load(h):
    return m_ref[h], l_ref[h], [a[h] for a in acc_refs]

  def store(h, state):
    m_ref[h], l_ref[h] = state[0], state[1]
    for a_ref, acc in zip(acc_refs, state[2]):
      a_ref[h] = acc

  @pl.when(i == 0)
  def _init():
    for h in range(kv_heads):
      own = [[r[h] for r in part_refs] for part_refs in (q_refs, k_new_refs, v_new_refs)]
      store(h, _own_chunk(*own, group, num_new, sm_scale))

  @pl.when(i * page_size < length)
  def _page():
    # Slot validity as a column (rows of the K/V tiles) and as a row (columns of the logits).
    valid_Sx1 = i * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0) < length
    valid_1xS = i * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1) < length
    for h in range(kv_heads):
      k_parts = _head_parts(k_leaf_refs, h, fmt)
      v_parts = _head_parts(v_leaf_refs, h, fmt)
      q_parts = [r[h] for r in q_refs]
      state = _page_step(q_parts, k_parts, v_parts, (valid_Sx1, valid_1xS), load(h), sm_scale)
      store(h, state)

  @pl.when(i == pl.num_programs(1) - 1)
  def _write():
    for o_ref, a_ref in zip(o_refs, acc_refs):
      o_ref[...] = (a_ref[...] / l_ref[...]).astype(o_ref.dtype)


def _page_spec(x, page_size: int, num_pages: int):
  """One page of a leaf, all KV heads: block [page_size, ...] at page_table[b, clamped i]."""

  def index_map(b, i, len_ref, pt_ref):
    last = jnp.maximum((len_ref[b] + page_size - 1) // page_size - 1, 0)
    page = jnp.clip(pt_ref[b, jnp.minimum(i, last)], 0, num_pages - 1)
    return (page,) + (0,) * (x.ndim - 1)

  return pl.BlockSpec((None, *x.shape[1:]), index_map)


def _kernel_leaves(packed: PackedKV):
  """The pool's leaves as the kernel reads them: nvfp4's tensor scale [pages, page_size, 1]."""
  leaves = [packed.data, packed.scale]
  if packed.tensor_scale is not None:
    leaves.append(packed.tensor_scale[..., None])
  return [x for x in leaves if x is not None]


def paged_decode_tpu(
  q_parts,
  k_new_parts,
  v_new_parts,
  k_pages: PackedKV,
  v_pages: PackedKV,
  page_table,
  lengths,
  *,
  group: int,
  num_new: int,
  sm_scale: float,
  interpret,
):
  """The pallas_call on `paged_decode`'s kernel layout: q parts [B, K, rows, H / parts] with
  rows a multiple of 8, own K/V parts [B, K, T_pad, H / parts]; returns the output parts."""
  fmt = k_pages.fmt
  b, kv_heads, rows, _ = q_parts[0].shape
  num_pages, page_size = k_pages.data.shape[:2]
  k_leaves, v_leaves = _kernel_leaves(k_pages), _kernel_leaves(v_pages)
  if page_table.shape[1] == 0:  # The grid needs a page step to initialise and write.
    page_table = jnp.zeros((b, 1), jnp.int32)
  whole = lambda x: pl.BlockSpec((None, *x.shape[1:]), lambda b, i, *_: (b,) + (0,) * 3)
  row_inputs = [*q_parts, *k_new_parts, *v_new_parts]
  kernel = functools.partial(
    _kernel,
    fmt=fmt,
    n_parts=len(q_parts),
    n_leaves=len(k_leaves),
    group=group,
    num_new=num_new,
    sm_scale=sm_scale,
  )
  scratch = [pltpu.VMEM((kv_heads, rows, 1), jnp.float32)] * 2 + [
    pltpu.VMEM(x.shape[1:], jnp.float32) for x in q_parts
  ]
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=2,
    grid=(b, page_table.shape[1]),
    in_specs=[whole(x) for x in row_inputs]
    + [_page_spec(x, page_size, num_pages) for x in k_leaves + v_leaves],
    out_specs=[whole(x) for x in q_parts],
    scratch_shapes=scratch,
  )
  return pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in q_parts],
    interpret=interpret,
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    name=f"paged_decode_tpu_{fmt}",
  )(lengths, page_table, *row_inputs, *k_leaves, *v_leaves)
