"""Ouro (`OuroForCausalLM`, looped language models) -> LoopedLM.

    tokens -> embed_tokens -> h_0;  h_r = norm(layers(h_(r-1)))   r = 1..total_ut_steps
    logits_r = lm_head(h_r)    (the model's output is the last recurrence's)

The whole decoder stack is looped: LoopedLM with no prelude and no coda, every layer in the
core, injection='none', state_init='embed' (h_0 = the embeddings), block_norm='sandwich' (each
layer normalizes its attention and MLP outputs before adding them: input_layernorm_2 and
post_attention_layernorm_2), and core_out_norm='every' (model.norm ends every recurrence; the
head reads each h_r, so `looped.model.looped_lm.recurrence_logits` gives every recurrence's
outputs). The early-exit gate (a linear map of h_r to one logit per token) becomes
exit_gate=True. Ouro's RoPE rotates halves, as LoopedLM's: no permutation.
"""

from __future__ import annotations

import math

import numpy as np

from looped.convert import common

ARCHITECTURES = ("OuroForCausalLM",)
# Gates of later Ouro revisions that the forward pass does not use.
_IGNORED = ("lookahead_exit_gate.weight", "lookahead_exit_gate.bias", "preloop_exit_gate.weight")
_IGNORED += ("preloop_exit_gate.bias", "rotary_emb.inv_freq")


def _sizes(hf: dict) -> dict:
  d = common.field(hf, "hidden_size", int)
  n = common.field(hf, "num_attention_heads", int)
  h = hf.get("head_dim") or d // n
  return {
    "D": d,
    "N": n,
    "K": common.field(hf, "num_key_value_heads", int, default=n),
    "H": int(h),
    "F": common.field(hf, "intermediate_size", int),
    "V": common.field(hf, "vocab_size", int),
    "L": common.field(hf, "num_hidden_layers", int),
  }


def _rope_theta(hf: dict) -> float:
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
  if kind != "default":
    common.unsupported("rope_type", kind, "supported: 'default'")
  return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def model_config(hf: dict) -> dict:
  """LoopedLM fields of an Ouro config.json; ConfigError for a variant it cannot express."""
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    common.unsupported("hidden_act", act, "supported: 'silu'")
  eps = common.field(hf, "rms_norm_eps", float, default=1e-6)
  if not math.isclose(eps, 1e-6):
    common.unsupported("rms_norm_eps", eps, "supported: 1e-06 (LoopedLM's RMSNorm epsilon)")
  types = hf.get("layer_types") or []
  if hf.get("use_sliding_window") or any(t != "full_attention" for t in types):
    common.unsupported("use_sliding_window", True, "sliding-window layers are not supported")
  if hf.get("attention_bias"):
    common.unsupported("attention_bias", True, "supported: false")
  s = _sizes(hf)
  if s["N"] % s["K"]:
    common.unsupported("num_key_value_heads", s["K"], f"must divide num_attention_heads {s['N']}")
  if s["H"] % 2:
    common.unsupported("head_dim", s["H"], "must be even (RoPE rotates pairs)")
  return {
    **common.widths(s),
    "num_prelude_layers": 0,
    "num_core_layers": s["L"],
    "num_coda_layers": 0,
    "num_recurrences": common.field(hf, "total_ut_steps", int, default=4),
    "injection": "none",
    "state_init": "embed",
    "prelude_norm": False,
    "qk_norm": False,
    "qk_bias": False,
    "rope_base": _rope_theta(hf),
    "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    "max_seq_len": common.field(hf, "max_position_embeddings", int, default=4096),
    "block_norm": "sandwich",
    "embed_scale": 1.0,
    "core_out_norm": "every",
    "exit_gate": True,
    "prelude_mixers": ("gqa",),
    "core_mixers": ("gqa",),
    "coda_mixers": ("gqa",),
  }


_NORMS = {
  "input_layernorm": "attn_norm",
  "input_layernorm_2": "attn_out_norm",
  "post_attention_layernorm": "mlp_norm",
  "post_attention_layernorm_2": "mlp_out_norm",
}


def expected_shapes(hf: dict) -> tuple[dict, tuple[str, ...]]:
  """({tensor name: shape} the checkpoint must hold, names it may hold and are not used)."""
  s = _sizes(hf)
  cfg = model_config(hf)
  d, n, k, h, f = s["D"], s["N"], s["K"], s["H"], s["F"]
  shapes = {
    "model.embed_tokens.weight": (s["V"], d),
    "model.norm.weight": (d,),
    "model.early_exit_gate.weight": (1, d),
    "model.early_exit_gate.bias": (1,),
  }
  for i in range(s["L"]):
    pre = f"model.layers.{i}"
    shapes.update({f"{pre}.{norm}.weight": (d,) for norm in _NORMS})
    shapes[f"{pre}.self_attn.q_proj.weight"] = (n * h, d)
    shapes[f"{pre}.self_attn.k_proj.weight"] = (k * h, d)
    shapes[f"{pre}.self_attn.v_proj.weight"] = (k * h, d)
    shapes[f"{pre}.self_attn.o_proj.weight"] = (d, n * h)
    shapes[f"{pre}.mlp.gate_proj.weight"] = (f, d)
    shapes[f"{pre}.mlp.up_proj.weight"] = (f, d)
    shapes[f"{pre}.mlp.down_proj.weight"] = (d, f)
  optional = _IGNORED
  if cfg["tie_embeddings"]:
    optional += ("lm_head.weight",)
  else:
    shapes["lm_head.weight"] = (s["V"], d)
  return shapes, optional


def to_params(tensors: dict, hf: dict) -> dict:
  """LoopedLM params {'params': ...} (float32 numpy) from the checkpoint's tensors."""
  s = _sizes(hf)
  cfg = model_config(hf)
  d, n, k, h = s["D"], s["N"], s["K"], s["H"]
  t = {name: np.asarray(x, np.float32) for name, x in tensors.items()}
  heads = lambda w, m: w.reshape(m, h, d).transpose(2, 0, 1)  # [m * h, D] rows -> [D, m, h].
  recurrence: dict = {
    "out_norm": {"scale": t["model.norm.weight"]},
    "exit_gate": {"kernel": t["model.early_exit_gate.weight"].T},
    "exit_gate_bias": t["model.early_exit_gate.bias"],
  }
  for i in range(s["L"]):
    pre = f"model.layers.{i}"
    layer = {ours: {"scale": t[f"{pre}.{theirs}.weight"]} for theirs, ours in _NORMS.items()}
    layer["attn"] = {
      "query": {"kernel": heads(t[f"{pre}.self_attn.q_proj.weight"], n)},
      "key": {"kernel": heads(t[f"{pre}.self_attn.k_proj.weight"], k)},
      "value": {"kernel": heads(t[f"{pre}.self_attn.v_proj.weight"], k)},
      "out": {"kernel": t[f"{pre}.self_attn.o_proj.weight"].T.reshape(n, h, d)},
    }
    layer["mlp"] = {
      "gate": {"kernel": t[f"{pre}.mlp.gate_proj.weight"].T},
      "up": {"kernel": t[f"{pre}.mlp.up_proj.weight"].T},
      "down": {"kernel": t[f"{pre}.mlp.down_proj.weight"].T},
    }
    recurrence[f"layer_{i}"] = layer
  p = {"embed": {"embedding": t["model.embed_tokens.weight"]}, "recurrence": recurrence}
  if not cfg["tie_embeddings"]:
    p["head"] = {"kernel": t["lm_head.weight"].T}
  return {"params": p}
