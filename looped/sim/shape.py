"""The few numbers of a looped model that set its serving cost: parameters, depth, KV bytes.

Read from the same `model` config the trainer uses (configs/pretrain.py:model_config), so a
simulation describes exactly the model that is trained.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from looped import kv_quant

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

  @classmethod
  def from_config(cls, model: Any) -> ModelShape:
    return cls(**{f.name: model[f.name] for f in dataclasses.fields(cls)})

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
    """Layers whose K/V a token leaves in the cache.

    Shared: the core block keeps only the final recurrence's K/V (one set for all R);
    unshared: one set per recurrence. Prelude and coda are not looped.
    """
    core = self.num_core_layers * (1 if share_kv else self.num_recurrences)
    return self.num_prelude_layers + core + self.num_coda_layers

  def kv_bytes_per_token_layer(self, kv_format: str) -> float:
    """Bytes of one token's K and V in one layer, scales included (looped.kv_quant's formats)."""
    return (
      self.num_kv_heads * self.head_dim * 2 * kv_quant.bytes_per_value(kv_format, self.head_dim)
    )

  def kv_bytes_per_token(self, share_kv: bool, kv_format: str) -> float:
    return self.kv_layers(share_kv) * self.kv_bytes_per_token_layer(kv_format)

  @property
  def num_params(self) -> int:
    """Stored parameters: unique layers plus embedding (and an untied LM head)."""
    layers = self.num_prelude_layers + self.num_core_layers + self.num_coda_layers
    embeddings = self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
    return layers * self.params_per_layer + embeddings
