"""Decode-time KV cache in the two layouts of DESIGN.md §3.

Unshared: one K/V per core layer *per recurrence* (core entries are [R, B, S, K, H]); memory
grows with R. Shared: the final recurrence's K/V only (core entries are [B, S, K, H]). Prelude
and coda layers are not looped and keep ordinary caches in both layouts.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from looped.model.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Cached K/V for slots [0, max_len); slots < length_B[b] are filled for row b."""

  length_B: jax.Array
  layers: dict  # {'prelude': [KV], 'core': [KV], 'coda': [KV]}; KV = (k, v).
  share_kv: bool = flax.struct.field(pytree_node=False)

  @property
  def max_len(self) -> int:
    return self.layers["core"][0][0].shape[-3]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, share_kv: bool, dtype=None) -> KVCache:
  dtype = dtype or cfg.compute_dtype
  shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  zeros = lambda lead=(): jnp.zeros(lead + shape, dtype)
  core_lead = () if share_kv else (cfg.num_recurrences,)
  layers = {
    "prelude": [(zeros(), zeros()) for _ in range(cfg.num_prelude_layers)],
    "core": [(zeros(core_lead), zeros(core_lead)) for _ in range(cfg.num_core_layers)],
    "coda": [(zeros(), zeros()) for _ in range(cfg.num_coda_layers)],
  }
  return KVCache(jnp.zeros((batch,), jnp.int32), layers, share_kv)


def _write_rows(cache_BxSx, chunk_BxTx, start_B):
  """Writes each row's chunk at its own offset: cache[b, start_b : start_b + T] = chunk[b]."""

  def one(row, chunk, start):
    return jax.lax.dynamic_update_slice_in_dim(row, chunk.astype(row.dtype), start, axis=0)

  return jax.vmap(one)(cache_BxSx, chunk_BxTx, start_B)


def write_chunk(cache: KVCache, new: dict, num_tokens: int) -> KVCache:
  """Appends the chunk's K/V (same structure as cache.layers, T slots) and advances length."""
  write = lambda old, chunk: _write_rows(old, chunk, cache.length_B)
  layers = {}
  for name, kvs in cache.layers.items():
    per_recurrence = name == "core" and not cache.share_kv
    layers[name] = jax.tree.map(jax.vmap(write) if per_recurrence else write, kvs, new[name])
  return cache.replace(length_B=cache.length_B + num_tokens, layers=layers)


def num_cached_values(cache: KVCache) -> int:
  """Scalar values stored in the cache (all layers, K and V), for memory accounting."""
  return sum(x.size for x in jax.tree.leaves(cache.layers))
