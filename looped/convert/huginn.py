"""Huginn-0125 (`RavenForCausalLM`, recurrent-depth "raven" models) -> LoopedLM.

    tokens -> wte * sqrt(D) -> prelude (SandwichBlocks) -> e;  h_0 = noise
    h_r = core_block(adapter([h_(r-1); e]))       r = 1..mean_recurrence
    -> ln_f(h_R) -> coda (SandwichBlocks) -> ln_f -> lm_head

maps onto LoopedLM with block_norm='post' (a SandwichBlock normalizes each residual sum:
x = n2(x + attn(n1(x))), x = n4(x + mlp(n3(x)))), injection='linear' (the adapter over
[h; e]), embed_scale = sqrt(D), core_out_norm='final' (ln_f applied to h_R too), qk_bias,
no prelude norm, no QK-norm. The fused Wqkv and fc weights are split; Huginn's RoPE rotates
interleaved pairs (2i, 2i+1), LoopedLM rotates halves (i, i + H/2): the query and key rows
(and their biases) are permuted accordingly, which leaves every attention score unchanged.
The reference reads RoPE's cos/sin from its stored `freqs_cis` buffer (rounded to bfloat16 in a
bfloat16 checkpoint), so the converted model does too (rope_table, every attention layer); the
pair order does not change the table (pair i is (2i, 2i+1) there, (i, i + H/2) here).
Huginn starts the recurrence from truncated-normal noise of std sqrt(2 / 5D) * sqrt(D); the
converted model uses state_init='like_init' with that std (untruncated noise from its own
generator, so sampled runs differ from the reference's), or zeros for state_init 'zero'.
"""

from __future__ import annotations

import math

import numpy as np

from looped.convert import common

ARCHITECTURES = ("RavenForCausalLM",)
ROPE_TABLE = "freqs_cis"  # RoPE cos/sin buffer (1, block_size, 1, H/2, 2), read as stored.
_SUPPORTED = {
  "block_class_name": ("SandwichBlock",),
  "mlp_class_name": ("GatedMLP",),
  "nonlin_name": ("SiLU",),
  "injection_type": ("linear",),
  "norm_class_name": ("RMSNorm_llama",),
  "state_init": ("like-init", "zero"),
  "bias": (False,),
}


def _sizes(hf: dict) -> dict:
  d = common.field(hf, "n_embd", int, alias="hidden_size")
  n = common.field(hf, "num_attention_heads", int, alias="n_heads")
  k = common.field(hf, "num_key_value_heads", int, default=n)
  if d % n:
    common.unsupported("n_embd", d, f"must be a multiple of num_attention_heads = {n}")
  return {
    "D": d,
    "N": n,
    "K": k,
    "H": d // n,
    "F": common.field(hf, "intermediate_size", int),
    "V": common.field(hf, "padded_vocab_size", int, default=common.field(hf, "vocab_size", int)),
    "P": common.field(hf, "n_layers_in_prelude", int),
    "B": common.field(hf, "n_layers_in_recurrent_block", int),
    "C": common.field(hf, "n_layers_in_coda", int),
  }


def model_config(hf: dict) -> dict:
  """LoopedLM fields of a Huginn config.json; ConfigError for a variant it cannot express."""
  for name, allowed in _SUPPORTED.items():
    value = hf.get(name, allowed[0])
    if value not in allowed:
      common.unsupported(name, value, f"supported: {', '.join(repr(a) for a in allowed)}")
  eps = common.field(hf, "norm_eps", float, default=1e-6)
  if not math.isclose(eps, 1e-6):
    common.unsupported("norm_eps", eps, "supported: 1e-06 (LoopedLM's RMSNorm epsilon)")
  s = _sizes(hf)
  if s["K"] != s["N"]:
    common.unsupported("num_key_value_heads", s["K"], f"must equal num_attention_heads {s['N']}")
  if s["H"] % 2:
    common.unsupported("n_embd", s["D"], "gives an odd head width (RoPE rotates pairs)")
  zero = hf.get("state_init", "like-init") == "zero"
  return {
    **common.widths(s),
    "num_prelude_layers": s["P"],
    "num_core_layers": s["B"],
    "num_coda_layers": s["C"],
    "num_recurrences": common.field(hf, "mean_recurrence", int),
    "injection": "linear",
    "state_init": "zeros" if zero else "like_init",
    "state_init_std": math.sqrt(2 / (5 * s["D"])) * math.sqrt(s["D"]),
    "prelude_norm": False,
    "qk_norm": False,
    "qk_bias": bool(hf.get("qk_bias", True)),
    "rope_base": float(common.field(hf, "rope_base", float, default=50_000.0)),
    "rope_table": True,
    "tie_embeddings": bool(hf.get("tie_embeddings", hf.get("tie_word_embeddings", True))),
    "max_seq_len": common.field(hf, "block_size", int, default=4096),
    "block_norm": "post",
    "embed_scale": math.sqrt(s["D"]),
    "core_out_norm": "final",
    "prelude_mixers": ("gqa",),
    "core_mixers": ("gqa",),
    "coda_mixers": ("gqa",),
  }


def _block_shapes(prefix: str, s: dict, qk_bias: bool) -> dict:
  d, n, k, h, f = s["D"], s["N"], s["K"], s["H"], s["F"]
  shapes = {
    f"{prefix}.norm_1.weight": (d,),
    f"{prefix}.attn.Wqkv.weight": ((n + 2 * k) * h, d),
    f"{prefix}.attn.proj.weight": (d, n * h),
    f"{prefix}.norm_2.weight": (d,),
    f"{prefix}.mlp.fc.weight": (2 * f, d),
    f"{prefix}.mlp.proj.weight": (d, f),
    f"{prefix}.norm_3.weight": (d,),
    f"{prefix}.norm_4.weight": (d,),
  }
  if qk_bias:
    shapes[f"{prefix}.attn.qk_bias"] = (2, 1, n, h)
  return shapes


def _stages(s: dict):
  """(Huginn module list, LoopedLM scope, count) of the three stages."""
  return (
    ("transformer.prelude", "prelude_{}", s["P"]),
    ("transformer.core_block", "recurrence/layer_{}", s["B"]),
    ("transformer.coda", "coda_{}", s["C"]),
  )


def expected_shapes(hf: dict) -> tuple[dict, tuple[str, ...]]:
  """({tensor name: shape} the checkpoint must hold, names it may hold and are not used)."""
  s = _sizes(hf)
  cfg = model_config(hf)
  shapes = {"transformer.wte.weight": (s["V"], s["D"]), "transformer.ln_f.weight": (s["D"],)}
  shapes[ROPE_TABLE] = (1, cfg["max_seq_len"], 1, s["H"] // 2, 2)
  shapes["transformer.adapter.weight"] = (s["D"], 2 * s["D"])
  for module, _, count in _stages(s):
    for i in range(count):
      shapes.update(_block_shapes(f"{module}.{i}", s, cfg["qk_bias"]))
  optional = ()
  if cfg["tie_embeddings"]:
    optional += ("lm_head.weight",)  # Tied: saved or not, the embedding is used.
  else:
    shapes["lm_head.weight"] = (s["V"], s["D"])
  return shapes, optional


def _half_rotation(h: int) -> np.ndarray:
  """Permutation of a head's rows taking interleaved RoPE pairs (2i, 2i+1) to (i, i + h/2)."""
  return np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])


def _block_params(t: dict, prefix: str, s: dict, qk_bias: bool, table: np.ndarray) -> dict:
  d, n, k, h, f = s["D"], s["N"], s["K"], s["H"], s["F"]
  perm = _half_rotation(h)
  wqkv = t[f"{prefix}.attn.Wqkv.weight"]
  q, kk, v = np.split(wqkv, [n * h, (n + k) * h], axis=0)
  heads = lambda w, m: w.reshape(m, h, d)  # Rows of a torch Linear: [heads * h, D].
  attn = {
    "query": {"kernel": heads(q, n)[:, perm].transpose(2, 0, 1)},
    "key": {"kernel": heads(kk, k)[:, perm].transpose(2, 0, 1)},
    "value": {"kernel": heads(v, k).transpose(2, 0, 1)},
    "out": {"kernel": t[f"{prefix}.attn.proj.weight"].T.reshape(n, h, d)},
    "rope_table": table,
  }
  if qk_bias:
    bias = t[f"{prefix}.attn.qk_bias"]
    attn["query_bias"] = bias[0, 0][:, perm]
    attn["key_bias"] = bias[1, 0][:, perm]
  fc = t[f"{prefix}.mlp.fc.weight"]
  return {
    "attn_norm": {"scale": t[f"{prefix}.norm_1.weight"]},
    "attn": attn,
    "attn_out_norm": {"scale": t[f"{prefix}.norm_2.weight"]},
    "mlp_norm": {"scale": t[f"{prefix}.norm_3.weight"]},
    "mlp": {
      "gate": {"kernel": fc[:f].T},
      "up": {"kernel": fc[f:].T},
      "down": {"kernel": t[f"{prefix}.mlp.proj.weight"].T},
    },
    "mlp_out_norm": {"scale": t[f"{prefix}.norm_4.weight"]},
  }


def to_params(tensors: dict, hf: dict) -> dict:
  """LoopedLM params {'params': ...} (float32 numpy) from the checkpoint's tensors."""
  s = _sizes(hf)
  cfg = model_config(hf)
  t = {name: np.asarray(x, np.float32) for name, x in tensors.items()}
  p: dict = {
    "embed": {"embedding": t["transformer.wte.weight"]},
    "final_norm": {"scale": t["transformer.ln_f.weight"]},
    "recurrence": {"inject": {"linear": {"kernel": t["transformer.adapter.weight"].T}}},
  }
  table = t[ROPE_TABLE][0, :, 0]  # (block_size, H/2, 2): [..., 0] cos, [..., 1] sin.
  for module, scope, count in _stages(s):
    for i in range(count):
      block = _block_params(t, f"{module}.{i}", s, cfg["qk_bias"], table)
      common.put(p, scope.format(i), block)
  if not cfg["tie_embeddings"]:
    p["head"] = {"kernel": t["lm_head.weight"].T}
  return {"params": p}
