"""What the engine must compute, without the engine: each request decoded on its own dense cache.

Under the semantics of docs/design.md §3 a request's prompt is computed in blocks of C tokens
aligned from its start (the last one cut at the prompt's end) and every later position in a
call of its own; greedy tokens are fed back. Rows are batched only to save compilations: each
row has its own cache and its own block schedule (one call per block, padded to C tokens, the
row's cache length advanced by its real block length), so rows never interact. A model with a
recurrent state (KDA) is run one request at a time on calls of exactly each block's tokens, so
no padding ever reaches its state: the engine's handling of padding is what is under test. No
pages, no scheduler, no prefix cache, no preemption: what the engine's chunking, hits and
recomputes must reproduce.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from looped.model.kv_cache import init_cache
from looped.model.looped_lm import LoopedLM


def _schedule(prompt_len: int, output_len: int, block: int) -> list[tuple[int, int]]:
  """(start, length) of each call: prompt blocks, then one call per fed-back token."""
  calls = [(s, min(block, prompt_len - s)) for s in range(0, prompt_len, block)]
  return calls + [(p, 1) for p in range(prompt_len, prompt_len + output_len - 1)]


@functools.lru_cache(maxsize=16)
def _call(cfg, block: int):
  model = LoopedLM(cfg)

  @jax.jit
  def call(params, cache, tokens_BxC, num_new_B):
    logits_BxCxV, aux = model.apply(params, tokens_BxC, cache=cache)
    cache = aux["cache"].replace(length_B=cache.length_B + num_new_B)
    return cache, logits_BxCxV

  return call


def block_reference(
  cfg,
  params,
  requests,
  *,
  share_kv: bool,
  block: int,
  kv_format: str | None = None,
  slots: int | None = None,
  kv_policy: str = "final",
) -> tuple[list[list[int]], list[dict[int, np.ndarray]]]:
  """Greedy tokens and per-position logits ({position: logits}) of every request.

  slots: the dense caches' length (default: just enough). Giving the engine's (its page-table
  width in tokens) makes attention reduce over the same number of slots, so values stored in a
  KV format round the same way instead of flipping a last bit on a different summation order.
  """
  schedules = [_schedule(r.prompt_len, r.output_len, block) for r in requests]
  length = max(r.prompt_len + r.output_len for r in requests) + block
  if slots is not None:
    if slots < length:
      raise ValueError(f"slots = {slots} < {length}, the longest request plus a block.")
    length = slots
  if any("kda" in cfg.mixers(stage) for stage in ("prelude", "core", "coda")):
    return _unpadded(cfg, params, requests, schedules, share_kv, kv_format, length)
  b = len(requests)
  cache = init_cache(cfg, b, length, share_kv, kv_format=kv_format, kv_policy=kv_policy)
  tokens = [list(r.prompt_tokens) for r in requests]
  generated = [[] for _ in requests]
  logits = [{} for _ in requests]
  call = _call(cfg, block)
  for k in range(max(len(s) for s in schedules)):
    tokens_BxC = np.zeros((b, block), np.int32)
    num_new = np.zeros((b,), np.int32)
    for i, sched in enumerate(schedules):
      if k < len(sched):
        start, q = sched[k]
        tokens_BxC[i, :q] = tokens[i][start : start + q]
        num_new[i] = q
    cache, logits_BxCxV = call(params, cache, jnp.asarray(tokens_BxC), jnp.asarray(num_new))
    logits_BxCxV = np.asarray(logits_BxCxV)
    for i, sched in enumerate(schedules):
      if k < len(sched):
        start, q = sched[k]
        for j in range(q):
          logits[i][start + j] = logits_BxCxV[i, j]
        if start + q >= requests[i].prompt_len:  # The call ends at the sequence's last token.
          token = int(logits_BxCxV[i, q - 1].argmax())
          generated[i].append(token)
          tokens[i].append(token)
  # A request whose schedule ended emits its last token from its last call; nothing after.
  return [g[: r.output_len] for g, r in zip(generated, requests)], logits


@functools.lru_cache(maxsize=16)
def _exact_call(cfg):
  model = LoopedLM(cfg)

  @jax.jit
  def call(params, cache, tokens_1xC):  # Compiles once per block length.
    logits_1xCxV, aux = model.apply(params, tokens_1xC, cache=cache)
    return aux["cache"], logits_1xCxV

  return call


def _unpadded(cfg, params, requests, schedules, share_kv, kv_format, length):
  """block_reference one request at a time, each call exactly its block's tokens."""
  call = _exact_call(cfg)
  all_generated, all_logits = [], []
  for r, sched in zip(requests, schedules):
    cache = init_cache(cfg, 1, length, share_kv, kv_format=kv_format)
    tokens, generated, logits = list(r.prompt_tokens), [], {}
    for start, q in sched:
      cache, logits_1xCxV = call(params, cache, jnp.asarray([tokens[start : start + q]]))
      logits_CxV = np.asarray(logits_1xCxV[0])
      for j in range(q):
        logits[start + j] = logits_CxV[j]
      if start + q >= r.prompt_len:
        generated.append(int(logits_CxV[q - 1].argmax()))
        tokens.append(generated[-1])
    all_generated.append(generated[: r.output_len])
    all_logits.append(logits)
  return all_generated, all_logits
