"""The sequence mixers a layer can use (config `*_mixers`), and what each one caches.

gqa  grouped-query attention (attention.py): per token K and V, num_kv_heads x head_dim each.
mla  multi-head latent attention (mla.py): per token the latent c_kv [mla_kv_rank] and the
     RoPE key [mla_rope_dim].
kda  Kimi delta attention (kda.py): nothing per token; per sequence the state
     [num_heads, head_dim, head_dim] (float32) and the conv tail [kda_conv_size - 1, 3 x
     num_heads x head_dim] (float32), never quantized.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from looped import kv_quant
from looped.model.attention import Attention
from looped.model.config import STAGES, ModelConfig
from looped.model.kda import KDA, KDARecord
from looped.model.mla import MLA

MODULES = {"gqa": (Attention, "attn"), "mla": (MLA, "mla"), "kda": (KDA, "kda")}


def token_shapes(cfg: ModelConfig, kind: str) -> tuple[tuple[int, ...], ...]:
  """Per-token [slice] shapes of the cached entries of a per-token mixer (gqa, mla)."""
  if kind == "gqa":
    return ((cfg.num_kv_heads, cfg.head_dim),) * 2
  if kind == "mla":
    return ((1, cfg.mla_kv_rank), (1, cfg.mla_rope_dim))
  raise ValueError(f"Mixer {kind!r} caches no per-token entries.")


def kda_state_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
  h, d = cfg.num_heads, cfg.head_dim
  return (h, d, d), (cfg.kda_conv_size - 1, 3 * h * d)


def parallel_entry_zeros(cfg: ModelConfig, kind: str, batch: int, length: int):
  """Zeros shaped like the per-token entry a parallel forward returns (the Jacobi 'final K/V')."""
  dtype = cfg.compute_dtype
  if kind == "kda":
    h, d = cfg.num_heads, cfg.head_dim
    return KDARecord(
      jnp.zeros((batch, length, 3 * h * d), dtype),
      jnp.zeros((batch, length, h, d), jnp.float32),
      jnp.zeros((batch, length, h), jnp.float32),
    )
  return tuple(jnp.zeros((batch, length, *s), dtype) for s in token_shapes(cfg, kind))


def check_kv_format(cfg: ModelConfig, kv_format: str) -> None:
  """Raises ValueError if some per-token entry of the model cannot be stored in kv_format."""
  kv_quant.check_format(kv_format)
  for stage in STAGES:
    for kind in set(cfg.mixers(stage)) - {"kda"}:
      for shape in token_shapes(cfg, kind):
        kv_quant.check_format(kv_format, shape[-1])


def cache_bytes(cfg: ModelConfig, kv_format: str) -> dict:
  """Cache bytes, shared and unshared layouts: per token (gqa and mla layers, in kv_format,
  block scales included, nvfp4's per-token tensor scale excluded as kv_quant.bytes_per_value
  does) and per sequence (kda states, float32), in total and per mixer."""
  per_token = {m: {"shared": 0.0, "unshared": 0.0} for m in ("gqa", "mla")}
  per_sequence = {"kda": {"shared": 0.0, "unshared": 0.0}}
  for stage in STAGES:
    for kind in cfg.mixers(stage):
      for layout, share in (("shared", True), ("unshared", False)):
        copies = cfg.num_recurrences if stage == "core" and not share else 1
        if kind == "kda":
          values = sum(math.prod(s) for s in kda_state_shapes(cfg))
          per_sequence["kda"][layout] += copies * values * 4
        else:
          per_token[kind][layout] += copies * sum(
            s[0] * s[1] * kv_quant.bytes_per_value(kv_format, s[1]) for s in token_shapes(cfg, kind)
          )
  total = lambda d: {
    layout: sum(v[layout] for v in d.values()) for layout in ("shared", "unshared")
  }
  return {
    "per_token": total(per_token),
    "per_sequence": total(per_sequence),
    "per_token_by_mixer": per_token,
    "per_sequence_by_mixer": per_sequence,
  }
