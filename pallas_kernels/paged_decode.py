"""Paged decode attention with in-kernel KV dequantization.

For each sequence b of a ragged batch, its T new tokens (T = 1 when decoding; a short chunk when
prefilling) attend to the cache slots s < lengths[b], read page by page through the page table,
and causally to their own fresh K/V (the diagonal when T = 1). Pages stay packed in HBM (bf16,
fp8, mxfp8, nvfp4: element bytes and scales exactly as `looped.kv_quant` stores them); each page
tile is dequantized in the kernel (`kv_formats`), never as a dequantized copy of the cache.

One program per (sequence, KV head): its query rows are the T * G query heads of the group
(row m = t * G + g), so every page tile is read once for the whole group. The page loop stops
at ceil(length / page_size); slots past the length in the last page are zeroed before use, so
pages may hold garbage or NaN there. The online softmax starts from the own-chunk block, whose
diagonal every row sees, so the running max is always finite.

nvfp4 never interleaves nibbles: q and the own K/V are split into even and odd columns outside
the kernel, logits are q_even . k_low + q_odd . k_high, and the output comes back as even and
odd columns (the "parts" below; one part for the other formats).

That is the generic kernel (interpret, Triton, Mosaic). On TPU the default is
`paged_decode_tpu`, which pipelines one page per grid step instead of taking the whole pool as
a block; both share this wrapper's layout and padding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kv_formats, ops, paged_decode_tpu, platform
from pallas_kernels.kv_formats import PackedKV

# Minimum rows of a dot operand per platform (Triton's tl.dot needs 16; interpret mode none).
_MIN_ROWS = {"cpu": 1, "gpu": 16, "tpu": 8}


_dot = ops.dot_f32


def _page_parts(leaf_refs, page, fmt: str):
  """Dequantized float32 column parts of one page tile [page_size, D / parts]."""
  tiles = [ref[page] for ref in leaf_refs]
  if fmt == "nvfp4":
    return list(kv_formats.nvfp4_halves(*tiles))
  data, scale = tiles[0], tiles[1] if len(tiles) > 1 else None
  return [kv_formats.dequantize_tile(data, scale, None, fmt)]


def _kernel(len_ref, pt_ref, *refs, fmt, n_parts, n_leaves, group, num_new, sm_scale):
  q_refs = refs[:n_parts]
  k_new_refs = refs[n_parts : 2 * n_parts]
  v_new_refs = refs[2 * n_parts : 3 * n_parts]
  k_leaf_refs = refs[3 * n_parts : 3 * n_parts + n_leaves]
  v_leaf_refs = refs[3 * n_parts + n_leaves : 3 * n_parts + 2 * n_leaves]
  o_refs = refs[3 * n_parts + 2 * n_leaves :]
  length = len_ref[0]
  q_parts = [r[...] for r in q_refs]
  dtype = q_parts[0].dtype
  rows = q_parts[0].shape[0]
  page_size = k_leaf_refs[0].shape[1]

  def logits(k_parts):
    return sum(_dot(q, k, 1, 1) for q, k in zip(q_parts, k_parts)) * sm_scale

  # Own chunk: row m (token m // group) sees new tokens u <= m // group.
  new_cols = k_new_refs[0].shape[0]
  row_t = lax.broadcasted_iota(jnp.int32, (rows, new_cols), 0) // group
  col_u = lax.broadcasted_iota(jnp.int32, (rows, new_cols), 1)
  s_own = jnp.where(
    (col_u <= row_t) & (col_u < num_new), logits([r[...] for r in k_new_refs]), -jnp.inf
  )
  m_Q = jnp.max(s_own, axis=1)
  p_own = jnp.exp(s_own - m_Q[:, None])
  l_Q = jnp.sum(p_own, axis=1)
  accs = [_dot(p_own.astype(dtype), r[...]) for r in v_new_refs]

  def body(i, carry):
    m_Q, l_Q, accs = carry
    page = pt_ref[i]
    valid_S = i * page_size + lax.broadcasted_iota(jnp.int32, (page_size, 1), 0) < length
    # Rounded to the compute dtype (as a cache read is), then unused slots zeroed: NaN-safe.
    k_parts = [jnp.where(valid_S, x.astype(dtype), 0) for x in _page_parts(k_leaf_refs, page, fmt)]
    v_parts = [jnp.where(valid_S, x.astype(dtype), 0) for x in _page_parts(v_leaf_refs, page, fmt)]
    s_QxS = jnp.where(valid_S[:, 0][None, :], logits(k_parts), -jnp.inf)
    m_new = jnp.maximum(m_Q, jnp.max(s_QxS, axis=1))
    alpha = jnp.exp(m_Q - m_new)
    p_QxS = jnp.exp(s_QxS - m_new[:, None])
    l_Q = l_Q * alpha + jnp.sum(p_QxS, axis=1)
    accs = [a * alpha[:, None] + _dot(p_QxS.astype(dtype), v) for a, v in zip(accs, v_parts)]
    return m_new, l_Q, accs

  _, l_Q, accs = lax.fori_loop(0, pl.cdiv(length, page_size), body, (m_Q, l_Q, accs))
  for o_ref, acc in zip(o_refs, accs):
    o_ref[...] = (acc / l_Q[:, None]).astype(o_ref.dtype)


def _leaves(packed: PackedKV):
  return [x for x in (packed.data, packed.scale, packed.tensor_scale) if x is not None]


def _leaf_spec(x):
  """Whole page pool of one KV head: [pages, page_size, (K,) ...] with K (axis 2) squeezed."""
  if x.ndim == 2:  # nvfp4 tensor scale [pages, page_size]: shared by the heads.
    return pl.BlockSpec(x.shape, lambda b, h: (0, 0))
  block = (x.shape[0], x.shape[1], None, *x.shape[3:])
  return pl.BlockSpec(block, lambda b, h: (0, 0, h) + (0,) * (x.ndim - 3))


def _split_parts(x, n_parts):
  """[..., D] -> n_parts arrays [..., D / n_parts] (nvfp4: even and odd columns)."""
  return [x] if n_parts == 1 else [x[..., 0::2], x[..., 1::2]]


def _check(k_pages: PackedKV, v_pages: PackedKV, kv_heads: int, head_dim: int):
  for name, p in (("k_pages", k_pages), ("v_pages", v_pages)):
    if p.data.ndim != 4 or p.data.shape[2] != kv_heads or p.head_dim != head_dim:
      raise ValueError(
        f"{name}.data has shape {p.data.shape}; expected [pages, page_size, {kv_heads}, "
        f"{head_dim // 2 if p.fmt == 'nvfp4' else head_dim}] for format {p.fmt!r}."
      )
    needs = {"fp8": (1, 0), "mxfp8": (1, 0), "mxfp8_rceil": (1, 0), "nvfp4": (1, 1)}
    need_scale, need_tensor = needs.get(p.fmt, (0, 0))
    if (p.scale is not None) != need_scale or (p.tensor_scale is not None) != need_tensor:
      raise ValueError(
        f"{name}: format {p.fmt!r} takes scale / tensor_scale = "
        f"{bool(need_scale)} / {bool(need_tensor)}."
      )
  if k_pages.fmt != v_pages.fmt:
    raise ValueError(f"K and V pages differ in format: {k_pages.fmt!r} vs {v_pages.fmt!r}.")


def paged_decode(
  q_BxTxNxH: jax.Array,
  k_new_BxTxKxH: jax.Array,
  v_new_BxTxKxH: jax.Array,
  k_pages: PackedKV,
  v_pages: PackedKV,
  page_table_BxP: jax.Array,
  lengths_B: jax.Array,
  *,
  sm_scale: float | None = None,
  variant: str | None = None,
  interpret: bool | None = None,
) -> jax.Array:
  """Attention of T new tokens per sequence to its paged cache and to each other.

  Args:
    q_BxTxNxH: queries of the new tokens (N query heads).
    k_new_BxTxKxH, v_new_BxTxKxH: their own fresh K/V (not yet in the cache).
    k_pages, v_pages: the page pools, leaves [pages, page_size, K, ...] as kv_formats
      describes (nvfp4 tensor_scale [pages, page_size]).
    page_table_BxP: int32 page ids of each sequence's slots [p * page_size, (p+1) * page_size);
      entries past ceil(length / page_size) are never read.
    lengths_B: int32 cached tokens per sequence (slots >= length are masked, may be NaN).
    sm_scale: logit scale (default D ** -0.5).
    variant: 'generic' (one kernel for interpret, Triton and Mosaic; the whole page pool of a
      head is one block) or 'tpu' (pages pipelined through scalar-prefetched page ids,
      `paged_decode_tpu`). Default: 'tpu' on TPU, else 'generic'.
    interpret: Pallas interpret mode (default: exactly when there is no GPU/TPU). With the
      'tpu' variant, True means Pallas' TPU interpreter (`pltpu.InterpretParams()`).

  Returns:
    [B, T, N, H] in q's dtype. Forward only (decode needs no gradient).
  """
  b, t, n, d = q_BxTxNxH.shape
  kv_heads = k_new_BxTxKxH.shape[2]
  _check(k_pages, v_pages, kv_heads, d)
  group = n // kv_heads
  fmt = k_pages.fmt
  n_parts = 2 if fmt == "nvfp4" else 1
  sm_scale = float(d**-0.5 if sm_scale is None else sm_scale)
  variant = platform.variant_default(variant)
  interpret = platform.interpret_default(interpret, variant)
  if variant == "tpu":
    min_rows = paged_decode_tpu.ROWS  # Mosaic's tiling, also in interpret mode.
  else:
    min_rows = 1 if interpret else _MIN_ROWS[platform.platform()]

  # q -> [B, K, rows, H] with row m = t * G + g; own K/V -> [B, K, T, H]; both padded to
  # min_rows (padded rows are dropped, padded own keys are masked by u < T), and through
  # Triton to a power of two, as its tiles must be (a chunk of T = 12 with G = 2: 32 rows).
  rows = t * group
  rows_pad, t_pad = max(rows, min_rows), max(t, min_rows)
  if variant == "generic" and not interpret and platform.platform() == "gpu":
    rows_pad, t_pad = pl.next_power_of_2(rows_pad), pl.next_power_of_2(t_pad)
  q = (
    q_BxTxNxH.reshape(b, t, kv_heads, group, d)
    .transpose(0, 2, 1, 3, 4)
    .reshape(b, kv_heads, rows, d)
  )
  q = jnp.pad(q, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0)))
  own = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, t_pad - t), (0, 0))).astype(
    q.dtype
  )
  q_parts = _split_parts(q, n_parts)
  k_new_parts = _split_parts(own(k_new_BxTxKxH), n_parts)
  v_new_parts = _split_parts(own(v_new_BxTxKxH), n_parts)
  impl = paged_decode_tpu.paged_decode_tpu if variant == "tpu" else _generic
  out_parts = impl(
    q_parts,
    k_new_parts,
    v_new_parts,
    k_pages,
    v_pages,
    page_table_BxP.astype(jnp.int32),
    lengths_B.astype(jnp.int32),
    group=group,
    num_new=t,
    sm_scale=sm_scale,
    interpret=interpret,
  )
  out = out_parts[0] if n_parts == 1 else jnp.stack(out_parts, axis=-1).reshape(*q.shape)
  out = out[:, :, :rows].reshape(b, kv_heads, t, group, d).transpose(0, 2, 1, 3, 4)
  return out.reshape(b, t, n, d)


def _generic(
  q_parts,
  k_new_parts,
  v_new_parts,
  k_pages,
  v_pages,
  page_table_BxP,
  lengths_B,
  *,
  group,
  num_new,
  sm_scale,
  interpret,
):
  """The generic pallas_call: one program per (sequence, KV head), whole page pool blocks."""
  fmt = k_pages.fmt
  n_parts = len(q_parts)
  b, kv_heads = q_parts[0].shape[:2]
  k_leaves, v_leaves = _leaves(k_pages), _leaves(v_pages)
  # Page table padded to a power of two (Triton block shapes).
  pages_per_seq = page_table_BxP.shape[1]
  page_table = jnp.pad(
    page_table_BxP.astype(jnp.int32),
    ((0, 0), (0, pl.next_power_of_2(pages_per_seq) - pages_per_seq)),
  )

  row_spec = lambda x: pl.BlockSpec((None, None, *x.shape[2:]), lambda b, h: (b, h, 0, 0))
  in_specs = [
    pl.BlockSpec((1,), lambda b, h: (b,)),
    pl.BlockSpec((None, page_table.shape[1]), lambda b, h: (b, 0)),
    *[row_spec(x) for x in q_parts + k_new_parts + v_new_parts],
    *[_leaf_spec(x) for x in k_leaves + v_leaves],
  ]
  kernel = functools.partial(
    _kernel,
    fmt=fmt,
    n_parts=n_parts,
    n_leaves=len(k_leaves),
    group=group,
    num_new=num_new,
    sm_scale=sm_scale,
  )
  return pl.pallas_call(
    kernel,
    grid=(b, kv_heads),
    in_specs=in_specs,
    out_specs=[row_spec(x) for x in q_parts],
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in q_parts],
    interpret=interpret,
    compiler_params=platform.compiler_params(interpret),
    name=f"paged_decode_{fmt}",
  )(
    lengths_B.astype(jnp.int32),
    page_table,
    *q_parts,
    *k_new_parts,
    *v_new_parts,
    *k_leaves,
    *v_leaves,
  )
