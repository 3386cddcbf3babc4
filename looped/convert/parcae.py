"""Parcae (`_class_name: ParcaeConfig` in config.json; weights in pytorch_model.bin) -> LoopedLM.

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

It maps onto LoopedLM with injection='diagonal' (A_log, dt = dt_bias, B), mlp_type='relu2' (the
1/2 folded into `proj`), value_embed_layers (the layers that have both a table and a gate),
core_out_proj (C), norm_eps = norm_eps, and qk_norm_eps = float32's machine epsilon (torch's
rms_norm default). The query and key rows are permuted from interleaved RoPE pairs
(2i, 2i+1) to LoopedLM's halves (i, i + H/2), which leaves every score unchanged; a weightless
norm commutes with RoPE (a rotation keeps the norm), so LoopedLM's QK-norm before RoPE, with
scale 1, is Parcae's after it. h_0: state_init 'like-init' is LoopedLM's like_init with Parcae's
std sqrt(2 / 5D) (untruncated noise from LoopedLM's own generator, so runs that use it differ
from the reference's draw), 'zero' is zeros. A core whose width, heads or MLP width differ from
the outer layers' is refused in one line naming its config.json field, as are the variants no
released model uses. `expected_shapes` is the exact tensor list the public code saves (checked
against a folder that code wrote, tests/testdata/parcae_tiny).
"""

from __future__ import annotations

import math

import numpy as np

from looped.convert import common

ARCHITECTURES = ("ParcaeConfig",)
_IGNORED = ("freqs_cis",)  # The RoPE table buffer (recomputed).
_VE_GATE_CHANNELS = 32  # The public code's ve_gate input width (x[..., :32]).
_ROPE_BASE = 50_000.0  # from_pretrained drops rope_settings: RoPESettings' default base.
_QK_NORM_EPS = float(np.finfo(np.float32).eps)  # torch rms_norm's eps=None on float32.
_STATE_INITS = {"like-init": "like_init", "zero": "zeros"}


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
# The keys a Parcae config.json may hold: the fields of the public code's ParcaeConfig dataclass
# (parcae_lm/models/config.py's Config and parcae_lm/models/parcae/config.py) and `_class_name`,
# which its from_pretrained pops; it passes every other key to ParcaeConfig(**config), which
# refuses it.
CONFIG_KEYS = frozenset(
  {
    "_class_name",
    "_is_recurrent_block_config",
    "activation_checkpoint_impl",
    "attn_impl",
    "bias",
    "block_class_name",
    "block_size",
    "center_attention",
    "clip_qkv",
    "curriculum_target",
    "debias_attention",
    "hf_config",
    "init_orthogonal",
    "init_strategy",
    "injection_type",
    "intermediate_size",
    "lockstep_k",
    "lockstep_n",
    "logit_softcap",
    "mean_backprop_depth",
    "mean_recurrence",
    "mlp_class_name",
    "model_class_name",
    "mup_model_scaling_factor",
    "n_embd",
    "n_layers_in_coda",
    "n_layers_in_prelude",
    "n_layers_in_recurrent_block",
    "name",
    "nonlin_name",
    "norm_class_name",
    "norm_eps",
    "num_attention_heads",
    "num_key_value_heads",
    "padded_vocab_size",
    "padding_multiple",
    "prelude_norm",
    "qk_bias",
    "qk_norm",
    "randomize_positions_from",
    "recurrent_embedding_dimension",
    "recurrent_intermediation_embedding_dimension",
    "recurrent_iteration_method",
    "recurrent_num_attention_heads",
    "rope_settings",
    "sampling_scheme",
    "simple_ops",
    "skip_initialization",
    "state_init",
    "strategy",
    "tie_embeddings",
    "use_abacus",
    "use_fused_head",
    "vocab_size",
  }
)


def value_embed_layers(hf: dict) -> tuple[int, ...]:
  """LoopedLM layer numbers (prelude, core, coda from 0) where Parcae adds a value embedding:
  those with both a table (`value_embeds.<layer>`, by distinct layer) and a gate (`ve_gate`, by
  the public code's layer id over n_layer); a table or gate alone is never used."""
  s = _sizes(hf)
  distinct = s["P"] + s["B"] + s["C"]
  n_layer = s["B"] * s["S"]
  ids = list(range(s["P"] + s["B"]))  # Prelude and core layer ids are their numbers.
  ids += [s["P"] + s["B"] * s["R"] + i for i in range(s["C"])]
  return tuple(
    g for g, layer_id in enumerate(ids) if _has_ve(g, distinct) and _has_ve(layer_id, n_layer)
  )


def model_config(hf: dict) -> dict:
  """LoopedLM fields of a Parcae config.json; ConfigError naming the first field it cannot
  express, or the first key ParcaeConfig does not have (Parcae's own loaders refuse it)."""
  unknown = sorted(set(hf) - CONFIG_KEYS)
  if unknown:
    common.unsupported(
      unknown[0],
      hf[unknown[0]],
      "ParcaeConfig has no such field, so Parcae's from_pretrained refuses this config.json",
    )
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
  state_init = hf.get("state_init", "like-init")
  if state_init not in _STATE_INITS:
    common.unsupported("state_init", state_init, f"supported: {', '.join(_STATE_INITS)}")
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
  if s["D"] % s["N"] or s["H"] % 2:
    common.unsupported("n_embd", s["D"], f"needs an even head width n_embd / {s['N']} heads")
  layers = value_embed_layers(hf)
  if layers and s["D"] < _VE_GATE_CHANNELS:
    common.unsupported("n_embd", s["D"], f"the value-embedding gate reads {_VE_GATE_CHANNELS}")
  return {
    **common.widths(s),
    "mlp_type": "relu2",  # Parcae's relu(x)^2 / 2, its 1/2 folded into the down projection.
    "num_prelude_layers": s["P"],
    "num_core_layers": s["B"],
    "num_coda_layers": s["C"],
    "num_recurrences": s["R"],
    "injection": "diagonal",
    "state_init": _STATE_INITS[state_init],
    "state_init_std": math.sqrt(2 / (5 * s["D"])),
    "prelude_norm": bool(hf.get("prelude_norm", False)),
    "qk_norm": bool(hf.get("qk_norm", False)),
    "qk_bias": False,
    "rope_base": _ROPE_BASE,
    "tie_embeddings": bool(hf.get("tie_embeddings", False)),
    "max_seq_len": common.field(hf, "block_size", int, default=4096),
    "block_norm": "pre",
    "embed_scale": 1.0,
    "core_out_norm": "none",
    "exit_gate": False,
    "norm_eps": common.field(hf, "norm_eps", float, default=1e-5),
    "qk_norm_eps": _QK_NORM_EPS,
    "value_embed_layers": layers,
    "value_embed_gate_dim": _VE_GATE_CHANNELS,
    "core_out_proj": True,
    "prelude_mixers": ("gqa",),
    "core_mixers": ("gqa",),
    "coda_mixers": ("gqa",),
  }


def _half_rotation(h: int) -> np.ndarray:
  """Permutation of a head's rows taking interleaved RoPE pairs (2i, 2i+1) to (i, i + h/2)."""
  return np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])


def _block_params(t: dict, prefix: str, table: str | None, s: dict, qk_norm: bool) -> dict:
  d, n, k, h = s["D"], s["N"], s["K"], s["H"]
  perm = _half_rotation(h)
  heads = lambda w, m: w.reshape(m, h, d)  # Rows of a torch Linear: [heads * h, D].
  attn = {
    "query": {"kernel": heads(t[f"{prefix}.attn.c_q.weight"], n)[:, perm].transpose(2, 0, 1)},
    "key": {"kernel": heads(t[f"{prefix}.attn.c_k.weight"], k)[:, perm].transpose(2, 0, 1)},
    "value": {"kernel": heads(t[f"{prefix}.attn.c_v.weight"], k).transpose(2, 0, 1)},
    "out": {"kernel": t[f"{prefix}.attn.c_proj.weight"].T.reshape(n, h, d)},
  }
  if qk_norm:  # Weightless in Parcae.
    attn["query_norm"] = {"scale": np.ones((h,), np.float32)}
    attn["key_norm"] = {"scale": np.ones((h,), np.float32)}
  if table is not None:
    attn["value_embed"] = {
      "table": t[table].reshape(-1, k, h),
      "gate": {"kernel": t[f"{prefix}.attn.ve_gate.weight"].T},
    }
  return {
    "attn_norm": {"scale": t[f"{prefix}.norm_1.weight"]},
    "attn": attn,
    "mlp_norm": {"scale": t[f"{prefix}.norm_2.weight"]},
    "mlp": {  # relu(x)^2 / 2: the 1/2 (exact in binary) goes into the down projection.
      "up": {"kernel": t[f"{prefix}.mlp.fc.weight"].T},
      "down": {"kernel": 0.5 * t[f"{prefix}.mlp.proj.weight"].T},
    },
  }


def to_params(tensors: dict, hf: dict) -> dict:
  """LoopedLM params {'params': ...} (float32 numpy) from the checkpoint's tensors."""
  s = _sizes(hf)
  cfg = model_config(hf)
  t = {name: np.asarray(x, np.float32) for name, x in tensors.items()}
  p: dict = {
    "embed": {"embedding": t["transformer.wte.weight"]},
    "final_norm": {"scale": t["transformer.ln_f.weight"]},
    "core_out": {"kernel": t["transformer.C.weight"].T},
    "recurrence": {
      "inject": {
        "A_log": t["transformer.adapter.A_log"],
        "dt": t["transformer.adapter.dt_bias"],
        "B": {"kernel": t["transformer.adapter.B"].T},
      }
    },
  }
  if cfg["prelude_norm"]:
    p["prelude_norm"] = {"scale": t["transformer.ln_prelude.weight"]}
  stages = (
    ("transformer.prelude", "prelude_{}", s["P"]),
    ("transformer.core_block", "recurrence/layer_{}", s["B"]),
    ("transformer.coda", "coda_{}", s["C"]),
  )
  layer = 0
  for module, scope, count in stages:
    for i in range(count):
      table = f"value_embeds.{layer}.weight" if layer in cfg["value_embed_layers"] else None
      block = _block_params(t, f"{module}.{i}", table, s, cfg["qk_norm"])
      common.put(p, scope.format(i), block)
      layer += 1
  if not cfg["tie_embeddings"]:
    p["head"] = {"kernel": t["lm_head.weight"].T}
  return {"params": p}
