"""Executed FLOPs per token of the looped model, counted from its config (matmuls only).

What a step runs, not what it needs: stochastic depth masks recurrences inside a static scan,
so every recurrence is computed; attention computes the full T x T score matrix and masks it.
Elementwise work (norms, softmax, RoPE) is left out, as in the usual 6N accounting. GQA and MLA
layers are counted (MLA in the expanded form that training runs: the latent is projected up to
keys and values at every position); KDA layers are not (its chunkwise form's count depends on
the chunking), and a model with any is refused with a ValueError. Used by the trainer's MFU and
the benchmarks.
"""

from __future__ import annotations

from looped.model.config import STAGES, ModelConfig


def _mixer_macs(cfg: ModelConfig, mixer: str, seq_len: int) -> tuple[int, int]:
  """(weight multiply-adds, score multiply-adds) per token of one layer's sequence mixer."""
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  if mixer == "gqa":
    weights = d * h * (2 * n + 2 * cfg.num_kv_heads)  # Q, O; K, V.
    return weights, 2 * n * h * seq_len  # Q K^T and P V over all T keys.
  if mixer == "mla":
    latent, rope = cfg.mla_kv_rank, cfg.mla_rope_dim
    if cfg.mla_q_rank:  # Down to the query latent, then up to every head's query.
      query = d * cfg.mla_q_rank + cfg.mla_q_rank * n * (h + rope)
    else:
      query = d * n * (h + rope)
    # kv_down to the latent and the shared RoPE key; key_up and value_up at every position;
    # the output projection.
    weights = query + d * (latent + rope) + 2 * latent * n * h + n * h * d
    return weights, n * (h + rope) * seq_len + n * h * seq_len  # Scores (with RoPE); P V.
  raise ValueError(f"FLOP counts cover GQA and MLA layers; this model has {mixer} layers.")


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Multiply-adds x 2 of one forward, per token, at full depth R."""
  d = cfg.d_model
  mlp = d * cfg.mlp_dim * (3 if cfg.mlp_type == "swiglu" else 2)
  runs = {"prelude": 1, "core": cfg.num_recurrences, "coda": 1}  # Times each layer runs.
  weights = scores = 0
  for stage in STAGES:
    for i, mixer in enumerate(cfg.mixers(stage)):
      w, s = _mixer_macs(cfg, mixer, seq_len)
      if cfg.has_value_embed(stage, i):  # The gate; the table is a lookup.
        w += cfg.value_embed_gate_dim * cfg.num_kv_heads
      weights += runs[stage] * (w + mlp)
      scores += runs[stage] * s
  inject = {"diagonal": d * d, "linear": 2 * d * d, "additive": 0, "none": 0}[cfg.injection]
  weights += cfg.num_recurrences * (inject + d * cfg.exit_gate) + d * cfg.vocab_size
  weights += d * d * cfg.core_out_proj
  return 2.0 * (weights + scores)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward + backward (the backward costs two forwards: gradients of inputs and weights)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len)


def benice_flops_per_token(cfg: ModelConfig, seq_len: int, kv_passes: int) -> float:
  """A BeNice! step: the unshared and the shared pass, each trained, plus `kv_passes`
  gradient-free Jacobi passes that produce the broadcast K/V."""
  return 2 * train_flops_per_token(cfg, seq_len) + kv_passes * forward_flops_per_token(cfg, seq_len)
