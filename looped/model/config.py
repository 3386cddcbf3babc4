"""The model section: every field of `config.model` declared once, with its default, doc and
range, as a typed, hashable dataclass.

The Flax modules take a ModelConfig (hashable, so it can be a static jit argument) rather than a
ConfigDict. The config files' `model` section is its defaults (looped.schema.defaults), and
`validate` checks every field before any compute starts: the declared ranges, then the rules
that relate fields.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from looped import config_checks as cc
from looped import schema
from looped.model import mixer_registry
from looped.schema import field

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
ATTENTION_IMPLS = ("auto", "xla", "pallas")  # 'auto': pallas_attention.uses_kernel decides.
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable")
MIXERS = tuple(mixer_registry.REGISTRY)  # Sequence mixers: the registry's names.
STAGES = ("prelude", "core", "coda")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The looped LM (docs/design.md §2): the `config.model` section of every config file, its
  defaults, docs and ranges (looped.schema derives the ConfigDict, validation and help)."""

  vocab_size: int = field(
    257, "Embedding rows; >= the tokenizer's vocabulary (bytes: 256 + EOS).", min=1
  )
  d_model: int = field(128, "Residual stream width.", min=1)
  num_heads: int = field(4, "Query heads per attention layer; a multiple of num_kv_heads.", min=1)
  num_kv_heads: int = field(2, "Key/value heads (GQA); divides num_heads.", min=1)
  head_dim: int = field(32, "Width of one attention head (even: RoPE rotates pairs).", min=1)
  mlp_dim: int = field(384, "Hidden width of the MLP.", min=1)
  mlp_type: str = field("swiglu", "MLP kind.", choices=MLP_TYPES)
  num_prelude_layers: int = field(
    1, "P: layers before the loop (run once, ordinary KV-cache).", min=0
  )
  num_core_layers: int = field(2, "B: layers of the looped core block (one set of weights).", min=1)
  num_coda_layers: int = field(1, "C: layers after the loop (run once, ordinary KV-cache).", min=0)
  num_recurrences: int = field(
    4, "R: core-block recurrences at evaluation (and the training maximum).", min=1
  )
  injection: str = field(
    "diagonal",
    "How e enters each recurrence ('none': h alone, a stack looped as a whole, as Ouro).",
    choices=INJECTIONS,
  )
  diagonal_decay_init: float = field(
    0.5, "injection='diagonal': per-channel decay of h at init.", gt=0.0, lt=1.0
  )
  state_init: str = field(
    "like_init", "h_0: 'like_init' (scaled noise), 'zeros', 'embed' (h_0 = e).", choices=STATE_INITS
  )
  state_init_std: float = field(0.02, "Std of h_0 noise for state_init='like_init'.", min=0.0)
  prelude_norm: bool = field(True, "RMSNorm on the prelude output e before injection.")
  qk_norm: bool = field(True, "RMSNorm on queries and keys per head.")
  rope_base: float = field(10000.0, "RoPE base frequency.", gt=1.0)
  rope_table: bool = field(
    False,
    "GQA layers read RoPE cos/sin from a stored [max_seq_len, head_dim/2, 2] param "
    "(rope_table, not trained; a converted checkpoint's table) instead of computing them.",
  )
  tie_embeddings: bool = field(True, "LM head reuses the embedding matrix.")
  max_seq_len: int = field(512, "Longest sequence (positions) the model is used with.", min=1)
  init_std: float = field(
    0.02, "Std of weight initialisation (output projections scaled by depth).", gt=0.0
  )
  dtype: str = field("float32", "Compute dtype.", choices=DTYPES)
  param_dtype: str = field("float32", "Parameter storage dtype.", choices=DTYPES)
  scan_recurrences: bool = field(
    True, "Loop the core with lax.scan (False: Python-unrolled, same math)."
  )
  scan_unroll: int = field(
    0,
    "Recurrences per scan iteration, unrolled by XLA (0: all R, the speed of the unrolled "
    "loop; 1: compile time constant in R; same math).",
    min=0,
  )
  remat: str = field("none", "Per-recurrence remat (saves memory).", choices=REMAT_POLICIES)
  attention_impl: str = field(
    "auto",
    "'xla' (einsum), 'pallas' (pallas_kernels; interpreted on CPU) or 'auto' (the flash kernel "
    "in parallel passes on GPU/TPU where it lowers, on one device; else XLA).",
    choices=ATTENTION_IMPLS,
  )
  prelude_mixers: tuple[str, ...] = field(
    ("gqa",),
    "Sequence mixer per prelude layer, repeated.",
    items=MIXERS,
    noun="mixers",
    nonempty=True,
  )
  core_mixers: tuple[str, ...] = field(
    ("gqa",),
    "Mixer per core layer, repeated, e.g. ('kda', 'kda', 'kda', 'mla').",
    items=MIXERS,
    noun="mixers",
    nonempty=True,
  )
  coda_mixers: tuple[str, ...] = field(
    ("gqa",), "Mixer per coda layer, repeated.", items=MIXERS, noun="mixers", nonempty=True
  )
  mla_kv_rank: int = field(
    64, "MLA: latent c_kv width (cached per token with the RoPE key).", min=1
  )
  mla_q_rank: int = field(0, "MLA: low-rank query width (0 = full-rank query projection).", min=0)
  mla_rope_dim: int = field(
    32, "MLA: decoupled RoPE key/query width (even; shared by the heads).", min=2
  )
  kda_conv_size: int = field(4, "KDA: short causal conv width on q, k, v.", min=1)
  kda_chunk_size: int = field(
    16,
    "KDA: chunk length of the chunkwise-parallel (training) form (16: 3x faster training "
    "steps than 64 on CPU, same math; docs/mixers.md).",
    min=1,
  )
  block_norm: str = field(
    "pre",
    "Layer norms: 'pre', 'sandwich' (x + n(f(n(x))), Ouro), 'post' (Huginn).",
    choices=BLOCK_NORMS,
  )
  qk_bias: bool = field(
    False, "GQA: a learned per-head bias on queries and keys before RoPE (Huginn)."
  )
  embed_scale: float = field(
    1.0, "Token embeddings are multiplied by this (Huginn: sqrt(d_model)).", gt=0.0
  )
  core_out_norm: str = field(
    "none",
    "'final': the final norm also on h_R before the coda (Huginn); 'every': a norm ends every "
    "recurrence and is the final norm (Ouro; no coda).",
    choices=CORE_OUT_NORMS,
  )
  exit_gate: bool = field(
    False, "A per-recurrence exit logit w.h_r + b (Ouro's early-exit gate), in aux."
  )
  norm_eps: float = field(
    1e-6, "Epsilon of the layer, prelude, final and MLA norms (Parcae: 1e-5).", gt=0.0, lt=1.0
  )
  qk_norm_eps: float = field(
    1e-6, "Epsilon of the GQA QK-norm (Parcae: float32's machine epsilon).", gt=0.0, lt=1.0
  )
  value_embed_layers: tuple[int, ...] = field(
    (),
    "Layers (numbered prelude, core, coda from 0) whose values add a gated per-token table "
    "(Parcae's value embeddings).",
    by_hand="tuple of distinct layer numbers in [0, layers), each a GQA layer",
  )
  value_embed_gate_dim: int = field(
    32, "Leading input channels of the value-embedding gate 2 sigmoid(x[:G] W).", min=1
  )
  core_out_proj: bool = field(False, "A linear map of h_R before the coda (Parcae's C).")

  def mixers(self, stage: str) -> tuple[str, ...]:
    """The mixer of each layer of a stage: its pattern repeated over the stage's layers."""
    pattern = getattr(self, f"{stage}_mixers")
    count = getattr(self, f"num_{stage}_layers")
    return tuple(pattern[i % len(pattern)] for i in range(count))

  def has_value_embed(self, stage: str, index: int) -> bool:
    """Whether layer `index` of `stage` adds a value embedding (value_embed_layers counts the
    distinct layers: prelude, then core, then coda)."""
    offset = {"prelude": 0, "core": self.num_prelude_layers}.get(
      stage, self.num_prelude_layers + self.num_core_layers
    )
    return offset + index in self.value_embed_layers

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


def from_config(model_cfg) -> ModelConfig:
  """Builds a ModelConfig from `config.model` (validate first)."""
  schema.check_unknown(ModelConfig, model_cfg, "model")
  # Tuples (hashable) even where a command-line override gave a list.
  value = lambda v: tuple(v) if isinstance(v, list) else v
  return ModelConfig(**{k: value(model_cfg[k]) for k in model_cfg.keys()})


def validate(config, prefix: str = "model") -> None:
  """Checks every config.<prefix> field (the schema's ranges, then the rules relating
  fields); raises ConfigError naming the field."""
  schema.validate(ModelConfig, config, prefix)
  p = prefix + "."
  get = lambda name: cc.get(config, p + name)
  if get("core_out_norm") == "every" and get("num_coda_layers"):
    cc.fail(
      p + "core_out_norm",
      "every",
      "needs num_coda_layers = 0 (the recurrence's norm is the final norm)",
    )
  cc.divides(config, p + "num_heads", get("num_kv_heads"), p + "num_kv_heads")
  if get("head_dim") % 2:
    cc.fail(p + "head_dim", get("head_dim"), "must be even (RoPE rotates pairs)")
  gqa_only = (("qk_bias", "biases GQA queries and keys"), ("rope_table", "is read by GQA only"))
  for name, what in gqa_only:
    if not get(name):
      continue
    for stage in STAGES:
      pattern, count = tuple(get(f"{stage}_mixers")), get(f"num_{stage}_layers")
      others = sorted({pattern[i % len(pattern)] for i in range(count)} - {"gqa"})
      if others:
        cc.fail(
          p + name,
          True,
          f"{what}, so every layer must be GQA, but {p}{stage}_mixers has {others[0]} layers",
        )
  _check_value_embed_layers(get, p)
  if get("core_out_proj") and get("core_out_norm") == "every":
    cc.fail(
      p + "core_out_proj",
      True,
      "needs core_out_norm other than 'every' (each h_r is then the head's input as it is)",
    )
  if get("mla_rope_dim") % 2:
    cc.fail(p + "mla_rope_dim", get("mla_rope_dim"), "must be even (RoPE)")


def _check_value_embed_layers(get, p: str) -> None:
  """value_embed_layers: distinct numbers of GQA layers (prelude, core, coda counted from 0)."""
  name, layers = p + "value_embed_layers", get("value_embed_layers")
  if isinstance(layers, str) or not isinstance(layers, (tuple, list)):
    cc.fail(name, layers, "must be a tuple of layer numbers")
  kinds = []
  for stage in STAGES:
    pattern, count = tuple(get(f"{stage}_mixers")), get(f"num_{stage}_layers")
    kinds += [pattern[i % len(pattern)] for i in range(count)]
  for layer in layers:
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(kinds):
      cc.fail(name, layers, f"has {layer!r}; layers are numbered 0..{len(kinds) - 1}")
    if kinds[layer] != "gqa":
      cc.fail(name, layers, f"layer {layer} is {kinds[layer]}; value embeddings need GQA layers")
  if len(set(layers)) != len(layers):
    cc.fail(name, layers, "lists a layer twice")
  if layers and get("value_embed_gate_dim") > get("d_model"):
    cc.fail(
      p + "value_embed_gate_dim",
      get("value_embed_gate_dim"),
      f"must be <= d_model = {get('d_model')} (the gate reads the first channels)",
    )
