"""Which layers a looped model caches, in how many copies, and how many bytes that takes.

The layout rule of docs/design.md §3, stated once here and read by the model's caches
(kv_cache.py), the mixers' byte counts (mixers.py, and the evaluation through it), the engine's
page pool (looped/engine/paged_cache.py) and the serving simulator (looped/sim/shape.py):

  every prelude and coda layer is cached once; a core layer is cached once per recurrence
  without sharing, and under sharing once per recurrence its KV policy caches (kv_policy.py:
  one, the final recurrence, for the default 'final').

What one copy of a layer holds is its mixer's `MixerCache` (its record's `cache`,
mixer_registry.py): per-token entries (GQA, MLA), which KV formats store packed, and
per-sequence state (KDA), always float32.

`cache_layout(cfg, share_kv, kv_policy)` reads only these fields of cfg, so a ModelConfig and the
simulator's ModelShape both describe a model: num_{prelude,core,coda}_layers,
{prelude,core,coda}_mixers, num_recurrences and the fields of the mixers present
(num_kv_heads, head_dim, num_heads, mla_kv_rank, mla_rope_dim, kda_conv_size).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from looped.model import kv_policy as kv_policy_lib
from looped.model import mixer_registry
from looped.model.config import STAGES
from looped.model.mixer_interface import MixerCache

__all__ = ["STAGES", "CacheLayout", "CachedLayer", "cache_layout", "per_recurrence", "stage_mixers"]


def per_recurrence(stage: str, share_kv: bool) -> bool:
  """The layout rule: only the core's layers, and only without sharing, keep one copy per
  recurrence (their cache arrays lead with an R axis); every other layer keeps one."""
  return stage == "core" and not share_kv


def stage_mixers(cfg: Any, stage: str) -> tuple[str, ...]:
  """The mixer of each layer of a stage: its pattern repeated over the stage's layers."""
  pattern = tuple(getattr(cfg, f"{stage}_mixers"))
  count = getattr(cfg, f"num_{stage}_layers")
  return tuple(pattern[i % len(pattern)] for i in range(count))


@dataclasses.dataclass(frozen=True)
class CachedLayer:
  """One layer's cache: `copies` copies (one per recurrence when per_recurrence, one per cached
  recurrence of a shared core's KV policy) of `cache`."""

  stage: str
  layer: int  # Index within the stage.
  mixer: str
  per_recurrence: bool
  copies: int
  cache: MixerCache

  @property
  def lead(self) -> tuple[int, ...]:
    """Leading axes of this layer's cache arrays: (copies,) when it keeps several (per
    recurrence, or a policy's cached recurrences), else none."""
    return (self.copies,) if self.per_recurrence or self.copies > 1 else ()


@dataclasses.dataclass(frozen=True)
class CacheLayout:
  """The cached layers of a model in one sharing layout, in stage and layer order."""

  share_kv: bool
  layers: tuple[CachedLayer, ...]
  kv_policy: str = kv_policy_lib.FINAL

  def stage(self, stage: str) -> tuple[CachedLayer, ...]:
    return tuple(c for c in self.layers if c.stage == stage)

  def entries(self) -> list[tuple[str, int, int | None, str]]:
    """(stage, layer, copy slot, mixer) of every cached copy: the slot is the recurrence
    unshared, the index among a KV policy's cached recurrences shared, and None for a layer
    cached once (prelude, coda, and the core's one cached recurrence under sharing)."""
    return [
      (c.stage, c.layer, r if c.lead else None, c.mixer)
      for c in self.layers
      for r in range(c.copies)
    ]

  def bytes_per_token(
    self,
    kv_format: str | None,
    raw_itemsize: float = 2,
    tensor_scales: bool = False,
    mixer: str | None = None,
  ) -> float:
    """Per-token bytes of all cached layers (or of one mixer's); see MixerCache.bytes_per_token.

    Summed per mixer as copies x one layer's bytes, so a single-mixer model's figure is
    exactly its layer count times one layer's bytes.
    """
    total = 0.0
    for kind, copies in self.copies_by_mixer().items():
      if mixer is None or kind == mixer:
        cache = next(c.cache for c in self.layers if c.mixer == kind)
        total += copies * cache.bytes_per_token(kv_format, raw_itemsize, tensor_scales)
    return total

  def bytes_per_sequence(self, mixer: str | None = None) -> float:
    """Per-sequence state bytes of all cached layers (or of one mixer's): KDA's float32 state."""
    return float(
      sum(
        c.copies * c.cache.bytes_per_sequence
        for c in self.layers
        if mixer is None or c.mixer == mixer
      )
    )

  def copies_by_mixer(self) -> dict[str, int]:
    """Cached layer copies per mixer, in order of first appearance."""
    out: dict[str, int] = {}
    for c in self.layers:
      out[c.mixer] = out.get(c.mixer, 0) + c.copies
    return out

  @property
  def per_token_layers(self) -> int:
    """Cached layer copies that hold per-token entries (the pageable ones)."""
    return sum(c.copies for c in self.layers if c.cache.token_shapes)

  @property
  def vectors_per_token(self) -> int:
    """Cached last-axis vectors per token over all layers (GQA: layers x 2 x kv heads)."""
    return sum(c.copies * c.cache.vectors_per_token for c in self.layers)


def cache_layout(cfg: Any, share_kv: bool, kv_policy: str = kv_policy_lib.FINAL) -> CacheLayout:
  """The cached layers of the model cfg describes, shared (under kv_policy, kv_policy.py) or
  unshared (module docstring)."""
  shared_copies = kv_policy_lib.parse(kv_policy, cfg.num_recurrences).copies
  layers = []
  for stage in STAGES:
    for i, mixer in enumerate(stage_mixers(cfg, stage)):
      repeat = per_recurrence(stage, share_kv)
      copies = cfg.num_recurrences if repeat else 1
      if stage == "core" and share_kv:
        copies = shared_copies
      cache = mixer_registry.get(mixer).cache(cfg)
      layers.append(CachedLayer(stage, i, mixer, repeat, copies, cache))
  return CacheLayout(share_kv, tuple(layers), kv_policy if share_kv else kv_policy_lib.FINAL)


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """How a model's KV cache is laid out and stored, as one static value: whether the core shares
  its cache across recurrences, the KV format, the sharing policy and the page size. Built once
  by a program (or a test) and passed whole to the model's caches, the engine's pages, the
  evaluation's byte counts and the simulator, which ask it for the layers it caches and their
  bytes instead of rebuilding that from loose flags. Hashable: a jit static argument."""

  share_kv: bool
  format: str | None = None  # A looped.kv_quant format; None: raw compute-dtype arrays.
  policy: str = kv_policy_lib.FINAL  # Under sharing, kv_policy.py's policy; 'final' unshared.
  page_size: int = 16  # Tokens per page (the engine's unit of allocation and of prefix hits).

  def __post_init__(self):
    object.__setattr__(self, "format", self.format or None)
    if not self.share_kv:
      object.__setattr__(self, "policy", kv_policy_lib.FINAL)
    if self.page_size < 1:
      raise ValueError(f"page_size = {self.page_size}: a page holds at least one token.")

  def cache(self, cfg: Any) -> CacheLayout:
    """The model's cached layers in this layout (cfg: a ModelConfig or the simulator's shape)."""
    return cache_layout(cfg, self.share_kv, self.policy)

  def bytes_per_token(self, cfg: Any, raw_itemsize: float | None = None) -> float:
    """Stored bytes per token over all paged layers: raw at the compute dtype (raw_itemsize, for
    a shape without one), or packed elements and scales with nvfp4's per-token tensor scale, as
    the engine's pages store them (a per-sequence state is bytes_per_sequence's)."""
    itemsize = raw_itemsize if raw_itemsize is not None else cfg.compute_dtype.itemsize
    return self.cache(cfg).bytes_per_token(self.format, itemsize, tensor_scales=True)

  def bytes_per_sequence(self, cfg: Any) -> float:
    """Bytes of one sequence's state slot (float32, never in a KV format); 0 without states."""
    return self.cache(cfg).bytes_per_sequence()

  def page_bytes(self, cfg: Any) -> float:
    return self.page_size * self.bytes_per_token(cfg)

  def pages_for_budget(self, cfg: Any, budget_bytes: float, max_num_seqs: int) -> int:
    """Pages a byte budget holds once it holds the state slots of max_num_seqs requests (models
    with a per-sequence state; 0 bytes otherwise)."""
    slots = max_num_seqs * self.bytes_per_sequence(cfg)
    return max(int((budget_bytes - slots) // self.page_bytes(cfg)), 0)

  def slotted_core(self, cfg: Any) -> bool:
    """Whether the shared core's pages lead with a copies axis (a KV policy caching several
    recurrences, kv_policy.py); the unshared core's R axis is per_recurrence's."""
    return self.share_kv and any(layer.lead for layer in self.cache(cfg).stage("core"))
