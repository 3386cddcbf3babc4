"""Decode-time KV cache in the two layouts of docs/design.md §3, stored raw or in a KV format.

Which layers are cached in how many copies is cache_layout.py's: unshared, core entries are
[R, B, S, K, H] (one per recurrence; memory grows with R); shared, [B, S, K, H] (the final
recurrence only) or, under a KV policy caching n > 1 recurrences (kv_policy.py), [n, B, S, K, H];
prelude and coda entries are [B, S, K, H] in both.

Layers whose mixer keeps a recurrent state instead of per-token entries (KDA) hold a
`KDAState` (state and conv tail, raw float32) that each chunk replaces rather than appends to,
and that KV formats leave unquantized.

With a `kv_format` (looped.kv_quant.FORMATS) every entry is a `QuantizedKV` holding the packed
bytes and scales, quantized per token (one [K, H] slice at a time, so nvfp4's tensor scale is per
token and a token's stored bytes never depend on other tokens or rows), and dequantized on every
read. `quantize_roundtrip` applies the same per-token round trip to K/V in the parallel forwards,
which is what makes the Jacobi passes and exact decode agree under quantization too.
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from looped import kv_quant
from looped.model import cache_layout, mixers
from looped.model import kv_policy as kv_policy_lib
from looped.model.config import ModelConfig
from looped.model.kda import KDAState
from looped.model.mixer_interface import PagedKV


@flax.struct.dataclass
class KVCache:
  """Cached K/V for slots [0, max_len); slots < length_B[b] are filled for row b."""

  length_B: jax.Array
  layers: dict  # {'prelude': [KV], 'core': [KV], 'coda': [KV]}; KV = (k, v), raw or quantized,
  # or a KDAState for KDA layers.
  layout: cache_layout.KVLayout = flax.struct.field(pytree_node=False)  # Sharing, format, policy.
  # Recurrences each filled slot's token ran ([B, S] int32), where a decode with exits needs
  # them (an unshared cache's 'skip' and 'always-last' lookups, looped.model.adaptive); None:
  # not recorded.
  depth_BxS: jax.Array | None = None

  @property
  def share_kv(self) -> bool:
    return self.layout.share_kv

  @property
  def kv_format(self) -> str | None:
    return self.layout.format

  @property
  def kv_policy(self) -> str:
    return self.layout.policy

  @property
  def max_len(self) -> int:
    """Slots of the per-token entries (0 when every layer keeps a recurrent state)."""
    for entries in self.layers.values():
      for entry in entries:
        if isinstance(entry, PagedKV):
          return entry.num_slots
        if not isinstance(entry, KDAState):
          return entry[0].shape[-3]
    return 0


def _per_token(fn, x, token_ndim: int = 2):
  """Applies fn to each trailing [K, H] slice of x (any leading dims) via one flat vmap."""
  leaves = jax.tree.leaves(x)
  lead = leaves[0].shape[: leaves[0].ndim - token_ndim]
  if isinstance(x, kv_quant.QuantizedKV):
    lead = x.data.shape[: x.data.ndim - token_ndim]
  n = math.prod(lead)
  flat = jax.tree.map(lambda a: a.reshape((n,) + a.shape[len(lead) :]), x)
  out = jax.vmap(fn)(flat)
  return jax.tree.map(lambda a: a.reshape(lead + a.shape[1:]), out)


def quantize_tokens(x_NxKxH, kv_format: str) -> kv_quant.QuantizedKV:
  return _per_token(lambda v: kv_quant.quantize(v, kv_format), x_NxKxH)


def dequantize_tokens(q: kv_quant.QuantizedKV, dtype) -> jax.Array:
  return _per_token(lambda v: kv_quant.dequantize(v, dtype), q)


def quantize_roundtrip(kv, kv_format: str | None):
  """What a cache read returns for K/V written in kv_format (identity for None)."""
  if kv_format is None:
    return kv
  return jax.tree.map(lambda x: dequantize_tokens(quantize_tokens(x, kv_format), x.dtype), kv)


def reader(kv_format: str | None, dtype):
  """The read_past function for a cache stored in kv_format (None: raw arrays)."""
  if kv_format is None:
    return None
  return lambda kv: tuple(dequantize_tokens(q, dtype) for q in kv)


def init_cache(
  cfg: ModelConfig,
  batch: int,
  max_len: int,
  share_kv: bool,
  dtype=None,
  kv_format: str | None = None,
  kv_policy: str = kv_policy_lib.FINAL,
  depths: bool = False,
) -> KVCache:
  """An empty cache; under sharing its core keeps the copies kv_policy caches (kv_policy.py).
  depths: it also records each slot's recurrences (KVCache.depth_BxS)."""
  dtype = dtype or cfg.compute_dtype
  if kv_format is not None:
    mixers.check_kv_format(cfg, kv_format)

  def zeros(shape):
    x = jnp.zeros(shape, dtype)
    return x if kv_format is None else quantize_tokens(x, kv_format)

  def entry(layer: cache_layout.CachedLayer):
    lead, cache = layer.lead, layer.cache
    if cache.state_shapes:
      state, conv = cache.state_shapes
      return KDAState(jnp.zeros(lead + (batch, *state)), jnp.zeros(lead + (batch, *conv)))
    return tuple(zeros(lead + (batch, max_len, *s)) for s in cache.token_shapes)

  layout = cache_layout.KVLayout(share_kv, kv_format, kv_policy)
  cached = layout.cache(cfg)
  layers = {stage: [entry(layer) for layer in cached.stage(stage)] for stage in cache_layout.STAGES}
  depth_BxS = jnp.zeros((batch, max_len), jnp.int32) if depths else None
  return KVCache(jnp.zeros((batch,), jnp.int32), layers, layout, depth_BxS)


def _write_rows(cache_BxSx, chunk_BxTx, start_B):
  """Writes each row's chunk at its own offset: cache[b, start_b : start_b + T] = chunk[b]."""

  def one(row, chunk, start):
    return jax.lax.dynamic_update_slice_in_dim(row, chunk.astype(row.dtype), start, axis=0)

  return jax.vmap(one)(cache_BxSx, chunk_BxTx, start_B)


def _constrain(x):
  """Per-token cache arrays [(R,) B, S, K, ...] are split by batch rows and KV heads on a mesh
  (looped.sharding; a no-op outside one). A single head (MLA's latent) stays whole."""
  lead = (None,) * (x.ndim - 4)
  heads = "kv_heads" if x.shape[-2] > 1 else None
  return nn.with_logical_constraint(x, lead + ("batch", "length", heads, None))


def _constrain_entry(kv):
  """_constrain on an entry's K and V (their packed elements when quantized; scales follow)."""
  one = lambda x: (
    x.replace(data=_constrain(x.data)) if isinstance(x, kv_quant.QuantizedKV) else _constrain(x)
  )
  return tuple(one(x) for x in kv)


def token_pages(page_table_BxP, start_B, num_new_B, t: int, page_size: int, scratch_page: int):
  """Where a paged cache stores token j < t of row b (position start_b + j): (page_BxT,
  slot_BxT), through the row's page table. Tokens j >= num_new_b (padding) go to the scratch
  page, so they never overwrite a real slot."""
  j_T = jnp.arange(t)
  pos_BxT = start_B[:, None] + j_T[None, :]
  col_BxT = jnp.clip(pos_BxT // page_size, 0, page_table_BxP.shape[1] - 1)
  page_BxT = jnp.take_along_axis(page_table_BxP, col_BxT, axis=1)
  page_BxT = jnp.where(j_T[None, :] < num_new_B[:, None], page_BxT, scratch_page)
  return page_BxT, pos_BxT % page_size


def _write_pages(paged: PagedKV, new: tuple, start_B, num_new_B) -> PagedKV:
  """A paged entry with the chunk's K/V (raw or quantized, [(C,) B, T, ...] leaves: C copies
  with a [C, B, P] table) written into its pages; padding tokens go to the pool's last page
  (a scratch page, never read as a real slot)."""
  pool = jax.tree.leaves(paged.k_pages)[0]
  table = paged.page_table_BxP
  copies = table.shape[0] if table.ndim == 3 else 1
  b = table.shape[-2]
  rows = lambda x: x.reshape(copies * b, *x.shape[table.ndim - 1 :])  # [(C,) B, ...] -> [C*B, ...]
  t = rows(jax.tree.leaves(new)[0]).shape[1]
  page_BxT, slot_BxT = token_pages(
    table.reshape(copies * b, -1),
    jnp.tile(start_B, copies),
    jnp.tile(num_new_B, copies),
    t,
    paged.page_size,
    pool.shape[0] - 1,
  )
  write = lambda pages, x: pages.at[page_BxT, slot_BxT].set(rows(x).astype(pages.dtype))
  k_new, v_new = new
  return PagedKV(
    jax.tree.map(write, paged.k_pages, k_new), jax.tree.map(write, paged.v_pages, v_new), table
  )


def stored_chunk(cache: KVCache, new: dict) -> dict:
  """The chunk's entries as `cache` stores them ({stage: [entry]}, T slots): per-token K/V in
  its KV format, KDA layers' new states as they are. What write_chunk writes; a paged engine
  writes these into its pages directly rather than reading them back out of the dense cache."""
  if cache.kv_format is None:
    return new
  quantize = lambda kv: (
    kv if isinstance(kv, KDAState) else tuple(quantize_tokens(x, cache.kv_format) for x in kv)
  )
  return {name: [quantize(kv) for kv in kvs] for name, kvs in new.items()}


def write_chunk(
  cache: KVCache, new: dict, num_tokens, slotted_core: bool = False, depth_BxT=None
) -> KVCache:
  """Appends the chunk's raw K/V (same structure as cache.layers, T slots), advances length
  by num_tokens (an int, or per row [B]: a padded row's real tokens). slotted_core: the shared
  core's entries lead with the KV policy's copies (cache_layout's lead). depth_BxT: the
  recurrences the chunk's tokens ran, where the cache records depths (KVCache.depth_BxS).

  KDA layers' new entries are their states after the chunk, which replace the old ones. A
  paged entry (PagedKV) gets the chunk's entries written into its pages through its table.
  """
  is_state = lambda x: isinstance(x, KDAState)
  new = stored_chunk(cache, new)
  write = lambda old, chunk: _write_rows(old, chunk, cache.length_B)
  slotted = lambda name: (
    cache_layout.per_recurrence(name, cache.share_kv) or (name == "core" and slotted_core)
  )
  num_B = jnp.broadcast_to(jnp.asarray(num_tokens, jnp.int32), cache.length_B.shape)
  write_paged = lambda old, chunk: _write_pages(old, chunk, cache.length_B, num_B)

  def write_one(name, kv, kv_new):
    if is_state(kv):
      return kv_new
    if isinstance(kv, PagedKV):  # Copies, if any, lead its table and the chunk's entries.
      return write_paged(kv, kv_new)
    write_entry = jax.vmap(write) if slotted(name) else write
    return _constrain_entry(jax.tree.map(write_entry, kv, kv_new))

  layers = {}
  for name, kvs in cache.layers.items():
    layers[name] = [write_one(name, kv, kv_new) for kv, kv_new in zip(kvs, new[name], strict=True)]
  depth_BxS = cache.depth_BxS
  if depth_BxS is not None:
    if depth_BxT is None:
      raise ValueError("This cache records depths: write_chunk needs the chunk's depth_BxT.")
    depth_BxS = _write_rows(depth_BxS, jnp.asarray(depth_BxT, jnp.int32), cache.length_B)
  return cache.replace(length_B=cache.length_B + num_tokens, layers=layers, depth_BxS=depth_BxS)


def num_cached_values(cache: KVCache) -> int:
  """Per-token values the cache holds (all layers, K and V), for memory accounting; KDA
  states are counted by cache_nbytes only."""
  return sum(
    math.prod(kv.shape)
    for kvs in cache.layers.values()
    for pair in kvs
    if not isinstance(pair, KDAState)
    for kv in pair
  )


def cache_nbytes(cache: KVCache) -> int:
  """Bytes actually stored (packed elements and scales) across all layers."""
  return sum(x.nbytes for x in jax.tree.leaves(cache.layers))
