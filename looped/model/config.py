"""Typed, hashable model config built from the `config.model` ConfigDict.

The Flax modules take this frozen dataclass (hashable, so it can be a static jit argument) rather
than a ConfigDict, and `validate` checks every field before any compute starts.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from looped import config_checks as cc

MLP_TYPES = ("swiglu", "relu2")
INJECTIONS = ("diagonal", "linear", "additive", "none")
# Where a layer normalizes: 'pre' x + f(n(x)); 'sandwich' x + n'(f(n(x))) (Ouro, Gemma 2);
# 'post' n'(x + f(n(x))) (Huginn's SandwichBlock).
BLOCK_NORMS = ("pre", "sandwich", "post")
# A norm on the core's output: 'none'; 'final' (the final norm's own weights on h_R before the
# coda, as Huginn's ln_f, used twice); 'every' (a norm ends every recurrence, so each h_r is
# normalized and the final norm is that one, as Ouro's).
CORE_OUT_NORMS = ("none", "final", "every")
STATE_INITS = ("like_init", "zeros", "embed")
DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("xla", "pallas")
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
MIXERS = ("gqa", "mla", "kda")  # Sequence mixers (attention.py, mla.py, kda.py).
STAGES = ("prelude", "core", "coda")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 257
  d_model: int = 256
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  mlp_dim: int = 768
  mlp_type: str = "swiglu"
  num_prelude_layers: int = 1
  num_core_layers: int = 2
  num_coda_layers: int = 1
  num_recurrences: int = 4
  injection: str = "diagonal"
  diagonal_decay_init: float = 0.5
  state_init: str = "like_init"
  state_init_std: float = 0.02
  prelude_norm: bool = True
  qk_norm: bool = True
  rope_base: float = 10000.0
  tie_embeddings: bool = True
  max_seq_len: int = 512
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  scan_recurrences: bool = True
  scan_unroll: int = 0
  remat: str = "none"
  attention_impl: str = "xla"
  prelude_mixers: tuple[str, ...] = ("gqa",)
  core_mixers: tuple[str, ...] = ("gqa",)
  coda_mixers: tuple[str, ...] = ("gqa",)
  mla_kv_rank: int = 64
  mla_q_rank: int = 0
  mla_rope_dim: int = 32
  kda_conv_size: int = 4
  kda_chunk_size: int = 16
  block_norm: str = "pre"
  qk_bias: bool = False
  embed_scale: float = 1.0
  core_out_norm: str = "none"
  exit_gate: bool = False

  def mixers(self, stage: str) -> tuple[str, ...]:
    """The mixer of each layer of a stage: its pattern repeated over the stage's layers."""
    pattern = getattr(self, f"{stage}_mixers")
    count = getattr(self, f"num_{stage}_layers")
    return tuple(pattern[i % len(pattern)] for i in range(count))

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def num_layers(self) -> int:
    """Distinct layers (parameters), not applications."""
    return self.num_prelude_layers + self.num_core_layers + self.num_coda_layers

  def kv_entries_per_token(self, share_kv: bool) -> int:
    """Cached head vectors per token over all layers (an all-GQA model: layers x K and V x kv
    heads), from looped.model.cache_layout; mixers.cache_bytes counts bytes."""
    from looped.model.cache_layout import cache_layout  # It reads this config's fields.

    return cache_layout(self, share_kv).vectors_per_token


def from_config(model_cfg) -> ModelConfig:
  """Builds a ModelConfig from `config.model` (validate first)."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = set(model_cfg.keys()) - fields
  if unknown:
    raise cc.ConfigError(f"config.model has unknown fields {sorted(unknown)}.")
  # Tuples (hashable) even where a command-line override gave a list.
  value = lambda v: tuple(v) if isinstance(v, list) else v
  return ModelConfig(**{k: value(model_cfg[k]) for k in model_cfg.keys()})


def validate(config, prefix: str = "model") -> None:
  """Checks every config.<prefix> field; raises ConfigError naming the field."""
  p = prefix + "."
  for name in ("vocab_size", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
    cc.integer(config, p + name, min_value=1)
  cc.integer(config, p + "num_prelude_layers", min_value=0)
  cc.integer(config, p + "num_core_layers", min_value=1)
  cc.integer(config, p + "num_coda_layers", min_value=0)
  cc.integer(config, p + "num_recurrences", min_value=1)
  cc.integer(config, p + "max_seq_len", min_value=1)
  cc.choice(config, p + "mlp_type", MLP_TYPES)
  cc.choice(config, p + "injection", INJECTIONS)
  cc.choice(config, p + "block_norm", BLOCK_NORMS)
  cc.choice(config, p + "core_out_norm", CORE_OUT_NORMS)
  cc.number(config, p + "embed_scale", min_value=0.0, min_exclusive=True)
  cc.choice(config, p + "state_init", STATE_INITS)
  cc.choice(config, p + "dtype", DTYPES)
  cc.choice(config, p + "param_dtype", DTYPES)
  cc.choice(config, p + "attention_impl", ATTENTION_IMPLS)
  cc.number(config, p + "state_init_std", min_value=0.0)
  cc.number(
    config,
    p + "diagonal_decay_init",
    min_value=0.0,
    max_value=1.0,
    min_exclusive=True,
    max_exclusive=True,
  )
  cc.number(config, p + "rope_base", min_value=1.0, min_exclusive=True)
  cc.number(config, p + "init_std", min_value=0.0, min_exclusive=True)
  cc.choice(config, p + "remat", REMAT_POLICIES)
  cc.integer(config, p + "scan_unroll", min_value=0)
  for name in ("prelude_norm", "qk_norm", "tie_embeddings", "scan_recurrences", "qk_bias"):
    cc.boolean(config, p + name)
  cc.boolean(config, p + "exit_gate")
  if cc.get(config, p + "core_out_norm") == "every" and cc.get(config, p + "num_coda_layers"):
    cc.fail(
      p + "core_out_norm",
      "every",
      "needs num_coda_layers = 0 (the recurrence's norm is the final norm)",
    )
  cc.divides(config, p + "num_heads", cc.get(config, p + "num_kv_heads"), p + "num_kv_heads")
  if cc.get(config, p + "head_dim") % 2:
    cc.fail(p + "head_dim", cc.get(config, p + "head_dim"), "must be even (RoPE rotates pairs)")
  for stage in STAGES:
    _check_mixers(config, f"{p}{stage}_mixers")
  if cc.get(config, p + "qk_bias"):
    for stage in STAGES:
      pattern = tuple(cc.get(config, f"{p}{stage}_mixers"))
      count = cc.get(config, f"{p}num_{stage}_layers")
      others = sorted({pattern[i % len(pattern)] for i in range(count)} - {"gqa"})
      if others:
        cc.fail(
          p + "qk_bias",
          True,
          f"biases GQA queries and keys, so every layer must be GQA, but {p}{stage}_mixers has "
          f"{others[0]} layers",
        )
  cc.integer(config, p + "mla_kv_rank", min_value=1)
  cc.integer(config, p + "mla_q_rank", min_value=0)
  cc.integer(config, p + "mla_rope_dim", min_value=2)
  if cc.get(config, p + "mla_rope_dim") % 2:
    cc.fail(p + "mla_rope_dim", cc.get(config, p + "mla_rope_dim"), "must be even (RoPE)")
  cc.integer(config, p + "kda_conv_size", min_value=1)
  cc.integer(config, p + "kda_chunk_size", min_value=1)
  from_config(cc.get(config, prefix))  # Unknown fields.


def _check_mixers(config, path: str) -> None:
  value = cc.get(config, path)
  if isinstance(value, str) or not isinstance(value, (tuple, list)) or not value:
    cc.fail(path, value, f"must be a non-empty tuple of mixers from {MIXERS}")
  bad = [m for m in value if m not in MIXERS]
  if bad:
    cc.fail(path, value, f"unknown mixers {bad}; allowed: {MIXERS}")
