"""LoopedLM -> Parcae (`_class_name: ParcaeConfig`): the inverse of parcae.py's mapping.

`check(cfg)` refuses, one line naming the model field, what Parcae's public code cannot compute:
another MLP, injection, mixer, block norm, state init or core-output norm; GQA (Parcae's core has
as many key/value heads as query heads); a head width other than d_model / num_heads; an
embedding scale or exit gate; a RoPE base other than 50000 (from_pretrained drops
rope_settings); a QK-norm epsilon other than float32's machine epsilon; value embeddings on layers
where Parcae's rule places none. `check_params` refuses learned QK-norm scales (Parcae's QK-norm
has no weight). `to_tensors` inverts parcae.to_params: the query and key rows go back from
halves (i, i + H/2) to interleaved pairs, the MLP's 1/2 comes out of the down projection (exact
in binary), and the kernels are transposed back to torch's [out, in]. What LoopedLM lacks and
Parcae computes with is written as its neutral value: `C` = identity without core_out_proj,
zero value tables and gates where Parcae's rule has a table or a gate and the model none (they add
0 to the values). The RoPE buffer `freqs_cis` is not written: the public code recomputes it and
loads with strict=False.
"""

from __future__ import annotations

import math

import numpy as np

from looped import config_checks as cc
from looped.convert import parcae
from looped.model import mixers as mixers_lib

FAMILY = "Parcae"
_MAX_BACKPROP_DEPTH = 256  # mean_backprop_depth values tried for the value-embedding rule.


def _refuse(name: str, value, why: str):
  raise cc.ConfigError(f"model.{name} = {value!r} cannot be exported to Parcae: {why}.")


def _config(cfg, depth: int) -> dict:
  """The config.json fields (a ParcaeConfig's dataclass fields) of `cfg`."""
  d = cfg.d_model
  return {
    "_class_name": "ParcaeConfig",
    "model_class_name": "Parcae",
    "name": "looped-export",
    "block_size": cfg.max_seq_len,
    "vocab_size": cfg.vocab_size,
    "padded_vocab_size": cfg.vocab_size,
    "padding_multiple": 1,
    "n_embd": d,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "intermediate_size": cfg.mlp_dim,
    "recurrent_embedding_dimension": d,
    "recurrent_intermediation_embedding_dimension": cfg.mlp_dim,
    "recurrent_num_attention_heads": cfg.num_heads,
    "n_layers_in_prelude": cfg.num_prelude_layers,
    "n_layers_in_recurrent_block": cfg.num_core_layers,
    "n_layers_in_coda": cfg.num_coda_layers,
    "mean_recurrence": cfg.num_recurrences,
    "mean_backprop_depth": depth,
    "injection_type": "diagonal",
    "state_init": {"like_init": "like-init", "zeros": "zero"}[cfg.state_init],
    "prelude_norm": cfg.prelude_norm,
    "qk_norm": cfg.qk_norm,
    "tie_embeddings": cfg.tie_embeddings,
    "norm_eps": cfg.norm_eps,
    "block_class_name": "TransformerPreNormBlock",
    "norm_class_name": "RMSNorm",
    "mlp_class_name": "BaseMLP",
    "nonlin_name": "ReLU2",
    "init_strategy": "scaled",
    "bias": False,
    "qk_bias": False,
    "clip_qkv": None,
    "logit_softcap": None,
    "use_abacus": False,
    "rope_settings": {"rope_base": 50000, "rope_condense_ratio": 1, "use_rope": True},
  }


def _backprop_depth(cfg) -> int:
  """A mean_backprop_depth for which Parcae's value-embedding rule (parcae.value_embed_layers)
  covers the model's value_embed_layers: the same layers if one does, else the fewest extra."""
  want = set(cfg.value_embed_layers)
  best = None
  for depth in range(1, _MAX_BACKPROP_DEPTH + 1):
    have = set(parcae.value_embed_layers(_config(cfg, depth)))
    if want <= have and (best is None or len(have) < best[1]):
      best = (depth, len(have))
  if best is None:
    _refuse(
      "value_embed_layers",
      cfg.value_embed_layers,
      "Parcae adds value embeddings only on alternate layers ending with the last one "
      f"(parcae.value_embed_layers), for no mean_backprop_depth up to {_MAX_BACKPROP_DEPTH}",
    )
  return best[0]


def check(cfg) -> dict:
  """Parcae's config.json for the ModelConfig `cfg`; ConfigError naming the first model field
  Parcae cannot express."""
  required = {
    "mlp_type": ("relu2", "Parcae's MLP is fc -> relu(x)^2 / 2 -> proj"),
    "injection": ("diagonal", "Parcae injects e diagonally (A_log, dt, B)"),
    "block_norm": ("pre", "Parcae's blocks are pre-norm"),
    "core_out_norm": ("none", "Parcae has no norm on h_R"),
    "exit_gate": (False, "Parcae has no exit gate"),
    "qk_bias": (False, "Parcae has no QK bias"),
    "embed_scale": (1.0, "Parcae's scaled init uses embedding scale 1"),
    "rope_base": (50000.0, "from_pretrained drops rope_settings and runs RoPE at base 50000"),
    "qk_norm_eps": (
      float(np.finfo(np.float32).eps),
      "Parcae's QK-norm epsilon is float32's machine epsilon",
    ),
    "value_embed_gate_dim": (32, "Parcae's value-embedding gate reads 32 channels"),
  }
  for name, (value, why) in required.items():
    if getattr(cfg, name) != value:
      _refuse(name, getattr(cfg, name), f"{why} (needs {value!r})")
  for stage in ("prelude", "core", "coda"):
    if mixers_lib.lacking(cfg, stage, "plain_attention"):
      mixers = getattr(cfg, f"{stage}_mixers")
      _refuse(f"{stage}_mixers", mixers, "Parcae's layers are all attention ('gqa')")
  if cfg.num_kv_heads != cfg.num_heads:
    _refuse(
      "num_kv_heads",
      cfg.num_kv_heads,
      f"Parcae's core has as many key/value heads as query heads ({cfg.num_heads})",
    )
  if cfg.head_dim * cfg.num_heads != cfg.d_model:
    _refuse(
      "head_dim",
      cfg.head_dim,
      f"Parcae's head width is d_model / num_heads = {cfg.d_model / cfg.num_heads:g}",
    )
  if cfg.state_init not in ("like_init", "zeros"):
    _refuse("state_init", cfg.state_init, "Parcae starts from like-init noise or zeros")
  std = math.sqrt(2 / (5 * cfg.d_model))
  if cfg.state_init == "like_init" and not math.isclose(cfg.state_init_std, std, rel_tol=1e-6):
    _refuse(
      "state_init_std", cfg.state_init_std, f"Parcae's like-init std is sqrt(2 / 5 d_model) = {std}"
    )
  return _config(cfg, _backprop_depth(cfg))


def check_params(params: dict, cfg) -> None:
  """ConfigError naming the first QK-norm scale that is not 1 (Parcae's QK-norm has no weight)."""
  if not cfg.qk_norm:
    return
  for scope, block in _blocks(params["params"], cfg):
    for norm in ("query_norm", "key_norm"):
      scale = np.asarray(block["attn"][norm]["scale"])
      if not np.all(scale == 1):
        raise cc.ConfigError(
          f"params {scope}/attn/{norm}/scale is not all ones (max |scale - 1| = "
          f"{float(np.max(np.abs(scale - 1))):.3g}): Parcae's QK-norm has no weight, so "
          "model.qk_norm with learned scales cannot be exported to Parcae."
        )


def _blocks(p: dict, cfg):
  """(scope, block params) of every layer, prelude, core, coda, with Parcae's module name."""
  stages = (
    ("prelude_{}", "transformer.prelude", cfg.num_prelude_layers),
    ("recurrence/layer_{}", "transformer.core_block", cfg.num_core_layers),
    ("coda_{}", "transformer.coda", cfg.num_coda_layers),
  )
  for scope, _, count in stages:
    for i in range(count):
      node = p
      for part in scope.format(i).split("/"):
        node = node[part]
      yield scope.format(i), node


def _module_names(cfg) -> list[str]:
  names = [f"transformer.prelude.{i}" for i in range(cfg.num_prelude_layers)]
  names += [f"transformer.core_block.{i}" for i in range(cfg.num_core_layers)]
  return names + [f"transformer.coda.{i}" for i in range(cfg.num_coda_layers)]


def _inverse_half_rotation(h: int) -> np.ndarray:
  """Rows (i, i + h/2) back to interleaved pairs (2i, 2i+1): parcae._half_rotation undone."""
  return np.argsort(parcae._half_rotation(h))


def to_tensors(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
  """Parcae's state dict (float32 numpy, torch's [out, in] layout) for the params of `cfg`, for
  config.json `hf` (check(cfg)); every tensor parcae.expected_shapes lists."""
  p = jax_free(params["params"])
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  inv = _inverse_half_rotation(h)
  rows = lambda kernel_DxNxH: kernel_DxNxH.transpose(1, 2, 0)  # -> [heads, H, D]
  wte = p["embed"]["embedding"]
  out = {
    "transformer.wte.weight": wte,
    "lm_head.weight": wte if cfg.tie_embeddings else p["head"]["kernel"].T,
    "transformer.ln_f.weight": p["final_norm"]["scale"],
    "transformer.C.weight": (
      p["core_out"]["kernel"].T if cfg.core_out_proj else np.eye(d, dtype=np.float32)
    ),
    "transformer.adapter.A_log": p["recurrence"]["inject"]["A_log"],
    "transformer.adapter.dt_bias": p["recurrence"]["inject"]["dt"],
    "transformer.adapter.B": p["recurrence"]["inject"]["B"]["kernel"].T,
  }
  if cfg.prelude_norm:
    out["transformer.ln_prelude.weight"] = p["prelude_norm"]["scale"]
  for layer, (name, (_, block)) in enumerate(zip(_module_names(cfg), _blocks(p, cfg))):
    attn = block["attn"]
    out.update(
      {
        f"{name}.norm_1.weight": block["attn_norm"]["scale"],
        f"{name}.attn.c_q.weight": rows(attn["query"]["kernel"])[:, inv].reshape(n * h, d),
        f"{name}.attn.c_k.weight": rows(attn["key"]["kernel"])[:, inv].reshape(n * h, d),
        f"{name}.attn.c_v.weight": rows(attn["value"]["kernel"]).reshape(n * h, d),
        f"{name}.attn.c_proj.weight": attn["out"]["kernel"].reshape(n * h, d).T,
        f"{name}.norm_2.weight": block["mlp_norm"]["scale"],
        f"{name}.mlp.fc.weight": block["mlp"]["up"]["kernel"].T,
        f"{name}.mlp.proj.weight": 2 * block["mlp"]["down"]["kernel"].T,  # relu^2 / 2 unfolded
      }
    )
    if "value_embed" in attn:
      out[f"{name}.attn.ve_gate.weight"] = attn["value_embed"]["gate"]["kernel"].T
      out[f"value_embeds.{layer}.weight"] = attn["value_embed"]["table"].reshape(-1, n * h)
  expected, _ = parcae.expected_shapes(hf)
  for name, shape in expected.items():  # Parcae's tables and gates the model has not: zeros.
    if name not in out and (name.startswith("value_embeds.") or name.endswith(".ve_gate.weight")):
      out[name] = np.zeros(shape, np.float32)
  out = {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
  for name in sorted(expected.keys() | out.keys()):  # A mapping bug fails here, not in torch.
    got = out[name].shape if name in out else None
    if got != (tuple(expected[name]) if name in expected else None):
      raise ValueError(f"exported {name}: shape {got}, Parcae's {expected.get(name)}")
  return out


def jax_free(tree):
  """The params as float32 numpy arrays (bfloat16 params widen exactly)."""
  if isinstance(tree, dict):
    return {k: jax_free(v) for k, v in tree.items()}
  return np.asarray(tree, np.float32)
