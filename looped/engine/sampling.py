"""Token sampling for the engine: greedy, temperature, top-k, top-p, a seed per request, stops.

`sample` runs inside the jitted engine step on the logits of each row's last new token; every
row has its own parameters, so one compiled step serves any mix of requests. A request's n-th
token is drawn with key fold_in(PRNGKey(seed), n): a request preempted and recomputed draws the
same tokens, and its tokens do not depend on what else shares the batch.

Filtering follows Hugging Face's warpers in order: temperature, then top-k (the k highest
logits, ties broken by lower token id), then top-p on the renormalized survivors (the shortest
prefix of the sorted tokens whose probability mass reaches p; the most likely token always
stays). Logprobs are the model's own: log_softmax of the raw logits (temperature 1, unfiltered)
at the chosen token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

# Beyond this every temperature samples the same (near-uniform) distribution; the bound keeps
# 1 / T and the logits' scaling finite in float32.
MAX_TEMPERATURE = 100.0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How one request samples and when it stops."""

  max_new_tokens: int = 32  # Tokens generated at most (the stop token included).
  temperature: float = 0.0  # 0: greedy (argmax); > 0: sample from softmax(logits / T).
  top_k: int = 0  # Keep the k most likely tokens (0: all).
  top_p: float = 1.0  # Keep the smallest set of tokens with mass >= p (1: all).
  seed: int = 0  # Per-request seed of the sampler.
  stop_token_ids: tuple[int, ...] = ()  # A generated one ends the request (kept in tokens).
  stop_strings: tuple[str, ...] = ()  # Generated text containing one ends the request (the
  # text is cut before it).

  def check(self, vocab_size: int) -> None:
    """Raises ValueError naming the bad field."""
    bad = lambda field, value, why: ValueError(f"sampling {field} = {value!r} {why}.")
    if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
      raise bad("max_new_tokens", self.max_new_tokens, "must be an integer")
    if self.max_new_tokens < 1:
      raise bad("max_new_tokens", self.max_new_tokens, "must be >= 1")
    if not 0 <= self.temperature <= MAX_TEMPERATURE:
      raise bad("temperature", self.temperature, f"must be in [0, {MAX_TEMPERATURE:g}]")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
      raise bad("top_k", self.top_k, "must be an integer in [0, vocab_size] (0: no top-k)")
    if not 0 <= self.top_k <= vocab_size:
      raise bad("top_k", self.top_k, f"must be in [0, {vocab_size}] (0: no top-k)")
    if not 0 < self.top_p <= 1:
      raise bad("top_p", self.top_p, "must be in (0, 1]")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**31:
      raise bad("seed", self.seed, "must be an integer in [0, 2^31)")
    for t in self.stop_token_ids:
      if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
        raise bad("stop_token_ids", self.stop_token_ids, f"must be token ids in [0, {vocab_size})")
    if any(not isinstance(s, str) or not s for s in self.stop_strings):
      raise bad("stop_strings", self.stop_strings, "must be non-empty strings")


def filter_mask(logits_BxV: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Tokens that survive top-k then top-p (module docstring), as a bool [B, V] mask."""
  v = logits_BxV.shape[-1]
  order_BxV = jnp.argsort(-logits_BxV, axis=-1, stable=True)
  sorted_BxV = jnp.take_along_axis(logits_BxV, order_BxV, axis=-1)
  rank_V = jnp.arange(v)
  k_B = jnp.where(top_k_B > 0, top_k_B, v)
  keep_k_BxV = rank_V[None, :] < k_B[:, None]
  probs_BxV = jax.nn.softmax(jnp.where(keep_k_BxV, sorted_BxV, -jnp.inf), axis=-1)
  mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
  keep_sorted_BxV = keep_k_BxV & ((mass_before_BxV < top_p_B[:, None]) | (rank_V[None, :] == 0))
  inverse_BxV = jnp.argsort(order_BxV, axis=-1)
  return jnp.take_along_axis(keep_sorted_BxV, inverse_BxV, axis=-1)


def sample(
  logits_BxV: jax.Array,
  temperature_B: jax.Array,
  top_k_B: jax.Array,
  top_p_B: jax.Array,
  seed_B: jax.Array,
  index_B: jax.Array,
) -> tuple[jax.Array, jax.Array]:
  """Next token of each row and its logprob under the model (log_softmax of raw logits).

  index_B: how many tokens the request has generated before this one (the key's counter).
  """
  logits_BxV = logits_BxV.astype(jnp.float32)
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  t_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
  scaled_BxV = logits_BxV / t_B[:, None]
  masked_BxV = jnp.where(filter_mask(scaled_BxV, top_k_B, top_p_B), scaled_BxV, -jnp.inf)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed_B, index_B)
  drawn_B = jax.vmap(jax.random.categorical)(keys, masked_BxV)
  token_B = jnp.where(temperature_B > 0, drawn_B, greedy_B).astype(jnp.int32)
  logprobs_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  return token_B, jnp.take_along_axis(logprobs_BxV, token_B[:, None], axis=-1)[:, 0]


def check_stop(
  generated: Sequence[int], params: SamplingParams, decode: Callable[[Sequence[int]], str]
) -> tuple[str | None, str]:
  """(finish reason or None, text so far) after the newest token of `generated`.

  A stop token ends the request and is left out of the text; a stop string ends it and the text
  is cut where the first one starts.
  """
  stopped_by_token = bool(generated) and generated[-1] in params.stop_token_ids
  text = decode(generated[:-1] if stopped_by_token else generated)
  cuts = [i for i in (text.find(s) for s in params.stop_strings) if i >= 0]
  if cuts:
    return "stop_string", text[: min(cuts)]
  if stopped_by_token:
    return "stop_token", text
  return None, text
