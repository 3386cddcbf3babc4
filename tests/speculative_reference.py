"""A plain reference of greedy speculative decoding with a shallow draft, as Huginn's public
`generate_speculative` does it (seal-rg/recurrent-pretraining, recpre/raven_modeling_minimal.py),
over a LoopedLM's decode calls: batch 1, a dense `init_cache` cache, zero initial state.

Written from the algorithm's description, not from the engine, so that the engine's speculative
decoding can be compared with it:

- prefill the prompt in one call at `recurrences` and take its argmax as the first token;
- each round, with the last token not yet in the cache: draft `lookahead` tokens one call at a
  time at `draft_recurrences` (feeding the last token, then each draft); reset the cache's
  length to drop those entries; verify in one call at `recurrences` the same `lookahead` fed
  tokens (the last token and every draft but the last);
- accept the drafts before the first position where the verifier's argmax differs, plus the
  verifier's token there; when all agree, the `lookahead` drafts and nothing more (the last
  draft was never fed, so the next round feeds it);
- reset the cache's length to the tokens accepted (the last accepted token stays uncached);
- stop after the round in which at least `new_tokens` tokens exist (a round may overshoot).

Resetting the length is all a trim needs: slots past it are never read and are overwritten by
the next call. Greedy, equal-depth decoding must give the same tokens (`greedy`), since every
accepted token is the verifier's argmax at full depth given the accepted prefix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from looped.model import adaptive
from looped.model.kv_cache import KVCache, init_cache
from looped.model.looped_lm import LoopedLM


@functools.cache
def _step(model: LoopedLM, exit_lookup: str):
  """One compiled decode call: (params, tokens_1xT, cache, depth) -> (logits, aux)."""
  return jax.jit(lambda p, x, c, d: model.apply(p, x, cache=c, depth=d, exit_lookup=exit_lookup))


class _Decoder:
  """A LoopedLM's decode calls at batch 1 with a chosen number of recurrences per call."""

  def __init__(self, model, params, max_len: int, share_kv: bool, exit_lookup: str):
    self.model, self.params = model, params
    self.step = _step(model, exit_lookup)
    self.cache: KVCache = init_cache(model.cfg, 1, max_len, share_kv, depths=not share_kv)

  @property
  def length(self) -> int:
    return int(self.cache.length_B[0])

  def call(self, tokens: list[int], recurrences: int) -> list[int]:
    """Feeds `tokens` at `recurrences` (zero h_0, no exit); returns each position's argmax."""
    cfg = self.model.cfg
    depth = adaptive.depth_inputs(1, cfg.d_model, recurrences, init_scale=0.0)
    x_1xT = jnp.asarray([tokens], jnp.int32)
    logits_1xTxV, aux = self.step(self.params, x_1xT, self.cache, depth)
    self.cache = aux["cache"]
    return jnp.argmax(logits_1xTxV[0], axis=-1).tolist()

  def trim(self, length: int):
    """Keeps the first `length` cached tokens."""
    self.cache = self.cache.replace(length_B=jnp.full_like(self.cache.length_B, length))


def accept(drafts: list[int], verified: list[int]) -> list[int]:
  """The drafts before the first disagreement with the verifier, plus its token there."""
  for j, (draft, want) in enumerate(zip(drafts, verified)):
    if draft != want:
      return drafts[:j] + [want]
  return list(drafts)


def speculative(
  model: LoopedLM,
  params,
  prompt: list[int],
  *,
  draft_recurrences: int,
  lookahead: int,
  recurrences: int,
  new_tokens: int,
  share_kv: bool = False,
  exit_lookup: str = adaptive.DEFAULT_LOOKUP,
) -> tuple[list[int], list[int]]:
  """(generated tokens, tokens accepted per round) of greedy speculative decoding (module
  docstring). The model's num_recurrences must cover both depths."""
  max_len = len(prompt) + new_tokens + lookahead
  decoder = _Decoder(model, params, max_len, share_kv, exit_lookup)
  tokens = decoder.call(list(prompt), recurrences)[-1:]
  accepted = []
  while len(tokens) < new_tokens:
    start = decoder.length  # Prompt and tokens but the last.
    drafts = [tokens[-1]]
    for _ in range(lookahead):
      drafts += decoder.call(drafts[-1:], draft_recurrences)
    decoder.trim(start)
    verified = decoder.call(drafts[:-1], recurrences)  # The last token, then drafts.
    new = accept(drafts[1:], verified)
    decoder.trim(start + len(new))
    tokens += new
    accepted.append(len(new))
  return tokens, accepted


def greedy(
  model: LoopedLM,
  params,
  prompt: list[int],
  *,
  recurrences: int,
  new_tokens: int,
  share_kv: bool = False,
  exit_lookup: str = adaptive.DEFAULT_LOOKUP,
) -> list[int]:
  """Plain greedy decoding at `recurrences`: the prompt in one call, then a call per token."""
  decoder = _Decoder(model, params, len(prompt) + new_tokens, share_kv, exit_lookup)
  tokens = decoder.call(list(prompt), recurrences)[-1:]
  while len(tokens) < new_tokens:
    tokens += decoder.call(tokens[-1:], recurrences)
  return tokens
