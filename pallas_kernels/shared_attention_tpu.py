"""Shared-cache flash attention, TPU variant: past K/V blocks pipelined by Mosaic.

The generic kernels (`shared_attention`) give each program one head's whole past K/V (or its
whole query side, in the dkv kernel) as a block and loop over it in the kernel: on a TPU that
is all in VMEM at once. Here the loop is a grid axis instead, last and "arbitrary": BlockSpecs
bring one past block (or one query block) per grid step, which Mosaic double-buffers, the
online-softmax state (m, l, acc) or the gradient accumulators live in VMEM scratch across it,
and the outputs are written on its last step. Same math and masks as the generic kernels,
same kernel layout ([B, heads, Tp, H], Tp a multiple of both blocks), same packed past.

Causality: past block j holds some s < t of query block i iff j * block_k < i * block_q +
block_q - 1. Grid steps outside that (above the diagonal) are skipped with `pl.when`, and their
index maps return the nearest needed block, so Mosaic issues no DMA for them (it skips the copy
when the block index does not change).

Block prefill (prefill_block C > 1): past block j is needed while j * block_k is below the
block start of the query block's last row; the own K/V come in again as key blocks, needed from
the block start of the query block's first row up to its diagonal, clamped the same way. Both
parts run at the same inner step j (each under its own `pl.when`). The dkv kernel adds the own
blocks' in-block gradients as a second pair of outputs; its query blocks are fetched from the
first that reads the key block in either way (the first own reader never comes after the first
past reader).

Segment ids (document masking) come in as the query block's [block_q, 1] column and key block
j's [1, block_k] row (fetched at every step j: four bytes per key, unclamped, as past and own
blocks are clamped differently), and narrow each mask to equal ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import ops

_dot = ops.dot_f32


def _needed(q_start, k_start, block_q: int, prefill_block: int = 1):
  """Whether the (query block, past block) pair has some s < block_start(t): not above the
  diagonal (block prefill: not above the last row's block start)."""
  return k_start < ops.past_end(q_start, block_q, prefill_block)


def _last_past_block(i, block_q: int, block_k: int, prefill_block: int = 1):
  """The last past block query block i reads (0 when it reads none)."""
  return jnp.maximum((ops.past_end(i * block_q, block_q, prefill_block) - 1) // block_k, 0)


def _own_needed(i, j, block_q: int, block_k: int, prefill_block: int):
  """Block prefill: whether own key block j holds in-block earlier positions of query block i."""
  lo, hi = ops.own_tiles(i * block_q, block_q, block_k, prefill_block)
  return (lo <= j) & (j < hi)


def _own_block(i, j, block_q: int, block_k: int, prefill_block: int):
  """The own key block fetched at step j for query block i: j clamped to the blocks it reads,
  so steps outside them repeat a needed block (no DMA)."""
  lo, hi = ops.own_tiles(i * block_q, block_q, block_k, prefill_block)
  return jnp.clip(j, lo, jnp.maximum(hi - 1, lo))


def _dkv_query_block(j, i, block_q: int, block_k: int, num_q_blocks: int):
  """The query block the dkv kernel fetches at step i for key block j: the steps before the
  first query block that reads key block j fetch that one. The first reader as past is never
  before the first as own (in-block) reader, so this serves both."""
  first = jnp.minimum((j * block_k + 1) // block_q, num_q_blocks - 1)
  return jnp.maximum(i, first)


def _params(interpret):
  semantics = ("parallel", "parallel", "parallel", "arbitrary")
  return dict(
    interpret=interpret, compiler_params=pltpu.CompilerParams(dimension_semantics=semantics)
  )


# ---------------------------------------------------------------------------------------------
# Kernels. Grid (b, h, outer block, inner block); refs are one block of rows of one (b, head).
# Block prefill (prefill_block > 1) adds own K/V key blocks after the past leaves: at inner step
# j, past block j (if needed) and own block j (if needed) both update the accumulators.


def _seg_refs(refs, n_leaves: int, prefill_block: int, segmented: bool):
  """The segment-id refs (query column, key row), after the past leaves and own K/V, or None."""
  start = 2 * n_leaves + 2 * (prefill_block > 1)
  return tuple(refs[start : start + 2]) if segmented else None


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, sm_scale, past_fmt, n_leaves, prefill_block, segmented):
  kp_refs, vp_refs = refs[:n_leaves], refs[n_leaves : 2 * n_leaves]
  seg_refs = _seg_refs(refs, n_leaves, prefill_block, segmented)
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs[-5:]
  block_q, block_k = q_ref.shape[0], kp_refs[0].shape[0]
  i, j = pl.program_id(2), pl.program_id(3)
  q_start, k_start = i * block_q, j * block_k

  @pl.when(j == 0)
  def _init():  # The diagonal: max q_t . k_t, sum 1, accumulator v_t.
    q32, k32 = q_ref[...].astype(jnp.float32), k_ref[...].astype(jnp.float32)
    m_ref[...] = jnp.sum(q32 * k32, axis=1, keepdims=True) * sm_scale
    l_ref[...] = jnp.ones_like(l_ref)
    acc_ref[...] = v_ref[...].astype(jnp.float32)

  def update(k_SxH, v_SxH, mask_QxS):
    mask_QxS = ops.same_segment(mask_QxS, seg_refs, ..., ...)
    q_QxH = q_ref[...]
    s_QxS = jnp.where(mask_QxS, _dot(q_QxH, k_SxH, 1, 1) * sm_scale, -jnp.inf)
    m_Qx1 = m_ref[...]
    m_new = jnp.maximum(m_Qx1, jnp.max(s_QxS, axis=1, keepdims=True))
    alpha = jnp.exp(m_Qx1 - m_new)
    p_QxS = jnp.exp(s_QxS - m_new)
    l_ref[...] = l_ref[...] * alpha + jnp.sum(p_QxS, axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * alpha + _dot(p_QxS.astype(v_SxH.dtype), v_SxH)
    m_ref[...] = m_new

  @pl.when(_needed(q_start, k_start, block_q, prefill_block))
  def _past_block():
    dtype = q_ref.dtype
    kp_SxH = ops.past_tile(kp_refs, 0, block_k, past_fmt, dtype)
    vp_SxH = ops.past_tile(vp_refs, 0, block_k, past_fmt, dtype)
    update(kp_SxH, vp_SxH, ops.past_mask(q_start, k_start, block_q, block_k, prefill_block))

  if prefill_block > 1:
    k_own_ref, v_own_ref = refs[2 * n_leaves : 2 * n_leaves + 2]

    @pl.when(_own_needed(i, j, block_q, block_k, prefill_block))
    def _own_block():
      mask = ops.own_mask(q_start, k_start, block_q, block_k, prefill_block)
      update(k_own_ref[...], v_own_ref[...], mask)

  @pl.when(j == pl.num_programs(3) - 1)
  def _write():
    o_ref[...] = (acc_ref[...] / l_ref[...]).astype(o_ref.dtype)
    lse_ref[...] = m_ref[...] + jnp.log(l_ref[...])


def _bwd_dq_kernel(
  q_ref, k_ref, v_ref, *refs, sm_scale, past_fmt, n_leaves, prefill_block, segmented
):
  kp_refs, vp_refs = refs[:n_leaves], refs[n_leaves : 2 * n_leaves]
  seg_refs = _seg_refs(refs, n_leaves, prefill_block, segmented)
  do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref, dq_acc_ref = refs[-7:]
  block_q, block_k = q_ref.shape[0], kp_refs[0].shape[0]
  i, j = pl.program_id(2), pl.program_id(3)
  q_start, k_start = i * block_q, j * block_k

  @pl.when(j == 0)
  def _init():
    dq_acc_ref[...] = jnp.zeros_like(dq_acc_ref)

  def update(k_SxH, v_SxH, mask_QxS):
    mask_QxS = ops.same_segment(mask_QxS, seg_refs, ..., ...)
    q_QxH, do_QxH = q_ref[...], do_ref[...]
    s_QxS = _dot(q_QxH, k_SxH, 1, 1) * sm_scale
    p_QxS = jnp.where(mask_QxS, jnp.exp(s_QxS - lse_ref[...]), 0.0)
    ds_QxS = p_QxS * (_dot(do_QxH, v_SxH, 1, 1) - delta_ref[...])
    dq_acc_ref[...] += _dot(ds_QxS.astype(k_SxH.dtype), k_SxH) * sm_scale

  @pl.when(_needed(q_start, k_start, block_q, prefill_block))
  def _past_block():
    dtype = q_ref.dtype
    kp_SxH = ops.past_tile(kp_refs, 0, block_k, past_fmt, dtype)
    vp_SxH = ops.past_tile(vp_refs, 0, block_k, past_fmt, dtype)
    update(kp_SxH, vp_SxH, ops.past_mask(q_start, k_start, block_q, block_k, prefill_block))

  if prefill_block > 1:  # dq only: the own keys' in-block gradients come from the dkv kernel.
    k_own_ref, v_own_ref = refs[2 * n_leaves : 2 * n_leaves + 2]

    @pl.when(_own_needed(i, j, block_q, block_k, prefill_block))
    def _own_block():
      mask = ops.own_mask(q_start, k_start, block_q, block_k, prefill_block)
      update(k_own_ref[...], v_own_ref[...], mask)

  @pl.when(j == pl.num_programs(3) - 1)
  def _write():  # Diagonal: p_tt and ds_tt = p_tt (dO_t . v_t - delta_t) give dk_t, dv_t.
    q32, do32 = q_ref[...].astype(jnp.float32), do_ref[...].astype(jnp.float32)
    k32, v32 = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
    p_Qx1 = jnp.exp(jnp.sum(q32 * k32, axis=1, keepdims=True) * sm_scale - lse_ref[...])
    ds_Qx1 = p_Qx1 * (jnp.sum(do32 * v32, axis=1, keepdims=True) - delta_ref[...])
    dk_ref[...] = (ds_Qx1 * q32 * sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = (p_Qx1 * do32).astype(dv_ref.dtype)
    dq_ref[...] = (dq_acc_ref[...] + ds_Qx1 * k32 * sm_scale).astype(dq_ref.dtype)


def _bwd_dkv_kernel(
  q_ref, do_ref, lse_ref, delta_ref, *refs, sm_scale, prefill_block, has_past, segmented
):
  """Key block j's gradients: of the past K/V (has_past), and in block prefill of the own K/V
  read inside the block; refs are the key blocks, the segment ids (segmented), their outputs,
  then one accumulator each."""
  n = 2 * has_past + 2 * (prefill_block > 1)
  keys, seg_refs = refs[:n], (tuple(refs[n : n + 2]) if segmented else None)
  refs = refs[n + 2 * segmented :]
  outs, accs = refs[:n], refs[n:]
  block_q, block_k = q_ref.shape[0], keys[0].shape[0]
  i, j = pl.program_id(3), pl.program_id(2)
  q_start, k_start = i * block_q, j * block_k

  @pl.when(i == 0)
  def _init():
    for acc in accs:
      acc[...] = jnp.zeros_like(acc)

  def update(key_ref, value_ref, mask_QxS, dk_acc, dv_acc):
    mask_QxS = ops.same_segment(mask_QxS, seg_refs, ..., ...)
    q_QxH, do_QxH = q_ref[...], do_ref[...]
    s_QxS = _dot(q_QxH, key_ref[...], 1, 1) * sm_scale
    p_QxS = jnp.where(mask_QxS, jnp.exp(s_QxS - lse_ref[...]), 0.0)
    dv_acc[...] += _dot(p_QxS.astype(do_QxH.dtype), do_QxH, 0, 0)
    ds_QxS = p_QxS * (_dot(do_QxH, value_ref[...], 1, 1) - delta_ref[...])
    dk_acc[...] += _dot(ds_QxS.astype(q_QxH.dtype), q_QxH, 0, 0) * sm_scale

  if has_past:

    @pl.when(_needed(q_start, k_start, block_q, prefill_block))
    def _past_block():
      mask = ops.past_mask(q_start, k_start, block_q, block_k, prefill_block)
      update(keys[0], keys[1], mask, accs[0], accs[1])

  if prefill_block > 1:

    @pl.when(_own_needed(i, j, block_q, block_k, prefill_block))
    def _own_block():
      mask = ops.own_mask(q_start, k_start, block_q, block_k, prefill_block)
      update(keys[-2], keys[-1], mask, accs[-2], accs[-1])

  @pl.when(i == pl.num_programs(3) - 1)
  def _write():
    for out, acc in zip(outs, accs):
      out[...] = acc[...].astype(out.dtype)


# ---------------------------------------------------------------------------------------------
# pallas_calls on [B, N, Tp, H] arrays; a past is given as its kernel-layout leaves.


def _spec(block: int, width: int, index_map):
  return pl.BlockSpec((None, None, block, width), index_map)


def _past_specs(leaves, past_fmt, group: int, block_q: int, block_k: int, prefill_block: int = 1):
  """Past block j of each leaf for query block i, clamped to the last one it reads."""

  def index_map(head_of, b, h, i, j):
    last = _last_past_block(i, block_q, block_k, prefill_block)
    return (b, head_of(h), jnp.minimum(j, last), 0)

  head = functools.partial(index_map, lambda h: h // group)
  specs = [_spec(block_k, x.shape[-1], head) for x in leaves]
  if past_fmt == "nvfp4":  # Tensor scale [B, 1, Tp, 1], shared by the heads.
    specs[2] = _spec(block_k, 1, functools.partial(index_map, lambda h: 0))
  return specs


def _own_specs(d: int, group: int, block_q: int, block_k: int, prefill_block: int):
  """Block prefill: own K and V key block j for query block i (none for prefill_block 1)."""
  if prefill_block == 1:
    return []

  def own_map(b, h, i, j):
    return (b, h // group, _own_block(i, j, block_q, block_k, prefill_block), 0)

  return [_spec(block_k, d, own_map)] * 2


def _seg_inputs(seg, block_q: int, block_k: int, q_block_of, k_block_of):
  """Segment ids [B, Tp] (or None) as a [B, 1, Tp, 1] column in query blocks and a
  [B, 1, 1, Tp] row in key blocks, with their specs; q_block_of / k_block_of map the grid
  index (b, h, x, y) to the block index."""
  if seg is None:
    return (), []
  col_spec = pl.BlockSpec((None, None, block_q, 1), lambda *g: (g[0], 0, q_block_of(*g), 0))
  row_spec = pl.BlockSpec((None, None, 1, block_k), lambda *g: (g[0], 0, 0, k_block_of(*g)))
  return (seg[:, None, :, None], seg[:, None, None, :]), [col_spec, row_spec]


def _query_side_specs(d: int, group: int, block_q: int):
  """q, own k, own v (block i of query head h / its KV head) for grid (b, h, i, j)."""
  q_map = lambda b, h, i, j: (b, h, i, 0)
  kv_map = lambda b, h, i, j: (b, h // group, i, 0)
  return [_spec(block_q, d, q_map), _spec(block_q, d, kv_map), _spec(block_q, d, kv_map)], q_map


def fwd(
  q,
  k,
  v,
  kp_leaves,
  vp_leaves,
  past_fmt,
  sm_scale,
  block_q,
  block_k,
  interpret,
  prefill_block=1,
  seg=None,
):
  """Forward: (o [B, N, Tp, H], lse [B, N, Tp, 1]). seg: segment ids [B, Tp] or None."""
  b, hq, t, d = q.shape
  group = hq // k.shape[1]
  row_specs, q_map = _query_side_specs(d, group, block_q)
  own_specs = _own_specs(d, group, block_q, block_k, prefill_block)
  segs, seg_specs = _seg_inputs(seg, block_q, block_k, lambda b, h, i, j: i, lambda b, h, i, j: j)
  kernel = functools.partial(
    _fwd_kernel,
    sm_scale=sm_scale,
    past_fmt=past_fmt,
    n_leaves=len(kp_leaves),
    prefill_block=prefill_block,
    segmented=seg is not None,
  )
  return pl.pallas_call(
    kernel,
    grid=(b, hq, t // block_q, t // block_k),
    in_specs=[
      *row_specs,
      *_past_specs(kp_leaves, past_fmt, group, block_q, block_k, prefill_block),
      *_past_specs(vp_leaves, past_fmt, group, block_q, block_k, prefill_block),
      *own_specs,
      *seg_specs,
    ],
    out_specs=[_spec(block_q, d, q_map), _spec(block_q, 1, q_map)],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((b, hq, t, 1), jnp.float32),
    ],
    scratch_shapes=[
      pltpu.VMEM((block_q, 1), jnp.float32),
      pltpu.VMEM((block_q, 1), jnp.float32),
      pltpu.VMEM((block_q, d), jnp.float32),
    ],
    name="shared_attention_tpu_fwd",
    **_params(interpret),
  )(q, k, v, *kp_leaves, *vp_leaves, *((k, v) if own_specs else ()), *segs)


def dq(
  q,
  k,
  v,
  kp_leaves,
  vp_leaves,
  past_fmt,
  do,
  lse,
  delta,
  sm_scale,
  block_q,
  block_k,
  interpret,
  prefill_block=1,
  seg=None,
):
  """dq and the diagonal's own-K/V gradients per query head: (dq, dk_h, dv_h), each
  [B, N, Tp, H]."""
  b, hq, t, d = q.shape
  group = hq // k.shape[1]
  row_specs, q_map = _query_side_specs(d, group, block_q)
  own_specs = _own_specs(d, group, block_q, block_k, prefill_block)
  segs, seg_specs = _seg_inputs(seg, block_q, block_k, lambda b, h, i, j: i, lambda b, h, i, j: j)
  kernel = functools.partial(
    _bwd_dq_kernel,
    sm_scale=sm_scale,
    past_fmt=past_fmt,
    n_leaves=len(kp_leaves),
    prefill_block=prefill_block,
    segmented=seg is not None,
  )
  per_head = lambda x: jax.ShapeDtypeStruct((b, hq, t, d), x.dtype)
  return pl.pallas_call(
    kernel,
    grid=(b, hq, t // block_q, t // block_k),
    in_specs=[
      *row_specs,
      *_past_specs(kp_leaves, past_fmt, group, block_q, block_k, prefill_block),
      *_past_specs(vp_leaves, past_fmt, group, block_q, block_k, prefill_block),
      *own_specs,
      *seg_specs,
      _spec(block_q, d, q_map),
      _spec(block_q, 1, q_map),
      _spec(block_q, 1, q_map),
    ],
    out_specs=[_spec(block_q, d, q_map)] * 3,
    out_shape=[per_head(q), per_head(k), per_head(v)],
    scratch_shapes=[pltpu.VMEM((block_q, d), jnp.float32)],
    name="shared_attention_tpu_bwd_dq",
    **_params(interpret),
  )(q, k, v, *kp_leaves, *vp_leaves, *((k, v) if own_specs else ()), *segs, do, lse, delta)


def dkv(
  q, do, lse, delta, past, own, sm_scale, block_q, block_k, interpret, prefill_block=1, seg=None
):
  """Key-block gradients per query head, each [B, N, Tp, H]: ((dk_past_h, dv_past_h) or Nones,
  (dk_own_h, dv_own_h) or Nones) for `past` / `own`, (k, v) pairs or None (own: block
  prefill's in-block reads; the diagonal's share is the dq kernel's). seg: segment ids."""
  b, hq, t, d = q.shape
  keys = [x for pair in (past, own) if pair is not None for x in pair]
  group = hq // keys[0].shape[1]
  num_q_blocks = t // block_q

  def q_map(b, h, j, i):
    return (b, h, _dkv_query_block(j, i, block_q, block_k, num_q_blocks), 0)

  kv_map = lambda b, h, j, i: (b, h // group, j, 0)
  out_map = lambda b, h, j, i: (b, h, j, 0)
  per_head = lambda x: jax.ShapeDtypeStruct((b, hq, t, d), x.dtype)
  kernel = functools.partial(
    _bwd_dkv_kernel,
    sm_scale=sm_scale,
    prefill_block=prefill_block,
    has_past=past is not None,
    segmented=seg is not None,
  )
  q_block = lambda b, h, j, i: _dkv_query_block(j, i, block_q, block_k, num_q_blocks)
  segs, seg_specs = _seg_inputs(seg, block_q, block_k, q_block, lambda b, h, j, i: j)
  grads = pl.pallas_call(
    kernel,
    grid=(b, hq, t // block_k, num_q_blocks),
    in_specs=[
      _spec(block_q, d, q_map),
      _spec(block_q, d, q_map),
      _spec(block_q, 1, q_map),
      _spec(block_q, 1, q_map),
      *[_spec(block_k, d, kv_map)] * len(keys),
      *seg_specs,
    ],
    out_specs=[_spec(block_k, d, out_map)] * len(keys),
    out_shape=[per_head(x) for x in keys],
    scratch_shapes=[pltpu.VMEM((block_k, d), jnp.float32)] * len(keys),
    name="shared_attention_tpu_bwd_dkv",
    **_params(interpret),
  )(q, do, lse, delta, *keys, *segs)
  grads = list(grads)
  dpast = (grads.pop(0), grads.pop(0)) if past is not None else (None, None)
  down = (grads.pop(0), grads.pop(0)) if own is not None else (None, None)
  return dpast, down
