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

import dataclasses

from looped.model.config import STAGES, ModelConfig


@dataclasses.dataclass(frozen=True)
class LayerMacs:
  """Multiply-adds per token of one application of a layer's sequence mixer.

  weights: its projections (and KDA's depthwise conv, one multiply-add per weight);
  per_key: for each position the token attends over (scores and the weighted values);
  state: KDA's delta-rule update and read of its per-sequence state.
  """

  weights: int
  per_key: int = 0
  state: int = 0


def mixer_macs(cfg: ModelConfig, mixer: str, *, absorbed: bool = False) -> LayerMacs:
  """Multiply-adds per token of one layer's sequence mixer (`mixer` of looped.model.config).

  MLA in the expanded form (training's parallel forward: keys and values projected up from the
  latent, per_key N (H + Y) + N H), or with `absorbed` in the form every cached call runs
  (decode, block prefill, the engine: W_UK folded into the query and W_UV applied after the
  sum, so the same 2 L N H weights per token and per_key N (L + Y) + N L over the latents as
  cached).

  KDA (looped/model/kda.py), N heads of key width H and value width E = H, W conv taps:
  projections x -> q|k|v (D x 3NH), decay D x H then H x NH, beta D x N, output gate D x H then
  H x NH, output NH x D, and the conv (W x 3NH). Its recurrent form per token and head
  (`kda_recurrent`) decays S [H, E] (elementwise, not counted), reads k^T S (H E), adds
  b k (v - k^T S)^T (H E) and reads q^T S (H E): state = 3 N H E multiply-adds.
  """
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  if mixer == "gqa":
    weights = d * h * (2 * n + 2 * cfg.num_kv_heads)  # Q, O; K, V.
    return LayerMacs(weights, per_key=2 * n * h)  # Q K^T and P V.
  if mixer == "mla":
    latent, rope = cfg.mla_kv_rank, cfg.mla_rope_dim
    if cfg.mla_q_rank:  # Down to the query latent, then up to every head's query.
      query = d * cfg.mla_q_rank + cfg.mla_q_rank * n * (h + rope)
    else:
      query = d * n * (h + rope)
    # kv_down to the latent and the shared RoPE key; key_up and value_up at every position;
    # the output projection.
    weights = query + d * (latent + rope) + 2 * latent * n * h + n * h * d
    if absorbed:  # Scores against the latent and the RoPE key; P times the latent.
      return LayerMacs(weights, per_key=n * (latent + rope) + n * latent)
    return LayerMacs(weights, per_key=n * (h + rope) + n * h)  # Scores (with RoPE); P V.
  if mixer == "kda":
    channels = 3 * n * h  # q, k, v.
    projections = d * channels + (d * h + h * n * h) * 2 + d * n + n * h * d
    weights = projections + cfg.kda_conv_size * channels
    return LayerMacs(weights, state=3 * n * h * h)
  raise ValueError(f"FLOP counts cover GQA, MLA and KDA layers; this model has {mixer} layers.")


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
