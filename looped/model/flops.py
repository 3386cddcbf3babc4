"""Executed FLOPs per token of the looped model, counted from its config (matmuls only).

What a step runs, not what it needs: stochastic depth masks recurrences inside a static scan,
so every recurrence is computed; attention computes the full T x T score matrix and masks it.
Elementwise work (norms, softmax, RoPE) is left out, as in the usual 6N accounting. Used by the
benchmarks to put a measured step time against the machine's matmul throughput.
"""

from __future__ import annotations

from looped.model.config import ModelConfig


def forward_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Multiply-adds x 2 of one forward, per token, for an all-GQA model at full depth R."""
  mixers = {m for stage in ("prelude", "core", "coda") for m in cfg.mixers(stage)}
  if mixers - {"gqa"}:
    raise ValueError(f"FLOP counts cover GQA layers only; this model has {sorted(mixers)}.")
  d, hd = cfg.d_model, cfg.head_dim
  attention_proj = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # Q, O; K, V.
  mlp = d * cfg.mlp_dim * (3 if cfg.mlp_type == "swiglu" else 2)
  layers = cfg.num_prelude_layers + cfg.num_coda_layers + cfg.num_core_layers * cfg.num_recurrences
  inject = {"diagonal": d * d, "linear": 2 * d * d, "additive": 0}[cfg.injection]
  weights = layers * (attention_proj + mlp) + cfg.num_recurrences * inject + d * cfg.vocab_size
  scores = layers * 2 * cfg.num_heads * hd * seq_len  # Q K^T and P V over all T keys.
  return 2.0 * (weights + scores)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Forward + backward (the backward costs two forwards: gradients of inputs and weights)."""
  return 3.0 * forward_flops_per_token(cfg, seq_len)


def benice_flops_per_token(cfg: ModelConfig, seq_len: int, kv_passes: int) -> float:
  """A BeNice! step: the unshared and the shared pass, each trained, plus `kv_passes`
  gradient-free Jacobi passes that produce the broadcast K/V."""
  return 2 * train_flops_per_token(cfg, seq_len) + kv_passes * forward_flops_per_token(cfg, seq_len)
