"""The sequence mixers a layer can use (config `*_mixers`): their modules, the zero entries a
parallel forward starts from, the KV formats a model's entries accept, and its cache bytes.

What each mixer caches is stated in mixer_interface.py (MIXER_CACHES); which layers are cached in
how many copies in cache_layout.py. This module adds them up for reports and checks.
"""

from __future__ import annotations

import jax.numpy as jnp

from looped import kv_quant
from looped.model.attention import Attention
from looped.model.cache_layout import cache_layout
from looped.model.config import ModelConfig
from looped.model.kda import KDA, KDARecord
from looped.model.mixer_interface import MIXER_CACHES
from looped.model.mla import MLA

MODULES = {"gqa": (Attention, "attn"), "mla": (MLA, "mla"), "kda": (KDA, "kda")}


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
  shapes = MIXER_CACHES[kind](cfg).token_shapes
  return tuple(jnp.zeros((batch, length, *s), dtype) for s in shapes)


def check_kv_format(cfg: ModelConfig, kv_format: str) -> None:
  """Raises ValueError if some per-token entry of the model cannot be stored in kv_format."""
  kv_quant.check_format(kv_format)
  for layer in cache_layout(cfg, True).layers:
    for _, width in layer.cache.token_shapes:
      kv_quant.check_format(kv_format, width)


def cache_bytes(cfg: ModelConfig, kv_format: str, kv_policy: str = "final") -> dict:
  """Cache bytes, shared (under kv_policy, kv_policy.py) and unshared layouts: per token (gqa
  and mla layers, in kv_format, block scales included, nvfp4's per-token tensor scale excluded
  as kv_quant.bytes_per_value does) and per sequence (kda states, float32), in total and per
  mixer."""
  layouts = {"shared": cache_layout(cfg, True, kv_policy), "unshared": cache_layout(cfg, False)}
  per_token = {
    m: {k: layout.bytes_per_token(kv_format, mixer=m) for k, layout in layouts.items()}
    for m in ("gqa", "mla")
  }
  per_sequence = {"kda": {k: layout.bytes_per_sequence("kda") for k, layout in layouts.items()}}
  return {
    "per_token": {k: layout.bytes_per_token(kv_format) for k, layout in layouts.items()},
    "per_sequence": {k: layout.bytes_per_sequence() for k, layout in layouts.items()},
    "per_token_by_mixer": per_token,
    "per_sequence_by_mixer": per_sequence,
  }
