"""The few numbers of a looped model that set its serving cost: parameters, depth, KV bytes.

Read from the same `model` config the trainer uses (configs/pretrain.py:model_config), so a
simulation describes exactly the model that is trained. KV bytes come from
looped.model.cache_layout, the layout the model, the engine's pages and the evaluation use: per
token the GQA layers' K/V and the MLA layers' latent and RoPE key, per sequence the KDA layers'
state. FLOPs come from looped.model.flops, layer by layer with each layer's mixer (GQA; MLA with
its latent up-projections, in the absorbed form the engine's cached calls run; KDA with its
projections, conv and delta-rule state work), so the hybrid patterns (`*_mixers`) are priced as
the model computes them. `num_params` counts every stored parameter value (matrices, norms,
biases, KDA's decay and conv, injection, exit gate).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from looped.model import cache_layout, flops, mixer_interface, mixer_registry
from looped.model.cache_layout import KVLayout
from looped.model.config import STAGES, ModelConfig


class ModelShape(ModelConfig):
  """Shape of a looped LM: P prelude, B core (run R times) and C coda layers.

  The model's own config (its fields are declared once, in looped/model/config.py) plus the
  serving cost of that shape."""

  @classmethod
  def from_config(cls, model: Any) -> ModelShape:
    """From a model config (ConfigDict, dict or ModelConfig); absent fields take ModelConfig's
    defaults, fields that are not the model's are ignored."""
    if isinstance(model, ModelConfig):
      return cls(**dataclasses.asdict(model))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    value = lambda v: tuple(v) if isinstance(v, list) else v
    return cls(**{k: value(model[k]) for k in model.keys() if k in names})

  def cache_layout(self, layout: KVLayout) -> cache_layout.CacheLayout:
    return _layout(self, layout.share_kv, layout.policy)

  def mixer_params(self, mixer: str) -> int:
    """Stored values of one layer's sequence mixer: its matrices (the multiply-adds
    looped.model.flops counts per token) plus its vectors (norms, biases, KDA's decay), as its
    registry record counts them (looped/model/mixer_registry.py)."""
    return mixer_registry.get(mixer).params(self)

  def layer_params(self, mixer: str) -> int:
    """Stored values of one layer: mixer, MLP and its 2 (pre) or 4 (sandwich, post) norms."""
    norms = 2 if self.block_norm == "pre" else 4
    return self.mixer_params(mixer) + flops.mlp_macs(self) + norms * self.d_model

  def layer_runs(self) -> tuple[tuple[str, int], ...]:
    """(mixer, times it runs per token) of every distinct layer: the core's R times."""
    runs = flops.stage_runs(self)
    return tuple(
      (m, runs[stage]) for stage in STAGES for m in cache_layout.stage_mixers(self, stage)
    )

  @property
  def weight_macs_per_token(self) -> int:
    """Multiply-adds of the layers' weights (mixers and MLPs) per token, over all layer
    executions: also the matrix values a step reads (each layer's once per execution)."""
    return _counts(self)[0]

  @property
  def state_macs_per_token(self) -> int:
    """KDA's delta-rule state multiply-adds per token, over all its layer executions."""
    return _counts(self)[1]

  @property
  def macs_per_key(self) -> int:
    """Attention multiply-adds per (token, position read) pair, over all layer executions."""
    return _counts(self)[2]

  @property
  def attention_heads_executed(self) -> int:
    """Query heads that compute a score matrix per token, over all layer executions."""
    return _counts(self)[3]

  @property
  def layer_executions(self) -> int:
    """Layers a token passes through: the core block runs R times."""
    return (
      self.num_prelude_layers + self.num_recurrences * self.num_core_layers + (self.num_coda_layers)
    )

  def kv_layers(self, layout: KVLayout) -> int:
    """Layer copies whose per-token entries a token leaves in the cache.

    Shared: the core block keeps only the final recurrence's (one set for all R); unshared: one
    set per recurrence. Prelude and coda are not looped. KDA layers keep a state instead.
    """
    return self.cache_layout(layout).per_token_layers

  def kv_bytes_per_token_layer(self, kv_format: str) -> float:
    """Bytes of one token's K and V in one GQA layer, scales included (looped.kv_quant)."""
    return mixer_interface.gqa_cache(self).bytes_per_token(kv_format)

  def kv_bytes_per_token(self, layout: KVLayout, raw_itemsize: float = 2) -> float:
    """Bytes one token leaves in the cache over all layers, in the layout's format (block and
    vector scales included, nvfp4's tensor scale excluded as kv_quant.bytes_per_value does), or
    raw at raw_itemsize bytes per value when the layout has no format."""
    return self.cache_layout(layout).bytes_per_token(layout.format, raw_itemsize)

  def kv_bytes_per_sequence(self, layout: KVLayout) -> float:
    """Per-sequence state bytes (KDA layers: float32 state and conv tail; 0 without KDA)."""
    return self.cache_layout(layout).bytes_per_sequence()

  @property
  def num_params(self) -> int:
    """Stored parameter values: distinct layers, embedding (and an untied LM head), the norms
    outside layers, the injection and the exit gate (looped/model/looped_lm.py's tree)."""
    d = self.d_model
    layers = sum(self.layer_params(m) for m, _ in self.layer_runs())
    embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    norms = d * self.prelude_norm + d  # prelude_norm; final_norm, or 'every''s out_norm.
    inject = {"diagonal": d * d + 2 * d, "linear": 2 * d * d, "additive": 0, "none": 0}
    return layers + embeddings + norms + inject[self.injection] + (d + 1) * self.exit_gate


@functools.lru_cache(maxsize=64)
def _counts(shape: ModelShape) -> tuple[int, int, int, int]:
  """(weight, state, per-key multiply-adds, attention heads) per token over layer executions."""
  weights = state = per_key = heads = 0
  for mixer, runs in shape.layer_runs():
    m = flops.mixer_macs(shape, mixer, absorbed=True)
    weights += runs * (m.weights + flops.mlp_macs(shape))
    state += runs * m.state
    per_key += runs * m.per_key
    heads += runs * shape.num_heads * mixer_registry.get(mixer).attends
  return weights, state, per_key, heads


@functools.lru_cache(maxsize=64)
def _layout(shape: ModelShape, share_kv: bool, policy: str) -> cache_layout.CacheLayout:
  return cache_layout.cache_layout(shape, share_kv, policy)
