"""The sequence mixers of a model (config `*_mixers`): the capabilities its layers have, the
zero entries a parallel forward starts from, the KV formats its entries accept, and its cache
bytes.

Each mixer's facts are its record in the registry (mixer_registry.py); which layers are cached
in how many copies is cache_layout.py. This module asks them of a whole model.
"""

from __future__ import annotations

from typing import Any

from looped import kv_quant
from looped.model import mixer_registry
from looped.model.cache_layout import cache_layout, stage_mixers
from looped.model.config import STAGES, ModelConfig
from looped.model.mixer_interface import CAPABILITIES


def _layers_have(cfg: Any, stage: str | None, capability: str) -> list[tuple[str, bool]]:
  """(mixer, whether it has `capability`) of each layer of `stage` (None: of every stage)."""
  if capability not in CAPABILITIES:
    raise ValueError(f"unknown mixer capability {capability!r}; they are {CAPABILITIES}.")
  stages = STAGES if stage is None else (stage,)
  names = [m for s in stages for m in stage_mixers(cfg, s)]
  return [(m, getattr(mixer_registry.get(m), capability)) for m in names]


def all_with(cfg: Any, stage: str | None, capability: str) -> bool:
  """Whether every layer of `stage` (None: of every stage) has `capability`, a boolean of its
  mixer's record (mixer_interface.Mixer). cfg: anything with the model's mixer fields (a
  ModelConfig, the simulator's ModelShape, a config's `model` section)."""
  return all(has for _, has in _layers_have(cfg, stage, capability))


def any_with(cfg: Any, stage: str | None, capability: str) -> bool:
  """Whether some layer of `stage` (None: of any stage) has `capability` (as all_with)."""
  return any(has for _, has in _layers_have(cfg, stage, capability))


def lacking(cfg: Any, stage: str | None, capability: str) -> tuple[str, ...]:
  """The mixers of the layers of `stage` (None: of every stage) that lack `capability`, each
  once, in layer order (as all_with): what a refusal names."""
  return tuple(dict.fromkeys(m for m, has in _layers_have(cfg, stage, capability) if not has))


def parallel_entry_zeros(cfg: ModelConfig, kind: str, batch: int, length: int):
  """Zeros shaped like the per-token entry a parallel forward returns (the Jacobi 'final K/V')."""
  return mixer_registry.get(kind).entry_zeros(cfg, batch, length)


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
  mixer (every registered mixer of each kind, 0 where the model has none)."""
  layouts = {"shared": cache_layout(cfg, True, kv_policy), "unshared": cache_layout(cfg, False)}
  paged = mixer_registry.names_with("pages_its_cache")
  stateful = mixer_registry.names_with("pages_its_cache", False)
  per_token = {
    m: {k: layout.bytes_per_token(kv_format, mixer=m) for k, layout in layouts.items()}
    for m in paged
  }
  per_sequence = {
    m: {k: layout.bytes_per_sequence(m) for k, layout in layouts.items()} for m in stateful
  }
  return {
    "per_token": {k: layout.bytes_per_token(kv_format) for k, layout in layouts.items()},
    "per_sequence": {k: layout.bytes_per_sequence() for k, layout in layouts.items()},
    "per_token_by_mixer": per_token,
    "per_sequence_by_mixer": per_sequence,
  }
