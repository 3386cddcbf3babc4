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

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging

from looped.losses import chunked_cross_entropy, token_cross_entropy
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
  # chunk -> this objective with its cross-entropy taken in vocabulary chunks from the final
  # hidden states (train.loss_vocab_chunk; `vocab_chunked`). None: it reads full logits.
  with_vocab_chunk: Callable[[int], Objective] | None = None


def vocab_chunked(objective: Objective, chunk: int) -> Objective:
  """`objective` under train.loss_vocab_chunk = chunk (0: as it is); one without a chunked form
  keeps its full logits, said in the log."""
  if not chunk:
    return objective
  if objective.with_vocab_chunk is None:
    logging.warning("train.loss_vocab_chunk = %d unused: this objective reads full logits.", chunk)
    return objective
  return objective.with_vocab_chunk(chunk)


def sample_depth(key, batch: int, model: LoopedLM, depth_cfg) -> jax.Array:
  return depth_lib.sample_mask(
    key,
    batch,
    model.cfg.num_recurrences,
    depth_cfg.sampler,
    poisson_mean=depth_cfg.poisson_mean,
    survival=depth_cfg.survival,
  )


def hidden_states(model: LoopedLM, params, tokens_BxT, **kwargs):
  """(the final hidden states the LM head reads [B, T, D] in the compute dtype, aux) of
  model.apply(params, tokens_BxT, **kwargs) in parallel mode, so a loss can take the logits in
  chunks. The head is not run: its call (found by the module's name) returns zeros that
  nothing reads, which XLA removes."""
  captured = []

  def interceptor(next_fun, args, kw, context):
    module, method = context.module, context.method_name
    head = (module.name, method) in (("embed", "attend"), ("head", "__call__"))
    if not head or not isinstance(module.parent, LoopedLM):
      return next_fun(*args, **kw)
    x_BxTxD = args[0].astype(model.cfg.compute_dtype)
    captured.append(x_BxTxD)
    return jnp.zeros((*x_BxTxD.shape[:-1], model.cfg.vocab_size), x_BxTxD.dtype)

  with nn.intercept_methods(interceptor):
    _, aux = model.apply(params, tokens_BxT, **kwargs)
  if len(captured) != 1:
    raise ValueError(f"Expected one LM head call in the forward, saw {len(captured)}.")
  return captured[0], aux


def head_matrix(model: LoopedLM, params) -> jax.Array:
  """The LM head's [D, V] matrix in the compute dtype (the tied embedding's transpose)."""
  p = params["params"]
  head_DxV = p["embed"]["embedding"].T if model.cfg.tie_embeddings else p["head"]["kernel"]
  return head_DxV.astype(model.cfg.compute_dtype)


def language_modeling(model: LoopedLM, depth_cfg, vocab_chunk: int = 0) -> Objective:
  """Next-token CE with stochastic depth and truncated backprop (stage 1, docs/design.md §4).

  vocab_chunk > 0: the CE from the final hidden states in vocabulary chunks
  (losses.chunked_cross_entropy), the same loss without [B, T, V] logits in memory.
  """

  def loss_fn(params, frozen, batch, key, step=None):
    del frozen, step
    depth_key, state_key = jax.random.split(key)
    inputs_BxT = batch["inputs"]
    mask_BxR = sample_depth(depth_key, inputs_BxT.shape[0], model, depth_cfg)
    kwargs = dict(
      depth_mask_BxR=mask_BxR,
      backprop_recurrences=depth_cfg.backprop_recurrences,
      rngs={"state": state_key},
      segment_ids_BxT=batch.get("segment_ids"),  # Document masking (data.document_mask).
    )
    if vocab_chunk:
      x_BxTxD, aux = hidden_states(model, params, inputs_BxT, **kwargs)
      targets_N = batch["targets"].reshape(-1)
      x_NxD = x_BxTxD.reshape(targets_N.shape[0], -1)
      ce = chunked_cross_entropy(x_NxD, head_matrix(model, params), targets_N, vocab_chunk)
    else:
      logits, aux = model.apply(params, inputs_BxT, **kwargs)
      ce = token_cross_entropy(logits, batch["targets"])
    loss = jnp.mean(ce)
    metrics = {
      "loss": loss,
      "mean_depth": jnp.mean(jnp.sum(mask_BxR, axis=1)),
      "relative_residual_R": aux["relative_residual_R"],
    }
    return loss, metrics

  def flops_per_token(seq_len: int, step: int) -> float:
    del step
    return flops.train_flops_per_token(model.cfg, seq_len)

  return Objective(
    loss_fn,
    flops_per_token=flops_per_token,
    with_vocab_chunk=lambda chunk: language_modeling(model, depth_cfg, chunk),
  )
