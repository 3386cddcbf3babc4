"""Shared-KV forwards (docs/design.md §3): parallel Jacobi passes, exact token-by-token decode
and block prefill.

Exact shared decode is sequential: token t's recurrence r reads recurrence c(r)'s K/V of tokens
s < t (the KV policy's map, kv_policy.py; 'final': c(r) = R), which themselves were computed with
shared reads. The Jacobi scheme approximates it in parallel: pass 0 is the ordinary (unshared)
forward; pass j reruns the model with every core attention of recurrence r reading pass j-1's
recurrence-c(r) K/V for s < t and its own K/V at s = t. Pass j is exact for positions t <= j
(induction on t), so T - 1 passes reproduce exact decode on T tokens, for every policy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from looped.model import adaptive
from looped.model.kv_cache import init_cache
from looped.model.looped_lm import LoopedLM


def jacobi_forward(
  model: LoopedLM,
  params,
  tokens_BxT: jax.Array,
  num_passes: int,
  *,
  read_shared_R: jax.Array | None = None,
  kv_format: str | None = None,
  prefill_block: int | None = None,
  **kwargs,
):
  """Logits after `num_passes` shared passes (0 = the unshared forward). Returns (logits, aux).

  `num_passes` may be a traced integer: the passes run in a fori_loop, so one compilation
  serves every pass count. With prefill_block C the passes read as block prefill does (pass 0,
  unshared, is already exact for the first block), so (number of blocks - 1) passes equal
  `decode_forward(..., share_kv=True, block=C)`. A `kv_policy` keyword (LoopedLM's) is passed
  to every pass and matches `decode_forward(..., kv_policy=...)`.
  """
  out = model.apply(params, tokens_BxT, kv_format=kv_format, **kwargs)

  def next_pass(_, out):
    return shared_pass(
      model,
      params,
      tokens_BxT,
      out[1]["final_kv"],
      read_shared_R,
      kv_format,
      prefill_block=prefill_block,
      **kwargs,
    )

  return jax.lax.fori_loop(0, num_passes, next_pass, out)


def shared_pass(
  model: LoopedLM,
  params,
  tokens_BxT: jax.Array,
  final_kv,
  read_shared_R: jax.Array | None = None,
  kv_format: str | None = None,
  **kwargs,
):
  """One Jacobi pass: every core attention reads `final_kv` (the previous pass's final K/V)
  for s < t. Returns (logits, aux)."""
  return model.apply(
    params,
    tokens_BxT,
    shared_kv=final_kv,
    read_shared_R=read_shared_R,
    kv_format=kv_format,
    **kwargs,
  )


def decode_forward(
  model: LoopedLM,
  params,
  tokens_BxT: jax.Array,
  *,
  share_kv: bool,
  prefill: int = 0,
  block: int = 1,
  kv_format: str | None = None,
  cache_dtype=None,
  segment_ids_BxT: jax.Array | None = None,
  kv_policy: str = "final",
  depth: adaptive.DepthSettings | None = None,
  exit_lookup: str = adaptive.DEFAULT_LOOKUP,
):
  """Logits of every position by prefilling `prefill` tokens in one call, then the rest in
  calls of `block` tokens (the last one may be shorter).

  With share_kv the cache keeps only the recurrences kv_policy caches (kv_policy.py; 'final':
  the final one): block = 1 (and prefill 0 or 1) is exact shared decode, the shared
  perplexity's forward; block = C > 1 is block prefill (docs/design.md §3).
  segment_ids_BxT: document masking (LoopedLM's), the row's ids; every call reads them for
  its tokens and for the cache's slots (slot s holds position s).
  depth: each call's recurrences and exits (docs/design.md §3, "Depth at test time"): the
  prefill call is a prompt (DepthSettings.exit_in_prefill), every later call exits by the
  criterion, and under continuous compute starts from the previous call's final state; the
  returned cache then records every position's recurrences (KVCache.depth_BxS). exit_lookup:
  the unshared cache's lookup (adaptive.LOOKUPS).
  Returns (logits_BxTxV, final KVCache).
  """
  if block < 1 or prefill < 0:
    raise ValueError(f"block must be >= 1 and prefill >= 0, got {block} and {prefill}.")
  b, t = tokens_BxT.shape
  cfg = model.cfg
  depths = depth is not None
  cache = init_cache(cfg, b, t, share_kv, cache_dtype, kv_format, kv_policy, depths=depths)
  chunks = []

  masked = segment_ids_BxT is not None
  ids_BxT = segment_ids_BxT if masked else jnp.zeros((b, t), jnp.int32)

  def call(carry, chunk, prompt=False):
    cache, state_BxD = carry
    tokens, ids = chunk
    segments = dict(segment_ids_BxT=ids, cache_segment_ids_BxS=ids_BxT) if masked else {}
    if depths:
      recurrences = depth.recurrences or cfg.num_recurrences
      inputs = depth.inputs(b, cfg.d_model, recurrences, prompt, state_BxD)
      inputs = inputs.replace(warm_B=inputs.warm_B & (cache.length_B > 0))
      segments.update(depth=inputs, exit_lookup=exit_lookup)
    logits, aux = model.apply(params, tokens, cache=cache, **segments)
    return (aux["cache"], aux.get("state_BxD", state_BxD)), logits

  carry = (cache, jnp.zeros((b, cfg.d_model), jnp.float32))
  if prefill:
    carry, logits = call(carry, (tokens_BxT[:, :prefill], ids_BxT[:, :prefill]), prompt=True)
    chunks.append(logits)
  whole = (t - prefill) // block * block
  if whole:
    as_blocks = lambda x: x[:, prefill : prefill + whole].reshape(b, -1, block).swapaxes(0, 1)
    carry, logits_NxBxCxV = jax.lax.scan(call, carry, (as_blocks(tokens_BxT), as_blocks(ids_BxT)))
    chunks.append(jnp.moveaxis(logits_NxBxCxV, 0, 1).reshape(b, whole, -1))
  if prefill + whole < t:
    rest = slice(prefill + whole, None)
    carry, logits = call(carry, (tokens_BxT[:, rest], ids_BxT[:, rest]))
    chunks.append(logits)
  return jnp.concatenate(chunks, axis=1), carry[0]
