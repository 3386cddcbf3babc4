"""Stochastic depth: which recurrences run, per sequence, and which carry gradient.

A mask m_BxR in {0, 1} gates each recurrence inside the scan (h_r = h_{r-1} where m = 0), so
shapes stay static whatever depth is drawn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SAMPLERS = ("poisson", "bernoulli", "fixed")


def sample_mask(
  key: jax.Array,
  batch: int,
  num_recurrences: int,
  sampler: str,
  *,
  poisson_mean: float = 2.0,
  survival: float = 0.7,
) -> jax.Array:
  """Returns a bool mask_BxR of active recurrences.

  poisson: n ~ Poisson(mean) clipped to [1, R]; the first n recurrences are active (Parcae).
  bernoulli: each recurrence kept with prob `survival`; a row that drew none keeps one
    recurrence chosen uniformly (so P(keep r) = p + (1 - p)^R / R).
  fixed: all recurrences active.
  """
  r = num_recurrences
  if sampler == "fixed":
    return jnp.ones((batch, r), bool)
  if sampler == "poisson":
    n_B = jax.random.poisson(key, poisson_mean, (batch,))
    n_B = jnp.clip(n_B, 1, r)
    return jnp.arange(r)[None, :] < n_B[:, None]
  if sampler == "bernoulli":
    keep_key, pick_key = jax.random.split(key)
    mask_BxR = jax.random.bernoulli(keep_key, survival, (batch, r))
    pick_BxR = jax.nn.one_hot(jax.random.randint(pick_key, (batch,), 0, r), r, dtype=bool)
    empty_B = ~jnp.any(mask_BxR, axis=1)
    return jnp.where(empty_B[:, None], pick_BxR, mask_BxR)
  raise ValueError(f"Unknown depth sampler {sampler!r}; allowed: {SAMPLERS}.")


def stop_gradient_mask(mask_BxR: jax.Array, backprop_recurrences: int) -> jax.Array:
  """bool stop_BxR: stop the gradient of the carry entering recurrence r.

  Only the last k active recurrences of each sequence carry gradient (Huginn-style truncated
  backprop): the carry is cut at the entry of every recurrence r that has >= k active
  recurrences at or after it; the cut at the first of the last k is the one that matters,
  earlier cuts are redundant. k = 0 means full backprop.
  """
  if backprop_recurrences <= 0:
    return jnp.zeros_like(mask_BxR, dtype=bool)
  active_after_BxR = jnp.cumsum(mask_BxR[:, ::-1].astype(jnp.int32), axis=1)[:, ::-1]
  return active_after_BxR >= backprop_recurrences
