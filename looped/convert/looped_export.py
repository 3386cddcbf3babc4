"""LoopedLM -> the `looped` family: a folder transformers loads with this project's own PyTorch
modeling code (hf_looped/modeling_looped.py and configuration_looped.py, copied into the folder and
named by config.json's `auto_map`), so every model looped trains leaves in the Hugging Face
layout, whatever its shape: prelude / core / coda, every injection, SwiGLU and ReLU^2, GQA (QK-norm,
QK bias, stored RoPE tables, value embeddings), MLA, KDA and hybrids, every block and core-output
norm, the exit gate, tied or untied heads.

`check(cfg)` gives config.json: `architectures`, `model_type: looped`, `auto_map`, every model
field (the model's record; looped's compute `dtype` as `compute_dtype`) and how generate()
caches by default (configs/generate.py's share_kv, kv_policy and prefill_block); the export
program adds the token ids and the weights' dtype. It refuses, in one line naming the field, a
model field the modeling code does not know (MODEL_FIELDS) set to other than its default.
`to_tensors` maps the params by looped_family.py's names (the inverse of its to_params) and adds
`model.initial_state`, h_0 of every position for state_init 'like_init': the noise LoopedLM draws
(key 0) times state_init_std, so the PyTorch model starts from looped's own draw.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from looped import config_checks as cc
from looped.convert import looped_family
from looped.engine.config import GenConfig
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM

FAMILY = "looped"
HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_looped")
# The PyTorch code copied verbatim into every folder (config.json's auto_map names them).
MODELING_FILES = ("configuration_looped.py", "modeling_looped.py")
SHARDS = True  # transformers reads model.safetensors.index.json and its shards.
TORCH_BIN = False  # transformers reads the safetensors; no pytorch_model.bin beside them.
# Params LoopedLM keeps in float32 whatever param_dtype is: kept so in a bfloat16 export.
FLOAT32 = (".A_log", ".dt", ".dt_bias", ".rope_table", ".exit_gate_bias")
# ModelConfig fields the modeling code reads or records; another field set to other than its
# default is refused (a field added to looped after this code was written).
MODEL_FIELDS = (
  "vocab_size",
  "d_model",
  "num_heads",
  "num_kv_heads",
  "head_dim",
  "mlp_dim",
  "mlp_type",
  "num_prelude_layers",
  "num_core_layers",
  "num_coda_layers",
  "num_recurrences",
  "injection",
  "diagonal_decay_init",
  "state_init",
  "state_init_std",
  "prelude_norm",
  "qk_norm",
  "rope_base",
  "rope_table",
  "tie_embeddings",
  "max_seq_len",
  "init_std",
  "dtype",
  "param_dtype",
  "scan_recurrences",
  "scan_unroll",
  "remat",
  "attention_impl",
  "prelude_mixers",
  "core_mixers",
  "coda_mixers",
  "mla_kv_rank",
  "mla_q_rank",
  "mla_rope_dim",
  "kda_conv_size",
  "kda_chunk_size",
  "block_norm",
  "qk_bias",
  "embed_scale",
  "core_out_norm",
  "exit_gate",
  "norm_eps",
  "qk_norm_eps",
  "value_embed_layers",
  "value_embed_gate_dim",
  "core_out_proj",
)
_DEFAULTS = model_lib.ModelConfig()
MIXERS = ("gqa", "mla", "kda")  # The sequence mixers the modeling code computes.


def _json(value):
  return list(value) if isinstance(value, tuple) else value


def check(cfg) -> dict:
  """config.json for the ModelConfig `cfg` (without token ids and dtype, which export adds)."""
  for f in dataclasses.fields(cfg):
    if f.name not in MODEL_FIELDS and getattr(cfg, f.name) != getattr(_DEFAULTS, f.name):
      raise cc.ConfigError(
        f"model.{f.name} = {getattr(cfg, f.name)!r} cannot be exported to looped: the exported "
        "modeling code (looped/convert/hf_looped) does not compute it."
      )
  for stage in ("prelude", "core", "coda"):
    mixers = getattr(cfg, f"{stage}_mixers")
    unknown = sorted(set(mixers) - set(MIXERS))
    if unknown:
      raise cc.ConfigError(
        f"model.{stage}_mixers = {mixers!r} cannot be exported to looped: the exported modeling "
        f"code computes {', '.join(MIXERS)} layers, not {unknown[0]}."
      )
  gen = GenConfig()
  fields = {
    looped_family.RENAMED.get(f.name, f.name): _json(getattr(cfg, f.name))
    for f in dataclasses.fields(cfg)
  }
  return {
    "architectures": list(looped_family.ARCHITECTURES),
    "model_type": "looped",
    "auto_map": {
      "AutoConfig": "configuration_looped.LoopedConfig",
      "AutoModel": "modeling_looped.LoopedModel",
      "AutoModelForCausalLM": "modeling_looped.LoopedForCausalLM",
    },
    **fields,
    "share_kv": gen.share_kv,
    "kv_policy": gen.kv_policy,
    "prefill_block": gen.prefill_block,
    "use_cache": True,
  }


def check_params(params: dict, cfg) -> None:
  """Nothing to refuse after the restore: every param maps."""
  del params, cfg


def initial_state(cfg) -> np.ndarray:
  """[max_seq_len, d_model]: h_0 of each position, computed by LoopedLM's own state_init."""
  e = jnp.zeros((1, cfg.max_seq_len, cfg.d_model), jnp.float32)
  positions = jnp.arange(cfg.max_seq_len)[None]
  h0 = LoopedLM(cfg).apply(
    {"params": {}}, e, positions, cfg.max_seq_len, method=LoopedLM._initial_state
  )
  return np.asarray(h0[0], np.float32)


def to_tensors(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
  """The PyTorch model's state dict (numpy, each param in its own dtype, widened exactly)."""
  del hf
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(params["params"]):
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    value = np.asarray(x)
    if value.dtype != np.float32:  # bfloat16 params widen exactly; export.dtype casts later.
      value = value.astype(np.float32)
    out[looped_family.torch_name(keys)] = np.ascontiguousarray(looped_family.to_torch(keys, value))
  if cfg.state_init == "like_init":
    out[looped_family.INITIAL_STATE] = initial_state(cfg)
  expected, _ = looped_family.expected_shapes(check(cfg))
  for name in sorted(expected.keys() | out.keys()):  # A mapping bug fails here, not in torch.
    if name == looped_family.INITIAL_STATE:
      continue
    got = out[name].shape if name in out else None
    if got != (tuple(expected[name]) if name in expected else None):
      raise ValueError(f"exported {name}: shape {got}, the looped family's {expected.get(name)}")
  return out
