"""The BeNice! post-training objective (docs/design.md §4), as a trainer `Objective`.

One step, for a batch x at post-training depth (fixed R unless configured):

  unshared pass   logits_u, h_u,r = f(x)                       (ordinary forward, differentiated)
  broadcast K/V   kv = sg(final-recurrence K/V of the unshared pass)            (kv_passes = 0)
                  or sg(K/V after kv_passes shared Jacobi passes)               (kv_passes > 0)
  shared pass     logits_s, h_s,r = f(x; recurrences in `read` attend to kv for s < t and to
                  their own K/V at s = t)                      (differentiated)

  loss = w_shared   * CE(logits_s)
       + w_unshared * CE(logits_u)
       + w_kl       * KL(p_frozen || p_student)     on the shared and/or unshared pass
       + w_residual * (1/R) sum_r sum ||h_s,r - sg(h_u,r)||^2 / sum ||sg(h_u,r)||^2

The broadcast K/V never carry gradient, so the shared pass learns to *use* the final K/V it is
given, not to move them. With kv_passes = n > 0 the broadcast K/V come from Jacobi pass n
(itself built from shared reads), so the trained pass is Jacobi pass n + 1: closer to exact
shared decode, where every earlier token's K/V were computed under sharing too. The residual
term is a relative squared error per recurrence (scale-free, so its weight does not depend on
the state norm), pulling the shared states onto the unshared trajectory; the unshared states are
its fixed target. The frozen pretrained params arrive as `Objective.frozen`.

Recipe knobs (all off by default, so the objective above is unchanged):
  + w_distill * KL(sg(p_unshared) || p_shared)   the shared pass distilled from the current
                                                 unshared pass: it targets the gap itself
  shared_ramp_steps = N    the shared-pass weights (shared CE, KL on the shared pass,
                           distillation) ramp linearly from 0 to their values over N steps,
                           so the unshared model is disturbed gradually
  kv_passes_ramp_steps = N kv_passes grows 0 -> kv_passes over N steps (a curriculum:
                           pass n + 1 is trained only once pass n is)
  prefill_block = C        the shared pass (and the kv_passes before it) reads as block
                           prefill with blocks of C tokens: the broadcast K/V for positions
                           before the token's block, its own recurrence's K/V inside it
                           (docs/design.md §3); the serving mode whose gap it then targets
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from looped.benice.config import READ_MODES
from looped.losses import token_cross_entropy
from looped.model import flops
from looped.model.looped_lm import LoopedLM
from looped.train.objectives import Objective, sample_depth


def read_mask_R(mode: str, num_recurrences: int) -> jax.Array:
  """bool[R]: which recurrences read the broadcast K/V ('none': the sharing-off control)."""
  index_R = jnp.arange(num_recurrences)
  if mode == "all":
    return index_R >= 0
  if mode == "first":
    return index_R == 0
  if mode == "none":
    return index_R < 0
  raise ValueError(f"Unknown read mode {mode!r}; allowed: {READ_MODES}.")


def broadcast_kv(model: LoopedLM, params, tokens_BxT, final_kv, read_R, kv_passes, **kw):
  """The K/V broadcast into the shared pass; carries no gradient.

  kv_passes = 0: the unshared pass's final K/V (the paper's pass 1). n > 0: n further shared
  passes (Jacobi), each reading the previous one's final K/V, run in one traced loop. A traced
  kv_passes (a curriculum) runs a loop of that many passes.
  """
  kv = jax.lax.stop_gradient(final_kv)
  if isinstance(kv_passes, int) and kv_passes == 0:
    return kv
  frozen_params = jax.lax.stop_gradient(params)

  def shared_pass(_, kv):
    _, aux = model.apply(frozen_params, tokens_BxT, shared_kv=kv, read_shared_R=read_R, **kw)
    return aux["final_kv"]

  return jax.lax.stop_gradient(jax.lax.fori_loop(0, kv_passes, shared_pass, kv))


def kl_divergence(teacher_BxTxV: jax.Array, student_BxTxV: jax.Array) -> jax.Array:
  """Mean over tokens of KL(softmax(teacher) || softmax(student)), in nats."""
  log_p = jax.nn.log_softmax(teacher_BxTxV.astype(jnp.float32))
  log_q = jax.nn.log_softmax(student_BxTxV.astype(jnp.float32))
  return jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))


def residual_matching(shared_RxBxTxD: jax.Array, unshared_RxBxTxD: jax.Array) -> jax.Array:
  """(1/R) sum_r ||h_s,r - sg(h_u,r)||^2 / ||sg(h_u,r)||^2 (sums over batch, tokens, width)."""
  target = jax.lax.stop_gradient(unshared_RxBxTxD).astype(jnp.float32)
  diff = shared_RxBxTxD.astype(jnp.float32) - target
  per_r = jnp.sum(jnp.square(diff), axis=(1, 2, 3)) / (
    jnp.sum(jnp.square(target), axis=(1, 2, 3)) + 1e-12
  )
  return jnp.mean(per_r)


def ramp(step, ramp_steps: int) -> jax.Array:
  """min(1, step / ramp_steps): 1 when ramp_steps = 0 or outside training (step None)."""
  if ramp_steps == 0 or step is None:
    return jnp.float32(1.0)
  return jnp.minimum(1.0, jnp.asarray(step, jnp.float32) / ramp_steps)


def kv_passes_at(step, kv_passes: int, ramp_steps: int):
  """kv_passes at `step` of a curriculum: n = floor((kv_passes + 1) * step / ramp_steps),
  clipped to kv_passes, so each count 0..kv_passes gets an equal share of the ramp; the static
  kv_passes when there is no ramp (or outside training)."""
  if ramp_steps == 0 or step is None or kv_passes == 0:
    return kv_passes
  n = (jnp.asarray(step, jnp.int32) * (kv_passes + 1)) // ramp_steps
  return jnp.minimum(n, kv_passes)


@dataclasses.dataclass(frozen=True)
class _Recipe:
  """The objective's static settings, read from the benice config once."""

  w_shared: float
  w_unshared: float
  w_kl: float
  w_residual: float
  w_distill: float
  shared_ramp_steps: int
  kv_ramp_steps: int
  prefill_block: int | None  # None: token-level reads.
  kv_passes: int
  kl_shared: bool  # KL to the frozen model on the shared pass.
  kl_unshared: bool  # ... and on the unshared pass.

  @property
  def need_shared(self) -> bool:
    return self.w_shared > 0 or self.w_residual > 0 or self.kl_shared or self.w_distill > 0

  @property
  def need_states(self) -> bool:
    return self.w_residual > 0

  def terms(self) -> tuple[str, ...]:
    """The loss terms reported, in the trainer's order."""
    kl_shared, kl_unshared = self.w_kl > 0 and self.kl_shared, self.w_kl > 0 and self.kl_unshared
    terms = ("ce_shared",) * self.need_shared + ("ce_unshared",)
    terms += ("kl_shared",) * kl_shared + ("kl_unshared",) * kl_unshared
    return terms + ("distill",) * (self.w_distill > 0) + ("residual_match",) * self.need_states


def _recipe(benice_cfg) -> _Recipe:
  w_kl = float(benice_cfg.kl_weight)
  kl_pass = benice_cfg.kl_pass
  return _Recipe(
    w_shared=float(benice_cfg.shared_ce_weight),
    w_unshared=float(benice_cfg.unshared_ce_weight),
    w_kl=w_kl,
    w_residual=float(benice_cfg.residual_weight),
    w_distill=float(benice_cfg.get("distill_weight", 0.0)),
    shared_ramp_steps=int(benice_cfg.get("shared_ramp_steps", 0)),
    kv_ramp_steps=int(benice_cfg.get("kv_passes_ramp_steps", 0)),
    prefill_block=int(benice_cfg.get("prefill_block", 0)) or None,
    kv_passes=int(benice_cfg.kv_passes),
    kl_shared=w_kl > 0 and kl_pass in ("shared", "both"),
    kl_unshared=w_kl > 0 and kl_pass in ("unshared", "both"),
  )


def benice(model: LoopedLM, depth_cfg, benice_cfg, frozen_params=None) -> Objective:
  """BeNice! objective; weights, read mode and kv_passes are static (from the config).

  The depth mask and the state-noise key are drawn exactly as in `language_modeling`, so with
  only the unshared CE weighted this is standard finetuning, step for step.
  """
  recipe = _recipe(benice_cfg)
  read_R = read_mask_R(benice_cfg.read_recurrences, model.cfg.num_recurrences)
  if recipe.w_kl > 0 and frozen_params is None:
    raise ValueError("kl_weight > 0 needs the frozen pretrained params.")

  def loss_fn(params, frozen, batch, key, step=None):
    return _loss(model, depth_cfg, recipe, read_R, params, frozen, batch, key, step)

  def flops_per_token(seq_len: int, step: int) -> float:
    return _flops_per_token(model.cfg, recipe, seq_len, step)

  frozen = frozen_params if recipe.w_kl > 0 else None
  return Objective(loss_fn, frozen, recipe.terms(), flops_per_token=flops_per_token)


def _loss(model: LoopedLM, depth_cfg, recipe: _Recipe, read_R, params, frozen, batch, key, step):
  """(loss, metrics) of one batch (module docstring)."""
  depth_key, state_key = jax.random.split(key)
  shared_scale = ramp(step, recipe.shared_ramp_steps)  # Multiplies every shared-pass term.
  inputs_BxT, targets_BxT = batch["inputs"], batch["targets"]
  mask_BxR = sample_depth(depth_key, inputs_BxT.shape[0], model, depth_cfg)
  kw = dict(
    depth_mask_BxR=mask_BxR,
    backprop_recurrences=depth_cfg.backprop_recurrences,
    rngs={"state": state_key},
    segment_ids_BxT=batch.get("segment_ids"),  # Document masking, in every pass.
  )
  logits_u, aux_u = model.apply(params, inputs_BxT, collect_states=recipe.need_states, **kw)
  ce_u = jnp.mean(token_cross_entropy(logits_u, targets_BxT))
  loss = recipe.w_unshared * ce_u
  metrics = {
    "ce_unshared": ce_u,
    "mean_depth": jnp.mean(jnp.sum(mask_BxR, axis=1)),
    "relative_residual_R": aux_u["relative_residual_R"],
  }
  logits_s = aux_s = None
  if recipe.need_shared:
    passes = kv_passes_at(step, recipe.kv_passes, recipe.kv_ramp_steps)
    logits_s, aux_s = _shared_pass(model, recipe, read_R, params, inputs_BxT, aux_u, passes, kw)
    ce_s = jnp.mean(token_cross_entropy(logits_s, targets_BxT))
    loss = loss + shared_scale * recipe.w_shared * ce_s
    metrics["ce_shared"] = ce_s
    metrics["shared_gap"] = jnp.exp(ce_s - ce_u) - 1.0
    if recipe.shared_ramp_steps:
      metrics["shared_scale"] = shared_scale
    if recipe.kv_ramp_steps:
      metrics["kv_passes"] = jnp.asarray(passes, jnp.float32)
  if recipe.w_distill > 0:
    metrics["distill"] = kl_divergence(jax.lax.stop_gradient(logits_u), logits_s)
    loss = loss + shared_scale * recipe.w_distill * metrics["distill"]
  if recipe.w_kl > 0:
    teacher_BxTxV, _ = model.apply(frozen, inputs_BxT, **kw)
    kl = _teacher_kl(recipe, teacher_BxTxV, logits_u, logits_s, shared_scale, metrics)
    loss = loss + recipe.w_kl * kl
  if recipe.need_states:
    res = residual_matching(aux_s["states_RxBxTxD"], aux_u["states_RxBxTxD"])
    metrics["residual_match"] = res
    loss = loss + recipe.w_residual * res
  metrics["loss"] = loss
  return loss, metrics


def _shared_pass(model: LoopedLM, recipe: _Recipe, read_R, params, inputs_BxT, aux_u, passes, kw):
  """(logits, aux) of the shared pass, reading the K/V broadcast after `passes` Jacobi passes."""
  block = recipe.prefill_block
  kv = broadcast_kv(
    model, params, inputs_BxT, aux_u["final_kv"], read_R, passes, prefill_block=block, **kw
  )
  return model.apply(
    params,
    inputs_BxT,
    shared_kv=kv,
    read_shared_R=read_R,
    collect_states=recipe.need_states,
    prefill_block=block,
    **kw,
  )


def _teacher_kl(recipe: _Recipe, teacher_BxTxV, logits_u, logits_s, shared_scale, metrics):
  """The KL to the frozen model on the configured passes (the shared one ramped); records each
  pass's KL in `metrics`."""
  teacher_BxTxV = jax.lax.stop_gradient(teacher_BxTxV)
  kl = 0.0
  if recipe.kl_shared:
    metrics["kl_shared"] = kl_divergence(teacher_BxTxV, logits_s)
    kl = kl + shared_scale * metrics["kl_shared"]
  if recipe.kl_unshared:
    metrics["kl_unshared"] = kl_divergence(teacher_BxTxV, logits_u)
    kl = kl + metrics["kl_unshared"]
  return kl


def _flops_per_token(cfg, recipe: _Recipe, seq_len: int, step: int) -> float:
  """The unshared pass trained; the shared pass trained, after its gradient-free K/V passes (as
  many as the ramp gives at `step`); the frozen teacher's forward for the KL."""
  total = flops.train_flops_per_token(cfg, seq_len)
  if recipe.need_shared:
    passes = recipe.kv_passes
    if recipe.kv_ramp_steps:  # kv_passes_at in host integers.
      passes = min(step * (passes + 1) // recipe.kv_ramp_steps, passes)
    total = flops.benice_flops_per_token(cfg, seq_len, passes)
  if recipe.w_kl > 0:
    total += flops.forward_flops_per_token(cfg, seq_len)
  return total
