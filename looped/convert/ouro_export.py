"""LoopedLM -> Ouro (`OuroForCausalLM`): the inverse of ouro.py's mapping.

`check(cfg)` refuses, one line naming the model field, what Ouro's public code cannot compute:
a prelude or coda (Ouro loops its whole stack), an injection other than none, h_0 other than the
embeddings, another MLP, mixer, block norm or core-output norm; no exit gate (Ouro's forward
reads early_exit_gate at every step); a prelude norm, QK-norm, QK bias, core_out_proj or value
embeddings; an embedding scale other than 1; a stored RoPE table (Ouro computes its angles from
rope_theta); a norm epsilon other than 1e-6 (what the converter reads back). GQA and any head
width are expressed (num_key_value_heads, head_dim). `to_tensors` inverts ouro.to_params:
kernels back to torch's [out, in] rows; Ouro's RoPE rotates halves, as LoopedLM's, so no row is
permuted.
"""

from __future__ import annotations

import numpy as np

from looped.convert import common, ouro, parcae_export

FAMILY = "Ouro"


def _config(cfg) -> dict:
  """config.json: OuroConfig's fields (the names Ouro's own config.json uses)."""
  return {
    "architectures": list(ouro.ARCHITECTURES),
    "model_type": "ouro",
    "auto_map": {
      "AutoConfig": "configuration_ouro.OuroConfig",
      "AutoModel": "modeling_ouro.OuroModel",
      "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
    },
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.mlp_dim,
    "num_hidden_layers": cfg.num_core_layers,
    "num_attention_heads": cfg.num_heads,
    "num_key_value_heads": cfg.num_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "max_position_embeddings": cfg.max_seq_len,
    "initializer_range": 0.02,
    "rms_norm_eps": cfg.norm_eps,
    "use_cache": True,
    "tie_word_embeddings": cfg.tie_embeddings,
    "rope_theta": cfg.rope_base,
    "rope_scaling": None,
    "use_sliding_window": False,
    "sliding_window": None,
    "layer_types": ["full_attention"] * cfg.num_core_layers,
    "attention_dropout": 0.0,
    "total_ut_steps": cfg.num_recurrences,
    "early_exit_threshold": 1.0,
    "torch_dtype": "float32",
  }


def check(cfg) -> dict:
  """Ouro's config.json for the ModelConfig `cfg`; ConfigError naming the first model field
  Ouro cannot express."""
  required = {
    "num_prelude_layers": (0, "Ouro loops its whole decoder stack (no prelude)"),
    "num_coda_layers": (0, "Ouro loops its whole decoder stack (no coda)"),
    "injection": ("none", "Ouro's recurrence reads h alone"),
    "state_init": ("embed", "Ouro starts the loop from the embeddings"),
    "mlp_type": ("swiglu", "Ouro's MLP is down(silu(gate) * up)"),
    "block_norm": ("sandwich", "Ouro's layers normalize input and output of attention and MLP"),
    "core_out_norm": ("every", "Ouro's model.norm ends every recurrence"),
    "exit_gate": (True, "Ouro's forward reads its early-exit gate at every recurrence"),
    "prelude_norm": (False, "Ouro has no norm on the embeddings"),
    "qk_norm": (False, "Ouro has no QK-norm"),
    "qk_bias": (False, "Ouro's attention has no bias"),
    "core_out_proj": (False, "Ouro has no map of h_R"),
    "value_embed_layers": ((), "Ouro has no value embeddings"),
    "embed_scale": (1.0, "Ouro does not scale its embeddings"),
    "rope_table": (False, "Ouro computes RoPE from rope_theta and stores no table"),
    "norm_eps": (1e-6, "Ouro's converter reads RMSNorm epsilon 1e-6 only"),
  }
  common.require_fields(cfg, FAMILY, required)
  return _config(cfg)


def check_params(params: dict, cfg) -> None:
  """Nothing to refuse after the restore: every Ouro-expressible param maps."""
  del params, cfg


_NORMS = {ours: theirs for theirs, ours in ouro._NORMS.items()}


def to_tensors(params: dict, cfg, hf: dict) -> dict[str, np.ndarray]:
  """Ouro's state dict (float32 numpy, torch's [out, in] layout) for the params of `cfg`, for
  config.json `hf` (check(cfg)); every tensor ouro.expected_shapes lists."""
  p = parcae_export.jax_free(params["params"])
  d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  rec = p["recurrence"]
  out = {
    "model.embed_tokens.weight": p["embed"]["embedding"],
    "model.norm.weight": rec["out_norm"]["scale"],
    "model.early_exit_gate.weight": rec["exit_gate"]["kernel"].T,
    "model.early_exit_gate.bias": rec["exit_gate_bias"],
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = p["head"]["kernel"].T
  for i in range(cfg.num_core_layers):
    pre, layer = f"model.layers.{i}", rec[f"layer_{i}"]
    attn, mlp = layer["attn"], layer["mlp"]
    out.update({f"{pre}.{theirs}.weight": layer[ours]["scale"] for ours, theirs in _NORMS.items()})
    out.update(
      {
        f"{pre}.self_attn.q_proj.weight": common.torch_rows(attn["query"]["kernel"]).reshape(
          n * h, d
        ),
        f"{pre}.self_attn.k_proj.weight": common.torch_rows(attn["key"]["kernel"]).reshape(
          k * h, d
        ),
        f"{pre}.self_attn.v_proj.weight": common.torch_rows(attn["value"]["kernel"]).reshape(
          k * h, d
        ),
        f"{pre}.self_attn.o_proj.weight": attn["out"]["kernel"].reshape(n * h, d).T,
        f"{pre}.mlp.gate_proj.weight": mlp["gate"]["kernel"].T,
        f"{pre}.mlp.up_proj.weight": mlp["up"]["kernel"].T,
        f"{pre}.mlp.down_proj.weight": mlp["down"]["kernel"].T,
      }
    )
  out = {name: np.ascontiguousarray(x, np.float32) for name, x in out.items()}
  expected, _ = ouro.expected_shapes(hf)
  common.check_export_shapes(FAMILY, out, expected)
  return out
