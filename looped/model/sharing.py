"""Shared-KV forwards (docs/design.md §3): parallel Jacobi passes and exact token-by-token decode.

Exact shared decode is sequential: token t's recurrences read the *final* recurrence's K/V of
tokens s < t, which themselves were computed with shared reads. The Jacobi scheme approximates it
in parallel: pass 0 is the ordinary (unshared) forward; pass j reruns the model with every core
attention reading pass j-1's final K/V for s < t and its own K/V at s = t. Pass j is exact for
positions t <= j (induction on t), so T - 1 passes reproduce exact decode on T tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
  **kwargs,
):
  """Logits after `num_passes` shared passes (0 = the unshared forward). Returns (logits, aux).

  `num_passes` may be a traced integer: the passes run in a fori_loop, so one compilation
  serves every pass count.
  """
  out = model.apply(params, tokens_BxT, kv_format=kv_format, **kwargs)

  def next_pass(_, out):
    return shared_pass(
      model, params, tokens_BxT, out[1]["final_kv"], read_shared_R, kv_format, **kwargs
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
  kv_format: str | None = None,
  cache_dtype=None,
):
  """Logits of every position by prefilling `prefill` tokens, then decoding one at a time.

  With share_kv the cache keeps only final-recurrence K/V, so this is the exact shared
  perplexity's forward. Returns (logits_BxTxV, final KVCache).
  """
  b, t = tokens_BxT.shape
  cache = init_cache(model.cfg, b, t, share_kv, cache_dtype, kv_format)
  chunks = []
  if prefill:
    logits, aux = model.apply(params, tokens_BxT[:, :prefill], cache=cache)
    cache = aux["cache"]
    chunks.append(logits)

  def step(cache, token_B):
    logits, aux = model.apply(params, token_B[:, None], cache=cache)
    return aux["cache"], logits[:, 0]

  if prefill < t:
    cache, logits_TxBxV = jax.lax.scan(step, cache, tokens_BxT[:, prefill:].T)
    chunks.append(jnp.moveaxis(logits_TxBxV, 0, 1))
  return jnp.concatenate(chunks, axis=1), cache
