"""LoopedLM -> Huginn (`RavenForCausalLM`): the inverse of huginn.py's mapping.

`check(cfg)` refuses, one line naming the model field, what Huginn's public code cannot compute:
another MLP, injection, mixer, block norm or core-output norm; a prelude norm, QK-norm, exit
gate, core_out_proj or value embeddings; GQA (RavenConfig derives num_key_value_heads =
n_heads); a head width other than d_model / num_heads; an embedding scale other than
sqrt(d_model); h_0 other than Huginn's like-init noise (std sqrt(2 / 5 D) * sqrt(D)) or zeros; a
norm epsilon other than 1e-6 (what the converter reads back). `check_params` refuses per-layer
RoPE tables that differ (Huginn stores one `freqs_cis` buffer). `to_tensors` inverts
huginn.to_params: the query, key and value rows are fused back into Wqkv, the query and key rows
(and qk_bias) go back from halves (i, i + H/2) to interleaved pairs, the SwiGLU gate and up
kernels are fused into fc, kernels are transposed back to torch's [out, in], and the RoPE table
becomes `freqs_cis` (1, block_size, 1, H/2, 2): the model's stored table (model.rope_table), or
the one LoopedLM computes (layers.rope_table at model.rope_base) for a model that computes its
angles, so the public code, which reads the stored buffer, rotates by the model's angles.
"""

from __future__ import annotations

import math

import numpy as np

from looped import config_checks as cc
from looped.convert import common, huginn, parcae_export

FAMILY = "Huginn"


def _config(cfg) -> dict:
  """config.json: RavenConfig's fields (the names Huginn-0125's own config.json uses)."""
  d, n = cfg.d_model, cfg.num_heads
  layers = cfg.num_prelude_layers + cfg.num_core_layers + cfg.num_coda_layers
  return {
    "architectures": list(huginn.ARCHITECTURES),
    "model_type": "huginn_raven",
    "auto_map": {
      "AutoConfig": "raven_config_minimal.RavenConfig",
      "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
    },
    "architecture_class_name": "RecurrentGPT",
    "n_embd": d,
    "n_heads": n,
    "num_attention_heads": n,
    "num_key_value_heads": n,
    "n_layers": layers,
    "n_layers_in_prelude": cfg.num_prelude_layers,
    "n_layers_in_recurrent_block": cfg.num_core_layers,
    "n_layers_in_coda": cfg.num_coda_layers,
    "block_size": cfg.max_seq_len,
    "vocab_size": cfg.vocab_size,
    "padding_multiple": 1,  # vocab_size is the table's size (RavenConfig pads nothing).
    "tie_embeddings": cfg.tie_embeddings,
    "intermediate_size": cfg.mlp_dim,
    "bias": False,
    "qk_bias": cfg.qk_bias,
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "norm_eps": cfg.norm_eps,
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
    "state_init": {"like_init": "like-init", "zeros": "zero"}[cfg.state_init],
    "mean_recurrence": cfg.num_recurrences,
    "mean_backprop_depth": max(1, cfg.num_recurrences // 2),  # Training's sampler only.
    "sampling_scheme": "poisson-lognormal-filling",
    "init_strategy": "takase",
    "init_orthogonal": False,
    "activation_checkpoint_impl": "per-iteration",
    "rope_base": cfg.rope_base,
    "torch_dtype": "float32",
  }


def _std(d: int) -> float:
  return math.sqrt(2 / (5 * d)) * math.sqrt(d)  # huginn.model_config's state_init_std.


def check(cfg) -> dict:
  """Huginn's config.json for the ModelConfig `cfg`; ConfigError naming the first model field
  Huginn cannot express."""
  required = {
    "mlp_type": ("swiglu", "Huginn's MLP is GatedMLP: fc -> silu(gate) * up -> proj"),
    "injection": ("linear", "Huginn's adapter maps [h; e] linearly"),
    "block_norm": ("post", "Huginn's SandwichBlock normalizes each residual sum"),
    "core_out_norm": ("final", "Huginn applies ln_f to h_R before the coda"),
    "prelude_norm": (False, "Huginn has no norm on the prelude's output"),
    "qk_norm": (False, "Huginn has no QK-norm"),
    "exit_gate": (False, "Huginn has no exit gate"),
    "core_out_proj": (False, "Huginn has no map of h_R before the coda"),
    "value_embed_layers": ((), "Huginn has no value embeddings"),
    "embed_scale": (math.sqrt(cfg.d_model), "Huginn scales embeddings by sqrt(n_embd)"),
    "norm_eps": (1e-6, "Huginn's converter reads RMSNorm epsilon 1e-6 only"),
  }
  common.require_fields(cfg, FAMILY, required)
  if cfg.num_kv_heads != cfg.num_heads:
    common.refuse_export(
      FAMILY,
      "num_kv_heads",
      cfg.num_kv_heads,
      f"RavenConfig has as many key/value heads as query heads ({cfg.num_heads})",
    )
  if cfg.head_dim * cfg.num_heads != cfg.d_model:
    common.refuse_export(
      FAMILY,
      "head_dim",
      cfg.head_dim,
      f"Huginn's head width is n_embd / n_heads = {cfg.d_model / cfg.num_heads:g}",
    )
  if cfg.state_init not in ("like_init", "zeros"):
    common.refuse_export(
      FAMILY, "state_init", cfg.state_init, "Huginn starts from like-init noise or zeros"
    )
  std = _std(cfg.d_model)
  if cfg.state_init == "like_init" and not math.isclose(cfg.state_init_std, std, rel_tol=1e-6):
    common.refuse_export(
      FAMILY,
      "state_init_std",
      cfg.state_init_std,
      f"Huginn's like-init std is sqrt(2 / 5 n_embd) * sqrt(n_embd) = {std}",
    )
  return _config(cfg)


def _tables(p: dict, cfg) -> list[tuple[str, np.ndarray]]:
  """(scope, rope_table) of every layer that stores one."""
  return [
    (scope, np.asarray(block["attn"]["rope_table"]))
    for scope, block in parcae_export._blocks(p, cfg)
    if "rope_table" in block["attn"]
  ]


def check_params(params: dict, cfg) -> None:
  """ConfigError naming the first layer whose RoPE table differs from the first layer's (Huginn
  stores one freqs_cis buffer for every layer)."""
  tables = _tables(params["params"], cfg)
  for scope, table in tables[1:]:
    if not np.array_equal(table, tables[0][1]):
      raise cc.ConfigError(
        f"params {scope}/attn/rope_table differs from {tables[0][0]}'s: Huginn stores one RoPE "
        "table (freqs_cis) for every layer, so per-layer tables cannot be exported to Huginn."
      )


def _freqs_cis(p: dict, cfg) -> np.ndarray:
  """(1, block_size, 1, H/2, 2): the stored table, else the one LoopedLM computes."""
  tables = _tables(p, cfg)
  if tables:
    table = tables[0][1]
  else:
    from looped.model import layers

    table = np.asarray(layers.rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_base))
  return table[None, :, None]


def _inverse_half_rotation(h: int) -> np.ndarray:
  """Rows (i, i + h/2) back to interleaved pairs (2i, 2i+1): huginn._half_rotation undone."""
  return np.argsort(huginn._half_rotation(h))


def to_tensors(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
  """Huginn's state dict (float32 numpy, torch's [out, in] layout) for the params of `cfg`, for
  config.json `hf` (check(cfg)); every tensor huginn.expected_shapes lists."""
  p = parcae_export.jax_free(params["params"])
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  inv = _inverse_half_rotation(h)
  rows = common.torch_rows
  out = {
    "transformer.wte.weight": p["embed"]["embedding"],
    "transformer.ln_f.weight": p["final_norm"]["scale"],
    "transformer.adapter.weight": p["recurrence"]["inject"]["linear"]["kernel"].T,
    huginn.ROPE_TABLE: _freqs_cis(p, cfg),
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = p["head"]["kernel"].T
  modules = [f"transformer.prelude.{i}" for i in range(cfg.num_prelude_layers)]
  modules += [f"transformer.core_block.{i}" for i in range(cfg.num_core_layers)]
  modules += [f"transformer.coda.{i}" for i in range(cfg.num_coda_layers)]
  for name, (_, block) in zip(modules, parcae_export._blocks(p, cfg)):
    attn, mlp = block["attn"], block["mlp"]
    q = rows(attn["query"]["kernel"])[:, inv].reshape(n * h, d)
    k = rows(attn["key"]["kernel"])[:, inv].reshape(n * h, d)
    v = rows(attn["value"]["kernel"]).reshape(n * h, d)
    out.update(
      {
        f"{name}.norm_1.weight": block["attn_norm"]["scale"],
        f"{name}.attn.Wqkv.weight": np.concatenate([q, k, v]),
        f"{name}.attn.proj.weight": attn["out"]["kernel"].reshape(n * h, d).T,
        f"{name}.norm_2.weight": block["attn_out_norm"]["scale"],
        f"{name}.norm_3.weight": block["mlp_norm"]["scale"],
        f"{name}.mlp.fc.weight": np.concatenate([mlp["gate"]["kernel"].T, mlp["up"]["kernel"].T]),
        f"{name}.mlp.proj.weight": mlp["down"]["kernel"].T,
        f"{name}.norm_4.weight": block["mlp_out_norm"]["scale"],
      }
    )
    if cfg.qk_bias:
      bias = np.stack([attn["query_bias"][:, inv], attn["key_bias"][:, inv]])
      out[f"{name}.attn.qk_bias"] = bias[:, None]  # (2, 1, heads, H)
  out = {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
  expected, _ = huginn.expected_shapes(hf)
  common.check_export_shapes(FAMILY, out, expected)
  return out
