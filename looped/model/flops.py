"""Executed FLOPs per token of the looped model, counted from its config (matmuls only).

What a step runs, not what it needs: stochastic depth masks recurrences inside a static scan,
so every recurrence is computed; attention computes the full T x T score matrix and masks it.
Elementwise work (norms, softmax, RoPE, KDA's decay and gates) is left out, as in the usual 6N
accounting. GQA and MLA layers are counted as the parallel forward runs them (MLA in the expanded
form that training runs: the latent is projected up to keys and values at every position). KDA
layers are counted in their recurrent form (`mixer_macs`): the chunkwise form training runs
computes the same outputs with extra intra-chunk work (about C x (3 H + 2 E) + C^2
multiply-adds per token and head at chunk length C) that is not counted, so a KDA model's MFU
is the recurrent form's work over the time taken. Used by the trainer's MFU, the benchmarks
and the serving simulator (looped/sim/shape.py).
"""

from __future__ import annotations

from looped.model import mixer_registry
from looped.model.config import STAGES, ModelConfig
from looped.model.mixer_interface import LayerMacs


def mixer_macs(cfg: ModelConfig, mixer: str, *, absorbed: bool = False) -> LayerMacs:
  """Multiply-adds per token of one layer's sequence mixer (its registry record's `macs`,
  looped/model/mixer_registry.py): MLA in the expanded form training runs, or with `absorbed`
  in the form every cached call runs; KDA in its recurrent form (module docstring)."""
  if mixer not in mixer_registry.REGISTRY:
    names = [m.upper() for m in mixer_registry.REGISTRY]
    covered = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
    raise ValueError(f"FLOP counts cover {covered} layers; this model has {mixer} layers.")
  return mixer_registry.REGISTRY[mixer].macs(cfg, absorbed)


def mlp_macs(cfg: ModelConfig) -> int:
  """Multiply-adds per token of one layer's MLP."""
  return cfg.d_model * cfg.mlp_dim * (3 if cfg.mlp_type == "swiglu" else 2)


def recurrence_macs(cfg: ModelConfig) -> int:
  """Multiply-adds per token of one recurrence outside its layers: injection and exit gate."""
  d = cfg.d_model
  inject = {"diagonal": d * d, "linear": 2 * d * d, "additive": 0, "none": 0}[cfg.injection]
  return inject + d * cfg.exit_gate


def stage_runs(cfg: ModelConfig) -> dict[str, int]:
  """How many times each stage's layers run per token: the core R times."""
  return {"prelude": 1, "core": cfg.num_recurrences, "coda": 1}


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Multiply-adds x 2 of one forward, per token, at full depth R."""
  runs = stage_runs(cfg)
  total = 0
  for stage in STAGES:
    for i, mixer in enumerate(cfg.mixers(stage)):
      m = mixer_macs(cfg, mixer)
      total += runs[stage] * (m.weights + m.per_key * seq_len + m.state + mlp_macs(cfg))
      if cfg.has_value_embed(stage, i):  # The gate; the table is a lookup.
        total += runs[stage] * cfg.value_embed_gate_dim * cfg.num_kv_heads
  total += cfg.num_recurrences * recurrence_macs(cfg) + cfg.d_model * cfg.vocab_size
  total += cfg.d_model * cfg.d_model * cfg.core_out_proj  # C before the coda (Parcae).
  return 2.0 * total


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward + backward (the backward costs two forwards: gradients of inputs and weights)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len)


def benice_flops_per_token(cfg: ModelConfig, seq_len: int, kv_passes: int) -> float:
  """A BeNice! step: the unshared and the shared pass, each trained, plus `kv_passes`
  gradient-free Jacobi passes that produce the broadcast K/V."""
  return 2 * train_flops_per_token(cfg, seq_len) + kv_passes * forward_flops_per_token(cfg, seq_len)
