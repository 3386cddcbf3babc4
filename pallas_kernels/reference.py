"""Pure-JAX references for the kernels: dense score matrices, float32 softmax.

These materialise the full [T, S] scores (what the kernels avoid); they define the math the
kernels are tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import kv_formats


def _softmax_attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, sm_scale):
  """Masked GQA softmax attention in float32; every row must see at least one key."""
  b, t, n, d = q_BxTxNxH.shape
  kh = k_BxSxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, n // kh, d).astype(jnp.float32)
  logits = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxH, k_BxSxKxH.astype(jnp.float32)) * sm_scale
  logits = jnp.where(mask_BxTxS[:, None, None], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxH.astype(jnp.float32))
  return out.reshape(b, t, n, d).astype(q_BxTxNxH.dtype)


def shared_attention(
  q_BxTxNxH,
  k_BxTxKxH,
  v_BxTxKxH,
  k_past_BxTxKxH,
  v_past_BxTxKxH,
  sm_scale=None,
  prefill_block=None,
  segment_ids_BxT=None,
):
  """Position t attends to the past K/V at s < b(t) and to its own K/V at b(t) <= s <= t, with
  b(t) = t (prefill_block None) or t's block start (t // prefill_block) * prefill_block; with
  segment ids only to positions s of t's document."""
  b, t, _, d = q_BxTxNxH.shape
  sm_scale = d**-0.5 if sm_scale is None else sm_scale
  k = jnp.concatenate([k_past_BxTxKxH, k_BxTxKxH], axis=1)
  v = jnp.concatenate([v_past_BxTxKxH, v_BxTxKxH], axis=1)
  idx = jnp.arange(t)
  start_T = idx if prefill_block is None else idx // prefill_block * prefill_block
  past_TxT = idx[None, :] < start_T[:, None]
  own_TxT = (idx[None, :] >= start_T[:, None]) & (idx[None, :] <= idx[:, None])
  mask = jnp.broadcast_to(jnp.concatenate([past_TxT, own_TxT], axis=1), (b, t, 2 * t))
  if segment_ids_BxT is not None:
    same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
    mask = mask & jnp.concatenate([same_BxTxT, same_BxTxT], axis=-1)
  return _softmax_attend(q_BxTxNxH, k, v, mask, sm_scale)


def gather_pages(pages: kv_formats.PackedKV, page_table_BxP) -> kv_formats.PackedKV:
  """The packed pages of each row laid out contiguously: leaves [B, P * page_size, ...]."""

  def gather(a):
    g = a[page_table_BxP]  # [B, P, page_size, ...]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])

  return kv_formats.PackedKV(
    gather(pages.data),
    None if pages.scale is None else gather(pages.scale),
    None if pages.tensor_scale is None else gather(pages.tensor_scale),
    pages.fmt,
  )


def paged_decode(
  q_BxTxNxH,
  k_new_BxTxKxH,
  v_new_BxTxKxH,
  k_pages: kv_formats.PackedKV,
  v_pages: kv_formats.PackedKV,
  page_table_BxP,
  lengths_B,
  sm_scale=None,
):
  """New tokens attend to cache slots s < length (read through the page table) and causally to
  each other. Gathers and dequantizes the whole cache (the copy the kernel never makes)."""
  b, t, _, d = q_BxTxNxH.shape
  sm_scale = d**-0.5 if sm_scale is None else sm_scale
  dtype = q_BxTxNxH.dtype
  k_cache = kv_formats.dequantize(gather_pages(k_pages, page_table_BxP)).astype(dtype)
  v_cache = kv_formats.dequantize(gather_pages(v_pages, page_table_BxP)).astype(dtype)
  s = k_cache.shape[1]
  valid_BxS = jnp.arange(s)[None, :] < lengths_B[:, None]
  # Unused slots may hold NaN: zero them so that masked probabilities (0) times NaN do not leak.
  k_cache = jnp.where(valid_BxS[:, :, None, None], k_cache, 0)
  v_cache = jnp.where(valid_BxS[:, :, None, None], v_cache, 0)
  k = jnp.concatenate([k_cache, k_new_BxTxKxH.astype(dtype)], axis=1)
  v = jnp.concatenate([v_cache, v_new_BxTxKxH.astype(dtype)], axis=1)
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  mask = jnp.concatenate(
    [jnp.broadcast_to(valid_BxS[:, None, :], (b, t, s)), jnp.broadcast_to(causal_TxT, (b, t, t))],
    axis=-1,
  )
  return _softmax_attend(q_BxTxNxH, k, v, mask, sm_scale)
