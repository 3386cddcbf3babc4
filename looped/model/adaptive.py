"""Test-time depth (docs/design.md §3, "Depth at test time"): how many recurrences each row of
a decode call runs, and when a row exits.

Every setting is per row data (`DepthInputs`), never a shape: a call mixes rows with different
recurrence counts, criteria and thresholds, and a row's depth does not depend on the others.
After each recurrence a row that is still running is checked (from `min_recurrences` on, every
`check_every` recurrences) and exits when its criterion says so; a row stops at its own
`recurrences` in any case. The criteria are Huginn's (`generate_with_adaptive_compute` in
seal-rg/recurrent-pretraining's raven_modeling_minimal.py: same definitions and default
thresholds) and Ouro's gate:

  entropy-diff      |H(p_r) - H(p_prev)| < t  (H of softmax(logits), log(p + 1e-10); 1e-3)
  latent-diff       mean over tokens of ||h_r - h_prev|| / ||h_r|| < t  (0.03)
  kl                KL(p_prev || p_r) < t  (1e-3)
  minp-kl           KL as above of min-p filtered distributions (p < 0.1 max -> 1/V) < t  (1e-5)
  argmax-stability  the argmax unchanged for >= t consecutive checks  (5)
  cosine            mean over tokens of 1 - cos(h_r, h_prev) < t  (1e-3)
  gate              Ouro: the cumulative exit probability sum_j lambda_j prod_{i<j} (1 - lambda_i),
                    lambda = sigmoid(exit gate logit of h_r), reaches t  (1.0, as released)

"prev" is the value at the row's previous check; before the first one it is Huginn's: entropy
100, the uniform distribution over the vocabulary, argmax -1, and h_0 for the latent criteria.
Logit criteria read the chunk's last real token (a decode call has one); latent ones average
over its real tokens (Huginn's `reduce`). Huginn's min_steps = m is min_recurrences = m + 1
(its first check follows recurrence m + 1); its step-schedule evaluator is `recurrences`.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

CRITERIA = (
  "none",
  "entropy-diff",
  "latent-diff",
  "kl",
  "minp-kl",
  "argmax-stability",
  "cosine",
  "gate",
)
# Huginn's defaults ('auto'); the gate's is Ouro's released early_exit_threshold.
DEFAULT_THRESHOLDS = {
  "none": 0.0,
  "entropy-diff": 1e-3,
  "latent-diff": 0.03,
  "kl": 1e-3,
  "minp-kl": 1e-5,
  "argmax-stability": 5.0,
  "cosine": 1e-3,
  "gate": 1.0,
}
# Criteria that read the next-token distribution: each check runs the coda and head.
LOGIT_CRITERIA = ("entropy-diff", "kl", "minp-kl", "argmax-stability")
# Unshared caches: what recurrence r of a later token reads of a token that exited after k < r
# recurrences (design.md §3). 'latest': its recurrence-k K/V (Huginn's latest-m4 and
# available-m4, per core layer); 'always-last': while some earlier token lacks recurrence r,
# every earlier token's last recurrence (always-last-m4); 'skip': tokens that did not run r are
# not attended to (what Huginn's default 'full' cache does with holes).
LOOKUPS = ("latest", "always-last", "skip")
DEFAULT_LOOKUP = "latest"

_INDEX = {name: i for i, name in enumerate(CRITERIA)}


def criterion_index(name: str) -> int:
  """The criterion's number in DepthInputs.criterion_B."""
  if name not in _INDEX:
    raise ValueError(f"exit criterion {name!r}: expected one of {CRITERIA}.")
  return _INDEX[name]


def threshold_of(criterion: str, threshold: float | None) -> float:
  """The threshold a row uses: the given one, or the criterion's default (None)."""
  return DEFAULT_THRESHOLDS[criterion] if threshold is None else float(threshold)


class DepthError(ValueError):
  """A bad depth setting; `field` names it (without the caller's prefix)."""

  def __init__(self, message: str, field: str):
    super().__init__(message)
    self.field = field


def check_settings(
  *,
  recurrences: int,
  max_recurrences: int,
  criterion: str,
  threshold: float | None,
  min_recurrences: int,
  check_every: int,
  init_scale: float,
  exit_gate: bool,
  prefix: str = "",
) -> None:
  """ValueError naming the first bad setting (prefix: how the caller names its fields)."""
  bad = lambda name, value, why: DepthError(f"{prefix}{name} = {value!r} {why}.", name)
  is_int = lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
  if not is_int(recurrences) or not 0 <= recurrences <= max_recurrences:
    raise bad("recurrences", recurrences, f"must be an integer in [0, {max_recurrences}] (0: R)")
  if criterion not in CRITERIA:
    raise bad("exit_criterion", criterion, f"must be one of {', '.join(CRITERIA)}")
  if criterion == "gate" and not exit_gate:
    raise bad("exit_criterion", criterion, "needs a model with an exit gate (model.exit_gate)")
  if threshold is not None:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float, np.floating)):
      raise bad("exit_threshold", threshold, "must be a number")
    if not np.isfinite(threshold) or threshold < 0:
      raise bad("exit_threshold", threshold, "must be a finite number >= 0")
    if criterion == "gate" and not 0 < threshold <= 1:
      raise bad("exit_threshold", threshold, "must be in (0, 1] for the gate (a probability)")
    if criterion == "argmax-stability" and (threshold < 1 or threshold != int(threshold)):
      raise bad("exit_threshold", threshold, "must be a whole number >= 1 for argmax-stability")
  if not is_int(min_recurrences) or not 0 <= min_recurrences <= max_recurrences:
    raise bad("min_recurrences", min_recurrences, f"must be an integer in [0, {max_recurrences}]")
  if not is_int(check_every) or check_every < 1:
    raise bad("exit_every", check_every, "must be an integer >= 1")
  if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float, np.floating)):
    raise bad("init_scale", init_scale, "must be a number")
  if not np.isfinite(init_scale) or init_scale < 0:
    raise bad("init_scale", init_scale, "must be a finite number >= 0")


@flax.struct.dataclass
class DepthInputs:
  """Per-row depth settings of a decode call (all [B] but state_BxD).

  recurrences_B: recurrences the row runs at most (1..the model's num_recurrences, the static
    maximum of the loop).
  criterion_B: CRITERIA index; threshold_B its threshold.
  min_recurrences_B: no check before this many recurrences (0 and 1: from the first).
  check_every_B: checks every this many recurrences from the first (>= 1).
  init_scale_B: multiplies h_0's noise (state_init 'like_init'; Huginn's init_scale).
  warm_B, state_BxD: continuous compute: a warm row starts from state_BxD (the previous token's
    final state) instead of h_0.
  """

  recurrences_B: jax.Array
  criterion_B: jax.Array
  threshold_B: jax.Array
  min_recurrences_B: jax.Array
  check_every_B: jax.Array
  init_scale_B: jax.Array
  warm_B: jax.Array
  state_BxD: jax.Array


def depth_inputs(
  batch: int,
  d_model: int,
  recurrences,
  criterion: str = "none",
  threshold: float | None = None,
  min_recurrences: int = 0,
  check_every: int = 1,
  init_scale: float = 1.0,
  warm=False,
  state_BxD=None,
) -> DepthInputs:
  """The same settings for every row (state_BxD: None gives zeros)."""
  full = lambda v, dtype: jnp.broadcast_to(jnp.asarray(v, dtype), (batch,))
  if state_BxD is None:
    state_BxD = jnp.zeros((batch, d_model), jnp.float32)
  return DepthInputs(
    full(recurrences, jnp.int32),
    full(criterion_index(criterion), jnp.int32),
    full(threshold_of(criterion, threshold), jnp.float32),
    full(min_recurrences, jnp.int32),
    full(check_every, jnp.int32),
    full(init_scale, jnp.float32),
    full(warm, bool),
    jnp.asarray(state_BxD, jnp.float32),
  )


@dataclasses.dataclass(frozen=True)
class DepthSettings:
  """How many recurrences a sequence's tokens run and when they exit (the module docstring):
  an engine request's settings (GenRequest.depth), the evaluation's and decode_forward's. The
  decode calls take them per row (`inputs`)."""

  recurrences: int = 0  # Most recurrences per token (0: the model's trained R).
  exit_criterion: str = "none"  # adaptive.CRITERIA; 'none': every token runs `recurrences`.
  exit_threshold: float | None = None  # None: the criterion's default (Huginn's, Ouro's).
  min_recurrences: int = 0  # No exit before this many recurrences.
  exit_every: int = 1  # Check the criterion every this many recurrences.
  init_scale: float = 1.0  # Scales h_0's noise (state_init 'like_init'); 0: a zero state.
  continuous_compute: bool = False  # A generated token starts from the previous one's state.
  exit_in_prefill: bool = True  # False: prompt chunks run every recurrence (Huginn's
  # do_not_exit_in_prefill).

  def check(self, max_recurrences: int, exit_gate: bool, prefix: str = "") -> None:
    """ValueError naming the first bad field."""
    check_settings(
      recurrences=self.recurrences,
      max_recurrences=max_recurrences,
      criterion=self.exit_criterion,
      threshold=self.exit_threshold,
      min_recurrences=self.min_recurrences,
      check_every=self.exit_every,
      init_scale=self.init_scale,
      exit_gate=exit_gate,
      prefix=prefix,
    )
    for name in ("continuous_compute", "exit_in_prefill"):
      if not isinstance(getattr(self, name), bool):
        raise DepthError(f"{prefix}{name} = {getattr(self, name)!r} must be true or false.", name)

  @property
  def exits(self) -> bool:
    return self.exit_criterion != "none"

  @property
  def threshold(self) -> float:
    return threshold_of(self.exit_criterion, self.exit_threshold)

  def page_key(self) -> bytes:
    """What the K/V of a prompt's pages depend on beyond its tokens: b'' at the model's own
    depth (recurrences 0, as the engine writes the trained R), so such requests share pages as
    before; else these settings."""
    if not self.recurrences and not self.exits and self.init_scale == 1.0:
      return b""
    fields = (self.recurrences, self.init_scale)
    if self.exits:
      fields += (self.exit_criterion, self.threshold, self.min_recurrences, self.exit_every)
      fields += (self.exit_in_prefill,)
    return repr(fields).encode()

  def inputs(
    self, batch: int, d_model: int, recurrences: int, prompt: bool, state_BxD=None
  ) -> DepthInputs:
    """Every row of a call under these settings: `recurrences` (these settings' 0 resolved),
    no exit in a prompt call unless exit_in_prefill, and a warm start from state_BxD (the
    previous token's final states) for a generated token under continuous compute."""
    criterion = self.exit_criterion if self.exit_in_prefill or not prompt else "none"
    warm = self.continuous_compute and not prompt and state_BxD is not None
    return depth_inputs(
      batch,
      d_model,
      recurrences,
      criterion,
      self.exit_threshold,
      self.min_recurrences,
      self.exit_every,
      self.init_scale,
      warm,
      state_BxD,
    )


def settings_of(section) -> DepthSettings:
  """The DepthSettings a config section states: its fields named as DepthSettings' (a typed
  section or a ConfigDict; the engine's section holds them all, the evaluation's some), the
  others at their defaults."""
  names = (f.name for f in dataclasses.fields(DepthSettings))
  return DepthSettings(**{n: getattr(section, n) for n in names if hasattr(section, n)})


def is_logit_criterion(criterion_B: jax.Array) -> jax.Array:
  return jnp.isin(criterion_B, jnp.asarray([_INDEX[c] for c in LOGIT_CRITERIA], jnp.int32))


@flax.struct.dataclass
class ExitState:
  """Each row's criterion memory between checks, and Ouro's gate accumulators."""

  entropy_B: jax.Array
  log_probs_BxV: jax.Array
  argmax_B: jax.Array
  stable_B: jax.Array
  h_BxTxD: jax.Array
  gate_cdf_B: jax.Array
  gate_left_B: jax.Array


def init_state(h0_BxTxD: jax.Array, vocab_size: int) -> ExitState:
  """Huginn's evaluators' init: entropy 100, a uniform distribution, argmax -1, h_0."""
  b = h0_BxTxD.shape[0]
  return ExitState(
    jnp.full((b,), 100.0, jnp.float32),
    jnp.log(jnp.full((b, vocab_size), 1.0 / vocab_size, jnp.float32)),
    jnp.full((b,), -1, jnp.int32),
    jnp.zeros((b,), jnp.int32),
    h0_BxTxD.astype(jnp.float32),
    jnp.zeros((b,), jnp.float32),
    jnp.ones((b,), jnp.float32),
  )


def _minp_log_probs(logits_BxV: jax.Array) -> jax.Array:
  v = logits_BxV.shape[-1]
  probs = jax.nn.softmax(logits_BxV, axis=-1)
  probs = jnp.where(probs < 0.1 * jnp.max(probs, axis=-1, keepdims=True), 1.0 / v, probs)
  return jnp.log(probs / jnp.sum(probs, axis=-1, keepdims=True))


def _kl(prev_BxV: jax.Array, log_probs_BxV: jax.Array) -> jax.Array:
  """torch's kl_div(log_probs, prev, log_target=True).sum(-1): KL(prev || current)."""
  return jnp.sum(jnp.exp(prev_BxV) * (prev_BxV - log_probs_BxV), axis=-1)


def _token_mean(x_BxT: jax.Array, real_BxT: jax.Array) -> jax.Array:
  return jnp.sum(jnp.where(real_BxT, x_BxT, 0.0), axis=1) / jnp.maximum(
    jnp.sum(real_BxT, axis=1), 1
  )


def gate_step(state: ExitState, gate_logit_B: jax.Array, active_B: jax.Array) -> ExitState:
  """Ouro's exit distribution after one more recurrence of the active rows: the step's
  probability lambda times what is left, added to the cumulative one (its float32 order)."""
  lam_B = jax.nn.sigmoid(gate_logit_B.astype(jnp.float32))
  cdf_B = jnp.where(active_B, state.gate_cdf_B + lam_B * state.gate_left_B, state.gate_cdf_B)
  left_B = jnp.where(active_B, state.gate_left_B * (1 - lam_B), state.gate_left_B)
  return state.replace(gate_cdf_B=cdf_B, gate_left_B=left_B)


def check(
  state: ExitState,
  criterion_B: jax.Array,
  threshold_B: jax.Array,
  checked_B: jax.Array,
  h_BxTxD: jax.Array,
  last_logits_BxV: jax.Array,
  real_BxT: jax.Array,
) -> tuple[jax.Array, ExitState]:
  """(exit_B, state): each checked row's criterion on its state h after this recurrence
  (last_logits_BxV: the logits of its last real token, read by the logit criteria only); the
  memory of checked rows moves on, as Huginn's evaluators' does at each check."""
  c = lambda name: criterion_B == _INDEX[name]
  h = h_BxTxD.astype(jnp.float32)
  logits = last_logits_BxV.astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  entropy_B = -jnp.sum(probs * jnp.log(probs + 1e-10), axis=-1)
  log_probs_BxV = jax.nn.log_softmax(logits, axis=-1)
  minp_BxV = _minp_log_probs(logits)
  new_log_probs = jnp.where(c("minp-kl")[:, None], minp_BxV, log_probs_BxV)
  argmax_B = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  stable_B = jnp.where(argmax_B == state.argmax_B, state.stable_B + 1, 0)
  norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x), axis=-1))
  h_norm = norm(h)
  latent_B = _token_mean(norm(h - state.h_BxTxD) / h_norm, real_BxT)
  cosine_BxT = jnp.sum(h * state.h_BxTxD, axis=-1) / h_norm / norm(state.h_BxTxD)
  cosine_B = 1 - _token_mean(cosine_BxT, real_BxT)
  value_B = jnp.select(
    [c("entropy-diff"), c("latent-diff"), c("kl") | c("minp-kl"), c("cosine")],
    [
      jnp.abs(entropy_B - state.entropy_B),
      latent_B,
      _kl(state.log_probs_BxV, new_log_probs),
      cosine_B,
    ],
    jnp.inf,
  )
  exit_B = jnp.select(
    [c("argmax-stability"), c("gate"), c("none")],
    [stable_B >= threshold_B, state.gate_cdf_B >= threshold_B, False],
    value_B < threshold_B,
  )
  keep = lambda new, old: jnp.where(checked_B.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
  state = state.replace(
    entropy_B=keep(entropy_B, state.entropy_B),
    log_probs_BxV=keep(new_log_probs, state.log_probs_BxV),
    argmax_B=keep(argmax_B, state.argmax_B),
    stable_B=keep(stable_B, state.stable_B),
    h_BxTxD=keep(h, state.h_BxTxD),
  )
  return checked_B & exit_B, state


def is_check(
  r: jax.Array, min_recurrences_B: jax.Array, check_every_B: jax.Array, recurrences_B: jax.Array
) -> jax.Array:
  """Whether a row checks its criterion after recurrence r (1-based): from max(min, 1) on,
  every check_every, and not at its last recurrence (where it stops anyway)."""
  first_B = jnp.maximum(min_recurrences_B, 1)
  return (r >= first_B) & ((r - first_B) % check_every_B == 0) & (r < recurrences_B)
