"""How the prelude output e enters each recurrence: h <- inject(h, e)."""

from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from looped.model.config import ModelConfig
from looped.model.layers import projection


class Injection(nn.Module):
  """diagonal (Parcae): h <- exp(-softplus(dt) exp(A_log)) h + softplus(dt) e B^T;
  linear: h <- [h; e] W (Huginn's adapter); additive: h <- h + e; none: h <- h.

  The diagonal form keeps the recurrence's linear part a per-channel contraction (decay in
  (0, 1)), which is Parcae's argument for stable looping.
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(self, h_BxTxD, e_BxTxD):
    cfg = self.cfg
    d = cfg.d_model
    if cfg.injection == "none":
      return h_BxTxD
    if cfg.injection == "additive":
      return h_BxTxD + e_BxTxD
    if cfg.injection == "linear":
      w = projection(cfg, d, (2 * d) ** -0.5, "linear", axes=("embed", None))
      return w(jnp.concatenate([h_BxTxD, e_BxTxD], axis=-1))
    # decay = exp(-softplus(dt) exp(A_log)); dt = 0 at init, A_log set so decay = decay_init.
    a_log_init = math.log(-math.log(cfg.diagonal_decay_init) / math.log(2.0))
    a_log_D = self.param("A_log", nn.initializers.constant(a_log_init), (d,), jnp.float32)
    dt_D = self.param("dt", nn.initializers.zeros, (d,), jnp.float32)
    step_D = nn.softplus(dt_D)
    decay_D = jnp.exp(-step_D * jnp.exp(a_log_D))
    b = projection(cfg, d, d**-0.5, "B", axes=("embed", None))
    h = decay_D.astype(h_BxTxD.dtype) * h_BxTxD
    return h + step_D.astype(h_BxTxD.dtype) * b(e_BxTxD)
