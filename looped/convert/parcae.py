"""Parcae (`_class_name: ParcaeConfig` in config.json; weights in pytorch_model.bin) -> LoopedLM:
recognised, checked, and refused for now in one line naming what LoopedLM lacks.

What Parcae's public code computes (prelude / recurrent core / coda, diagonal injection):

    e = ln_prelude(prelude(wte(tokens) * embed_scale))       ln_prelude if prelude_norm
    h_0 ~ trunc-normal (state_init 'like-init'), width recurrent_embedding_dimension
    h_r = core(exp(-softplus(dt) exp(A_log)) h_(r-1) + softplus(dt) e B^T)
    logits = lm_head(ln_f(coda(C h_R))) * logit_scale

Blocks are pre-norm (RMSNorm with weight, eps norm_eps), attention applies RoPE to interleaved
pairs then a weightless RMSNorm to q and k (qk_norm), the MLP is fc -> relu(x)^2 / 2 -> proj. Every
Parcae model also has value embeddings: per-layer token tables (`value_embeds.<layer>`) added to
the attention values through a gate `2 sigmoid(ve_gate(x[..., :32]))` (on layers that have both).
`from_pretrained` drops config.json's rope_settings, so the model runs at RoPE base 50000
whatever the file says; it loads with strict=False.

LoopedLM has the diagonal injection, prelude norm, QK-norm, relu2 MLP and tied head, but not
value embeddings, the projection C of the core output, Parcae's RMSNorm epsilon (1e-5), nor a
core narrower or wider than the embedding: `model_config` refuses those in one line, after
refusing the variants no released model uses, each naming its config.json field.
`expected_shapes` is the exact tensor list the public code saves (checked against a folder that
code wrote, tests/testdata/parcae_tiny), ready for the mapping once LoopedLM has those parts.
"""

from __future__ import annotations

from looped import config_checks as cc
from looped.convert import common

ARCHITECTURES = ("ParcaeConfig",)
CONVERTS = False  # Recognised, not yet convertible: not listed among the supported families.
_IGNORED = ("freqs_cis",)  # The RoPE table buffer (recomputed).
_VE_GATE_CHANNELS = 32  # The public code's ve_gate input width (x[..., :32]).


def _has_ve(layer: int, n_layer: int) -> bool:
  """The public code's rule: alternate layers, the last one always."""
  return layer % 2 == (n_layer - 1) % 2


def _sizes(hf: dict) -> dict:
  d = common.field(hf, "n_embd", int)
  n = common.field(hf, "num_attention_heads", int)
  v = common.field(hf, "vocab_size", int)
  multiple = common.field(hf, "padding_multiple", int, default=512)
  padded = hf.get("padded_vocab_size") or -(-v // multiple) * multiple
  nr = hf.get("recurrent_num_attention_heads") or n
  return {
    "V": int(padded),
    "D": d,
    "N": n,
    "K": hf.get("num_key_value_heads") or n,
    "H": d // n,
    "F": common.field(hf, "intermediate_size", int),
    "Dr": common.field(hf, "recurrent_embedding_dimension", int, default=1024),
    "Fr": common.field(hf, "recurrent_intermediation_embedding_dimension", int, default=3520),
    "Nr": int(nr),
    "P": common.field(hf, "n_layers_in_prelude", int, default=1),
    "B": common.field(hf, "n_layers_in_recurrent_block", int, default=4),
    "C": common.field(hf, "n_layers_in_coda", int, default=1),
    "R": common.field(hf, "mean_recurrence", int, default=32),
    "S": common.field(hf, "mean_backprop_depth", int, default=8),
  }


def _block(prefix: str, d: int, n: int, k: int, f: int, gate: bool, hf: dict) -> dict:
  h = d // n
  out = {
    f"{prefix}.norm_1.weight": (d,),
    f"{prefix}.attn.c_q.weight": (n * h, d),
    f"{prefix}.attn.c_k.weight": (k * h, d),
    f"{prefix}.attn.c_v.weight": (k * h, d),
    f"{prefix}.attn.c_proj.weight": (d, d),
    f"{prefix}.norm_2.weight": (d,),
    f"{prefix}.mlp.fc.weight": (f, d),
    f"{prefix}.mlp.proj.weight": (d, f),
  }
  if hf.get("bias", False):
    out.update(
      {
        f"{prefix}.attn.c_q.bias": (n * h,),
        f"{prefix}.attn.c_k.bias": (k * h,),
        f"{prefix}.attn.c_v.bias": (k * h,),
        f"{prefix}.attn.c_proj.bias": (d,),
        f"{prefix}.mlp.fc.bias": (f,),
        f"{prefix}.mlp.proj.bias": (d,),
      }
    )
  if hf.get("qk_bias", False):
    out[f"{prefix}.attn.qk_bias"] = (2, 1, n, h)
  if gate:
    out[f"{prefix}.attn.ve_gate.weight"] = (k, _VE_GATE_CHANNELS)
  return out


def expected_shapes(hf: dict) -> tuple[dict, tuple[str, ...]]:
  """Every tensor Parcae's state_dict holds for this config.json, with its shape."""
  s = _sizes(hf)
  d, dr = s["D"], s["Dr"]
  n_layer = s["B"] * s["S"]  # What the public code's ve_gate rule counts (not the depth).
  coda0 = s["P"] + s["B"] * s["R"]
  out = {"transformer.wte.weight": (s["V"], d), "lm_head.weight": (s["V"], d)}
  for i in range(s["P"]):
    out.update(
      _block(f"transformer.prelude.{i}", d, s["N"], s["K"], s["F"], _has_ve(i, n_layer), hf)
    )
  for i in range(s["B"]):
    gate = _has_ve(s["P"] + i, n_layer)
    out.update(_block(f"transformer.core_block.{i}", dr, s["Nr"], s["Nr"], s["Fr"], gate, hf))
  for i in range(s["C"]):
    gate = _has_ve(coda0 + i, n_layer)
    out.update(_block(f"transformer.coda.{i}", d, s["N"], s["K"], s["F"], gate, hf))
  injection = hf.get("injection_type", "diagonal")
  if injection == "diagonal":
    out.update(
      {
        "transformer.adapter.A_log": (dr,),
        "transformer.adapter.dt_bias": (dr,),
        "transformer.adapter.B": (dr, d),
      }
    )
  elif injection == "linear":
    out["transformer.adapter.adapter.weight"] = (dr, dr + d)
    if hf.get("bias", False):
      out["transformer.adapter.adapter.bias"] = (dr,)
  out["transformer.C.weight"] = (d, dr)
  if hf.get("bias", False):
    out["transformer.C.bias"] = (d,)
  out["transformer.ln_f.weight"] = (d,)
  if hf.get("prelude_norm", False):
    out["transformer.ln_prelude.weight"] = (d,)
  layers = s["P"] + s["B"] + s["C"]
  for i in range(layers):  # Outer key/value width for every layer, the core's included.
    if _has_ve(i, layers):
      out[f"value_embeds.{i}.weight"] = (s["V"], s["K"] * s["H"])
  return out, _IGNORED


# config.json fields whose other values no released Parcae uses: field -> (value, why).
_REQUIRED = {
  "block_class_name": ("TransformerPreNormBlock", "the pre-norm block"),
  "norm_class_name": ("RMSNorm", "RMSNorm"),
  "mlp_class_name": ("BaseMLP", "fc -> nonlin -> proj"),
  "nonlin_name": ("ReLU2", "relu(x)^2 / 2"),
  "injection_type": ("diagonal", "LoopedLM's injection='diagonal'"),
  "clip_qkv": (None, "no clipping"),
  "logit_softcap": (None, "no softcap"),
  "use_abacus": (False, "RoPE positions"),
  "bias": (False, "bias-free linears"),
  "qk_bias": (False, "no QK bias"),
}
_INIT_STRATEGIES = ("scaled", "scaled-zero")  # embed_scale = logit_scale = 1 in the public code.


def model_config(hf: dict) -> dict:
  """ConfigError: the first unsupported variant field, else what LoopedLM lacks for every
  Parcae (value embeddings, the projection C, its norm epsilon), in one line."""
  for name, (value, what) in _REQUIRED.items():
    got = hf.get(name, value)
    if got != value:
      common.unsupported(name, got, f"supported: {value!r} ({what})")
  strategy = hf.get("init_strategy", "scaled")
  if strategy not in _INIT_STRATEGIES:
    common.unsupported(
      "init_strategy",
      strategy,
      f"it sets the embedding and logit scales; supported: {', '.join(_INIT_STRATEGIES)}",
    )
  s = _sizes(hf)
  if s["Dr"] != s["D"]:
    common.unsupported(
      "recurrent_embedding_dimension", s["Dr"], f"LoopedLM's core has the width n_embd = {s['D']}"
    )
  if s["Nr"] != s["N"] or s["K"] != s["N"]:
    common.unsupported(
      "recurrent_num_attention_heads",
      hf.get("recurrent_num_attention_heads"),
      f"the core has {s['Nr']} heads (key/value heads too) and the other layers "
      f"{s['N']} / {s['K']}; LoopedLM's layers share one head layout",
    )
  if s["Fr"] != s["F"]:
    common.unsupported(
      "recurrent_intermediation_embedding_dimension",
      s["Fr"],
      f"LoopedLM's layers share one MLP width (intermediate_size = {s['F']})",
    )
  raise cc.ConfigError(
    "config.json _class_name = 'ParcaeConfig' is recognised but not convertible yet: LoopedLM "
    "lacks Parcae's value embeddings (value_embeds.*, gated into attention values by "
    "attn.ve_gate), the projection of the core output before the coda (transformer.C) and its "
    f"RMSNorm epsilon (norm_eps = {hf.get('norm_eps', 1e-5)!r}; LoopedLM's is 1e-06)."
  )
