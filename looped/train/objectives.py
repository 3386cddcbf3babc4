"""Training objectives. The trainer takes one as a value, so later stages reuse it unchanged.

An `Objective` is a pure loss function of (params, frozen, batch, key, step) returning
(scalar loss, dict of scalar or [R] metrics). `step` (the optimizer step, an int32 scalar, or
None outside training) lets a loss follow a schedule (e.g. BeNice!'s ramps). `frozen` is a
pytree of constants the loss reads but never differentiates (e.g. a teacher's parameters):
passing it as an argument rather than closing over it keeps it out of the compiled program's
constants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from looped.losses import token_cross_entropy
from looped.model import depth as depth_lib
from looped.model import flops
from looped.model.looped_lm import LoopedLM


@dataclasses.dataclass(frozen=True)
class Objective:
  loss_fn: Callable[..., tuple[jax.Array, dict]]
  frozen: Any = None
  log_terms: tuple[str, ...] = ()  # Metrics the loss sums (weighted), shown on progress lines.
  # (seq_len, step) -> model FLOPs per token of the step whose state counter is `step` (0 for
  # the first), forward and backward of every pass (looped/model/flops.py; ValueError for a
  # model it does not count). None: not counted.
  flops_per_token: Callable[[int, int], float] | None = None


def sample_depth(key, batch: int, model: LoopedLM, depth_cfg) -> jax.Array:
  return depth_lib.sample_mask(
    key,
    batch,
    model.cfg.num_recurrences,
    depth_cfg.sampler,
    poisson_mean=depth_cfg.poisson_mean,
    survival=depth_cfg.survival,
  )


def language_modeling(model: LoopedLM, depth_cfg) -> Objective:
  """Next-token CE with stochastic depth and truncated backprop (stage 1, docs/design.md §4)."""

  def loss_fn(params, frozen, batch, key, step=None):
    del frozen, step
    depth_key, state_key = jax.random.split(key)
    inputs_BxT = batch["inputs"]
    mask_BxR = sample_depth(depth_key, inputs_BxT.shape[0], model, depth_cfg)
    logits, aux = model.apply(
      params,
      inputs_BxT,
      depth_mask_BxR=mask_BxR,
      backprop_recurrences=depth_cfg.backprop_recurrences,
      rngs={"state": state_key},
      segment_ids_BxT=batch.get("segment_ids"),  # Document masking (data.document_mask).
    )
    loss = jnp.mean(token_cross_entropy(logits, batch["targets"]))
    metrics = {
      "loss": loss,
      "mean_depth": jnp.mean(jnp.sum(mask_BxR, axis=1)),
      "relative_residual_R": aux["relative_residual_R"],
    }
    return loss, metrics

  def flops_per_token(seq_len: int, step: int) -> float:
    del step
    return flops.train_flops_per_token(model.cfg, seq_len)

  return Objective(loss_fn, flops_per_token=flops_per_token)
