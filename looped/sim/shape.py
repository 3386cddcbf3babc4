"""The few numbers of a looped model that set its serving cost: parameters, depth, KV bytes.

Read from the same `model` config the trainer uses (configs/pretrain.py:model_config), so a
simulation describes exactly the model that is trained. KV bytes come from
looped.model.cache_layout, the layout the model, the engine's pages and the evaluation use: per
token the GQA layers' K/V and the MLA layers' latent and RoPE key, per sequence the KDA layers'
state. Parameters and FLOPs are still counted as if every layer were GQA.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from looped.model import cache_layout, mixer_interface

_MLP_MATRICES = {"swiglu": 3, "relu2": 2}


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """Shape of a looped LM: P prelude, B core (run R times) and C coda layers."""

  vocab_size: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  mlp_type: str
  num_prelude_layers: int
  num_core_layers: int
  num_coda_layers: int
  num_recurrences: int
  tie_embeddings: bool
  # What the layers cache (defaults as ModelConfig's: an all-GQA model).
  prelude_mixers: tuple[str, ...] = ("gqa",)
  core_mixers: tuple[str, ...] = ("gqa",)
  coda_mixers: tuple[str, ...] = ("gqa",)
  mla_kv_rank: int = 64
  mla_rope_dim: int = 32
  kda_conv_size: int = 4

  @classmethod
  def from_config(cls, model: Any) -> ModelShape:
    """From a model config (ConfigDict or dict); the mixer fields may be absent (GQA)."""
    value = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
    return cls(
      **{
        f.name: value(model[f.name])
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING or f.name in model
      }
    )

  def cache_layout(self, share_kv: bool) -> cache_layout.CacheLayout:
    return _layout(self, share_kv)

  @property
  def params_per_layer(self) -> int:
    """Matrix parameters of one transformer layer (norms are negligible)."""
    d, hd = self.d_model, self.head_dim
    attention = d * self.num_heads * hd * 2 + d * self.num_kv_heads * hd * 2  # q, o; k, v.
    return attention + _MLP_MATRICES[self.mlp_type] * d * self.mlp_dim

  @property
  def layer_executions(self) -> int:
    """Layers a token passes through: the core block runs R times."""
    return (
      self.num_prelude_layers + self.num_recurrences * self.num_core_layers + (self.num_coda_layers)
    )

  def kv_layers(self, share_kv: bool) -> int:
    """Layer copies whose per-token entries a token leaves in the cache.

    Shared: the core block keeps only the final recurrence's (one set for all R); unshared: one
    set per recurrence. Prelude and coda are not looped. KDA layers keep a state instead.
    """
    return self.cache_layout(share_kv).per_token_layers

  def kv_bytes_per_token_layer(self, kv_format: str) -> float:
    """Bytes of one token's K and V in one GQA layer, scales included (looped.kv_quant)."""
    return mixer_interface.gqa_cache(self).bytes_per_token(kv_format)

  def kv_bytes_per_token(
    self, share_kv: bool, kv_format: str | None, raw_itemsize: float = 2
  ) -> float:
    """Bytes one token leaves in the cache over all layers, in kv_format (block and vector
    scales included, nvfp4's tensor scale excluded as kv_quant.bytes_per_value does), or raw at
    raw_itemsize bytes per value when kv_format is None."""
    return self.cache_layout(share_kv).bytes_per_token(kv_format, raw_itemsize)

  def kv_bytes_per_sequence(self, share_kv: bool) -> float:
    """Per-sequence state bytes (KDA layers: float32 state and conv tail; 0 without KDA)."""
    return self.cache_layout(share_kv).bytes_per_sequence()

  @property
  def num_params(self) -> int:
    """Stored parameters: unique layers plus embedding (and an untied LM head)."""
    layers = self.num_prelude_layers + self.num_core_layers + self.num_coda_layers
    embeddings = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
    return layers * self.params_per_layer + embeddings


@functools.lru_cache(maxsize=64)
def _layout(shape: ModelShape, share_kv: bool) -> cache_layout.CacheLayout:
  return cache_layout.cache_layout(shape, share_kv)
