"""Self-speculative decoding: the looped model drafts with few recurrences, verifies with all.

A speculative round of a request whose last generated token x is not fed yet (at position c):
1. **Draft**: k one-token decodes at r recurrences feed x, d_1, ..., d_{k-1} and draw
   d_1, ..., d_k from the drafter's distributions q_i (greedy: argmax), on a copy of the
   request's cache.
2. **Verify**: one call at the request's own depth feeds the same k tokens at positions
   c .. c + k - 1 against the cache as it was before the draft, giving the verifier's p_i
   (Huginn's `generate_speculative`: the k fed tokens, no extra one). Under KV-sharing that
   call reads its block as block prefill does (each token reads the others' own recurrence);
   `verify_passes` n > 1 adds Jacobi passes, each reading the chunk's earlier tokens from the
   previous pass's final K/V, which equals plain shared decoding once n >= k.
3. **Accept** (`accept`): d_i is kept while u_i q_i(d_i) < p_i(d_i), u_i ~ U[0, 1) (greedy:
   while the verifier's argmax equals the draft); at the first rejection the verifier's token is
   drawn from the normalized max(0, p - q) (greedy: its argmax). So the emitted tokens are
   distributed as the verifier's; with every draft kept the round emits k tokens, else the
   accepted ones and the replacement.
4. **Commit**: only the positions whose tokens were emitted are written into the pages (the
   verifier's entries; the draft's never reach them), so a rejected draft leaves nothing behind.
   A recurrent state (KDA) cannot be rewound, so models with one run the verify call again on
   the emitted tokens only and keep that call's state.

One compiled program runs all of it for a batch of rows (`call_fn`), so a round is one step
of the engine: k + 1 tokens' host round trips become one. Keys: a request's n-th token draws
its draft, its acceptance and its replacement from fold_in(PRNGKey(seed), n) folded with 1, 2
and 3, so nothing depends on the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from looped.engine import paged_cache, sampling
from looped.model import adaptive

VERIFY_DOC = (
  "'block' (one verify call; under KV-sharing it reads its block as block prefill does) or a "
  "number n of Jacobi passes (n >= speculative_tokens: equal to plain shared decoding)."
)
_DRAW, _ACCEPT, _REPLACE = 1, 2, 3  # Key streams of a token (module docstring).


@dataclasses.dataclass(frozen=True)
class SpeculativeParams:
  """A request's speculation: draft depth r (0: off) and lookahead k."""

  recurrences: int = 0  # Draft recurrences r (0: no speculation).
  tokens: int = 4  # Tokens drafted, then verified, per round (k).

  @property
  def enabled(self) -> bool:
    return self.recurrences > 0

  def check(self, verify_recurrences: int, max_tokens: int) -> None:
    """ValueError naming the bad field: r may not exceed the verifier's recurrences."""
    for name, value in (("recurrences", self.recurrences), ("tokens", self.tokens)):
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_{name} = {value!r} must be an integer.")
    if self.enabled and not 0 < self.recurrences <= verify_recurrences:
      raise ValueError(
        f"speculative_recurrences = {self.recurrences} must be in [1, {verify_recurrences}] "
        f"(at most the {verify_recurrences} recurrences it drafts for), or 0: off."
      )
    if not 1 <= self.tokens <= max_tokens:
      raise ValueError(f"speculative_tokens = {self.tokens} must be in [1, {max_tokens}].")


def parse_verify(value) -> int:
  """gen./serve.speculative_verify -> Jacobi passes of the verify call ('block': 1)."""
  text = str(value).strip()
  if text == "block":
    return 1
  if text.isdigit() and int(text) >= 1:
    return int(text)
  raise ValueError(f"speculative_verify = {value!r}: expected 'block' or a number of passes >= 1.")


def _keys(seed_B, index_B, stream: int):
  """Per row: the key of token index_B of its request in one stream (module docstring)."""
  base = lambda s, i: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), i), stream)
  return jax.vmap(base)(seed_B, index_B)


def distribution(logits_BxV, temperature_B, top_k_B, top_p_B) -> jax.Array:
  """What `sampling.sample` draws from, as probabilities [B, V]: softmax of the filtered,
  tempered logits, or one-hot at the argmax for greedy rows (temperature 0). A batch of greedy
  rows skips the filtering's sort."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  greedy_BxV = jax.nn.one_hot(jnp.argmax(logits_BxV, axis=-1), logits_BxV.shape[-1])

  def sampled():
    t_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    scaled_BxV = logits_BxV / t_B[:, None]
    keep_BxV = sampling.filter_mask(scaled_BxV, top_k_B, top_p_B)
    probs_BxV = jax.nn.softmax(jnp.where(keep_BxV, scaled_BxV, -jnp.inf), axis=-1)
    return jnp.where((temperature_B > 0)[:, None], probs_BxV, greedy_BxV)

  return jax.lax.cond(jnp.any(temperature_B > 0), sampled, lambda: greedy_BxV)


def draw(probs_BxV, temperature_B, seed_B, index_B, stream: int = _DRAW) -> jax.Array:
  """A token per row from `distribution`'s probabilities (greedy rows: their argmax)."""
  greedy_B = jnp.argmax(probs_BxV, axis=-1).astype(jnp.int32)

  def drawn():
    keys = _keys(seed_B, index_B, stream)
    drawn_B = jax.vmap(jax.random.categorical)(keys, jnp.log(probs_BxV))
    return jnp.where(temperature_B > 0, drawn_B, greedy_B).astype(jnp.int32)

  return jax.lax.cond(jnp.any(temperature_B > 0), drawn, lambda: greedy_B)


def accept(draft_BxK, q_BxKxV, p_BxKxV, k_B, temperature_B, seed_B, index_B):
  """(emitted tokens [B, K], how many: m_B, drafts kept: a_B) of a round (module docstring).

  draft_BxK: d_1..d_K; q, p: the drafter's and verifier's distributions at the fed positions
  0..K-1 (position i predicts d_{i+1}); k_B: each row's lookahead (<= K; later positions are
  padding); index_B: the request's count of generated tokens before the round."""
  b, k = draft_BxK.shape
  i_K = jnp.arange(k)
  q_d_BxK = jnp.take_along_axis(q_BxKxV, draft_BxK[..., None], axis=-1)[..., 0]
  p_d_BxK = jnp.take_along_axis(p_BxKxV, draft_BxK[..., None], axis=-1)[..., 0]
  keys = jax.vmap(lambda i: _keys(seed_B, index_B + i, _ACCEPT), out_axes=1)(i_K)
  u_BxK = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(keys)
  ok_BxK = (u_BxK * q_d_BxK < p_d_BxK) & (i_K[None, :] < k_B[:, None])
  a_B = jnp.sum(jnp.cumprod(ok_BxK.astype(jnp.int32), axis=1), axis=1)  # Leading accepts.
  at_BxV = lambda x_BxKxV: jnp.take_along_axis(
    x_BxKxV, jnp.minimum(a_B, k - 1)[:, None, None], axis=1
  )[:, 0]
  p_a_BxV, q_a_BxV = at_BxV(p_BxKxV), at_BxV(q_BxKxV)
  residual_BxV = jnp.maximum(p_a_BxV - q_a_BxV, 0.0)
  mass_B = jnp.sum(residual_BxV, axis=-1, keepdims=True)
  residual_BxV = jnp.where(mass_B > 0, residual_BxV / jnp.maximum(mass_B, 1e-30), p_a_BxV)
  replacement_B = draw(residual_BxV, temperature_B, seed_B, index_B + a_B, _REPLACE)
  emitted_BxK = jnp.where(i_K[None, :] == a_B[:, None], replacement_B[:, None], draft_BxK)
  m_B = jnp.where(a_B < k_B, a_B + 1, k_B)
  return emitted_BxK, m_B, a_B


def _apply(model, params, tokens_BxT, cache, num_new_B, depth, exit_lookup, jacobi=False):
  kw = {} if depth is None else {"depth": depth, "exit_lookup": exit_lookup}
  return model.apply(params, tokens_BxT, cache=cache, num_new_B=num_new_B, jacobi=jacobi, **kw)


def draft(model, params, cache, first_B, k: int, k_B, depth, exit_lookup, sampler):
  """The draft loop (step 1): k one-token decodes in a scan over a copy of the cache; a row past
  its own k_B feeds nothing (num_new 0). Returns d_BxK and the drafter's q_BxKxV."""
  temperature_B, top_k_B, top_p_B, seed_B, index_B = sampler

  def one(carry, i):
    cache, token_B = carry
    num_new_B = (i < k_B).astype(jnp.int32)
    logits, aux = _apply(model, params, token_B[:, None], cache, num_new_B, depth, exit_lookup)
    q_BxV = distribution(logits[:, 0], temperature_B, top_k_B, top_p_B)
    next_B = draw(q_BxV, temperature_B, seed_B, index_B + i)
    return (aux["cache"], next_B), (next_B, q_BxV)

  _, (d_KxB, q_KxBxV) = jax.lax.scan(one, (cache, first_B), jnp.arange(k))
  return d_KxB.T, jnp.moveaxis(q_KxBxV, 0, 1)


def verify(model, params, cache, tokens_BxK, k_B, depth, exit_lookup, passes: int):
  """Step 2: logits [B, K, V] and aux of the verify call and its Jacobi passes."""
  logits, aux = _apply(model, params, tokens_BxK, cache, k_B, depth, exit_lookup)
  for _ in range(passes - 1):  # Each pass reads the previous pass's entries from the cache.
    again = aux["cache"].replace(length_B=cache.length_B)
    logits, aux = _apply(model, params, tokens_BxK, again, k_B, depth, exit_lookup, jacobi=True)
  return logits, aux


def call_fn(
  model,
  layout,
  return_logits: bool,
  attention_impl: str,
  exit_lookup: str,
  passes: int,
  params,
  pages,
  tokens_BxK,
  page_table_BxP,
  context_B,
  k_B,
  temperature_B,
  top_k_B,
  top_p_B,
  seed_B,
  index_B,
  targets_BxK,
  slot_B,
  *depth_args,
):
  """One padded speculative call (the module docstring's round) for rows whose token
  tokens_BxK[:, 0] is fed at context_B; depth_args: the executor's per-row depth arrays, then
  past depths, then each row's draft recurrences. Returns (pages, emitted_BxK, m_B, a_B,
  logprob_BxK, logits or None): the tokens emitted, how many, the drafts kept, and each emitted
  token's logprob under the verifier's raw logits."""
  del targets_BxK  # Same arguments as the plain call's (executor._CallInputs).
  b, k = tokens_BxK.shape
  *rows, past_depth_BxS, draft_B = depth_args
  slotted = layout.slotted_core(model.cfg)
  dtypes = paged_cache.page_dtypes(model.cfg, layout) if attention_impl == "xla" else None
  cache = paged_cache.gather(
    pages, page_table_BxP, context_B, layout, slot_B, slotted, None, dtypes
  )
  if past_depth_BxS.shape[1]:
    cache = cache.replace(depth_BxS=past_depth_BxS)
  depth = adaptive.DepthInputs(*rows)
  sampler = (temperature_B, top_k_B, top_p_B, seed_B, index_B)
  draft_depth = dataclasses.replace(depth, recurrences_B=draft_B)
  d_BxK, q_BxKxV = draft(
    model, params, cache, tokens_BxK[:, 0], k, k_B, draft_depth, exit_lookup, sampler
  )
  fed_BxK = jnp.concatenate([tokens_BxK[:, :1], d_BxK[:, :-1]], axis=1)
  logits_BxKxV, aux = verify(model, params, cache, fed_BxK, k_B, depth, exit_lookup, passes)
  p_BxKxV = distribution(
    logits_BxKxV.reshape(b * k, -1), *(jnp.repeat(x, k) for x in sampler[:3])
  ).reshape(logits_BxKxV.shape)
  emitted_BxK, m_B, a_B = accept(d_BxK, q_BxKxV, p_BxKxV, k_B, temperature_B, seed_B, index_B)
  if paged_cache.has_state(model.cfg):  # A state cannot be rewound: rerun on what is kept.
    _, aux = _apply(model, params, fed_BxK, cache, m_B, depth, exit_lookup)
  logprobs_BxKxV = jax.nn.log_softmax(logits_BxKxV.astype(jnp.float32), axis=-1)
  logprob_BxK = jnp.take_along_axis(logprobs_BxKxV, emitted_BxK[..., None], axis=-1)[..., 0]
  # Only the emitted positions are written (after every read of the pool, as in the plain call).
  written_B = jnp.where(jnp.all(emitted_BxK >= 0, axis=1), m_B, 0)
  pages = paged_cache.scatter(
    pages, aux["cache"], aux["cache_chunk"], page_table_BxP, context_B, written_B, k, layout,
    slot_B, slotted, dtypes,
  )  # fmt: skip
  logits = logits_BxKxV if return_logits else None
  return pages, emitted_BxK, m_B, a_B, logprob_BxK, logits
