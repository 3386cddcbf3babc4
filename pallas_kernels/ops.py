"""In-kernel helpers shared by the kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kv_formats


def dot_f32(a, b, contract_a: int = 1, contract_b: int = 0):
  """2-D matmul accumulated in float32; float32 inputs use exact float32 products (no TF32 or
  bf16 passes), so interpret mode and GPU/TPU agree with the float32 references."""
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(
    a,
    b,
    (((contract_a,), (contract_b,)), ((), ())),
    precision=lax.Precision.HIGHEST if exact else None,
    preferred_element_type=jnp.float32,
  )


def block_start(t, prefill_block: int):
  """The first position of t's prefill block (blocks of prefill_block aligned at 0; t >= 0, so
  truncating division is floor). prefill_block 1 is t itself, with no division."""
  return t if prefill_block == 1 else lax.div(t, prefill_block) * prefill_block


def _positions(q_start, k_start, block_q: int, block_k: int):
  t = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  s = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  return t, s


def past_mask(q_start, k_start, block_q: int, block_k: int, prefill_block: int = 1):
  """[block_q, block_k] bool: past key position s < block_start(t) (s < t for block 1)."""
  t, s = _positions(q_start, k_start, block_q, block_k)
  return s < block_start(t, prefill_block)


def own_mask(q_start, k_start, block_q: int, block_k: int, prefill_block: int):
  """[block_q, block_k] bool: own key position s in t's block and before it (the diagonal is
  the kernels' initial term, not part of this mask)."""
  t, s = _positions(q_start, k_start, block_q, block_k)
  return (s >= block_start(t, prefill_block)) & (s < t)


def past_end(q_start, block_q: int, prefill_block: int):
  """One past the last past position a query tile reads: block_start of its last row."""
  return block_start(q_start + block_q - 1, prefill_block)


def own_tiles(q_start, block_q: int, block_k: int, prefill_block: int):
  """Key tiles [lo, hi) holding a query tile's in-block earlier own positions: those between
  its first row's block start and its last row - 1 (empty when hi <= lo)."""
  lo = block_start(q_start, prefill_block) // block_k
  return lo, pl.cdiv(q_start + block_q - 1, block_k)


def own_query_tiles(k_start, block_q: int, block_k: int, prefill_block: int, num_q_tiles: int):
  """Query tiles [lo, hi) reading a key tile's positions as own in-block earlier keys: t in
  (s, block_start(s) + prefill_block) for s in the tile."""
  last_block_end = block_start(k_start + block_k - 1, prefill_block) + prefill_block
  return (k_start + 1) // block_q, jnp.minimum(pl.cdiv(last_block_end, block_q), num_q_tiles)


def past_query_start(k_start, prefill_block: int):
  """The first query position reading a past key tile: the next block start after k_start."""
  return block_start(k_start, prefill_block) + prefill_block


def same_segment(mask_QxS, seg_refs, q_rows, k_cols):
  """mask & (query and key in the same document) when segment ids are given (seg_refs: the
  query ids as a [rows, 1] column and the key ids as a [1, cols] row); mask itself otherwise.
  q_rows / k_cols index the refs (slices, or `...` for a whole block)."""
  if seg_refs is None:
    return mask_QxS
  seg_q_ref, seg_k_ref = seg_refs
  return mask_QxS & (seg_q_ref[q_rows, :] == seg_k_ref[:, k_cols])


def past_tile(leaf_refs, start, size: int, fmt: str | None, dtype):
  """Past K or V rows [start, start + size) as [size, D]; a packed past is dequantized here.

  Packed leaves (kernel layout, one row per token): data [T, H or H / 2], fp8 scale [T, 1],
  mx / nvfp4 scales [T, H / block], nvfp4 tensor scale [T, 1].
  """
  rows = pl.ds(start, size)
  data = leaf_refs[0][rows, :]
  if fmt is None:
    return data
  # Scales stay 2-D columns ([size, 1]), as TPU tiles them; values as kv_formats computes them.
  if fmt == "fp8":
    values = data.astype(jnp.float32) * leaf_refs[1][rows, :]
  else:
    scale = leaf_refs[1][rows, :] if len(leaf_refs) > 1 else None
    tensor_scale = leaf_refs[2][rows, :] if fmt == "nvfp4" else None
    values = kv_formats.dequantize(kv_formats.PackedKV(data, scale, tensor_scale, fmt))
  return values.astype(dtype)  # Rounded as a cache read would be.
