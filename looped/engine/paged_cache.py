"""Paged KV storage for the engine: one page array per cached entry, in either sharing layout.

Every per-token cache entry of the model (GQA's K and V, MLA's latent and RoPE key) is stored as
pages [N + 1, page_size, ...], with the leading axis looped.model.cache_layout gives a layer
cached in several copies ([R, N + 1, page_size, ...]: core layers in the unshared layout;
[copies, ...]: a shared core under a KV policy caching several recurrences, `slotted_core`).
Page N is a scratch page: writes of padding tokens and page-table slots past a request's pages
point there, so every step has static shapes. With a KV format the pages hold the packed bytes
and scales exactly as looped.model.kv_cache stores them per token, so a page is never
dequantized in place.

A layer with a per-sequence state instead (KDA: delta-rule state and conv tail, float32) keeps a
`KDAState` of state slots [M + 1, ...] (with the same leading R axis when cached per
recurrence), one slot per running request (the scheduler's `Sequence.slot`); slot M is the
scratch slot of padding rows. A chunk starting at position 0 starts from a zero state, so a
slot needs no reset when a request is (re)admitted. Prefix hits are off for such models: a state
is not a function of a page.

With the engine's attention_impl 'xla', pages whose values are floats narrower than 32 bits
(bf16 raw or bf16 pages, fp8 elements, nvfp4's e4m3 scales) are stored as their bits, in unsigned
integers of the same width (`as_bits`): XLA:CPU scatters into a bf16 or fp8 array by converting
the whole array to float32 and back, so every step paid time in proportion to the pool (2
rows of one token after 224, unshared bf16 pages: 2.9 ms over 64 pages of 16 tokens, 38 ms over
1,025, measured 2026-12-05 before this storage; `benchmarks/engine.py --pool_pages`).
An integer scatter writes only its rows. The gather reinterprets the rows it read (`dtypes`, the
pool's values as the model reads them); 'pallas' keeps the values' own dtypes, which its kernel
reads.

A step gathers each row's pages through its page table (and its state from its slot) into a
dense `KVCache` (the model's own decode path then runs unchanged), and scatters the new tokens'
entries back into their pages (and the new state into its slot). With the engine's
attention_impl 'pallas' the layers `kernel_layers` names (GQA; in a KV format only in one-token
calls) are not gathered: the cache holds their pools and the page table (a PagedKV), attention
reads them with pallas_kernels.paged_decode, and the model writes the new tokens' entries into
the pages (kv_cache.write_chunk), which scatter then takes as they are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from looped.model import cache_layout, mixer_registry, mixers
from looped.model import kv_cache as kv_cache_lib
from looped.model.cache_layout import STAGES, KVLayout
from looped.model.config import ModelConfig
from looped.model.kda import KDAState
from looped.model.kv_cache import KVCache
from looped.model.mixer_interface import PagedKV


def check_model(cfg: ModelConfig) -> None:
  """Raises ValueError if the model has no layer the paged engine can page."""
  if not cache_layout.cache_layout(cfg, True).per_token_layers:
    paged, stateful = (mixer_registry.names_with("pages_its_cache", v) for v in (True, False))
    raise ValueError(
      f"The engine needs at least one {' or '.join(map(repr, paged))} layer to page; a model of "
      f"{' or '.join(map(repr, stateful))} layers only keeps a per-sequence state."
    )


def has_state(cfg: ModelConfig) -> bool:
  """Whether some layer keeps a per-sequence state (KDA): requests then hold state slots."""
  return any(c.cache.state_shapes for c in cache_layout.cache_layout(cfg, True).layers)


def _bits_dtype(dtype):
  """The unsigned integer of a float narrower than 32 bits (its storage under as_bits)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
    return jnp.dtype(f"uint{8 * dtype.itemsize}")
  return dtype


def to_bits(x: jax.Array) -> jax.Array:
  """x as stored under as_bits: narrow floats as their bits, anything else as it is."""
  bits = _bits_dtype(x.dtype)
  return x if bits == x.dtype else jax.lax.bitcast_convert_type(x, bits)


def from_bits(x: jax.Array, dtype) -> jax.Array:
  """Values of `dtype` from their storage (to_bits' inverse)."""
  return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


def page_dtypes(cfg: ModelConfig, layout: KVLayout) -> dict:
  """{stage: [entry]} of the dtypes the model reads the pool's leaves as (init_pages' pytree,
  a dtype per leaf)."""
  shapes = jax.eval_shape(lambda: init_pages(cfg, 1, layout, 1))
  return jax.tree.map(lambda x: x.dtype, shapes)


def init_pages(
  cfg: ModelConfig, num_pages: int, layout: KVLayout, num_slots: int = 0, as_bits: bool = False
) -> dict:
  """Zeroed pages (plus the scratch page) for every paged layer and state slots (plus the
  scratch slot) for every layer with a per-sequence state: {stage: [entry]}. as_bits: narrow
  floats stored as their bits (module docstring)."""
  check_model(cfg)
  kv_format, page_size = layout.format, layout.page_size
  if kv_format is not None:
    mixers.check_kv_format(cfg, kv_format)
  if has_state(cfg) and num_slots < 1:
    raise ValueError(f"num_slots = {num_slots}: a model with KDA layers needs a state slot.")

  def zeros(shape):
    x = jnp.zeros(shape, cfg.compute_dtype)
    return x if kv_format is None else kv_cache_lib.quantize_tokens(x, kv_format)

  def entry(layer: cache_layout.CachedLayer):
    lead, cache = layer.lead, layer.cache
    if cache.state_shapes:
      state, conv = (jnp.zeros(lead + (num_slots + 1, *s), jnp.float32) for s in cache.state_shapes)
      return KDAState(state, conv)
    return tuple(zeros(lead + (num_pages + 1, page_size, *s)) for s in cache.token_shapes)

  cached = layout.cache(cfg)
  pages = {stage: [entry(layer) for layer in cached.stage(stage)] for stage in STAGES}
  return jax.tree.map(to_bits, pages) if as_bits else pages


def _batch_axis(stage: str, layout: KVLayout, slotted: bool = False) -> int:
  lead = cache_layout.per_recurrence(stage, layout.share_kv) or (stage == "core" and slotted)
  return 1 if lead else 0


def kernel_layers(cfg: ModelConfig, layout: KVLayout, tokens: int) -> dict:
  """{stage: (bool per layer)}: which layers a call of `tokens` new tokens per row reads
  straight from the pages with pallas_kernels.paged_decode instead of a dense gather.

  GQA layers do, raw or in any KV format, except a chunk of more than one token in a KV
  format: there the chunk's own earlier tokens are read through the format (looped_lm's
  CacheAndOwnChunk), which the kernel, reading the own chunk raw, does not do. MLA's latent
  cache and KDA's state slots are gathered as before.
  """
  cached = layout.cache(cfg)
  kernel = layout.format is None or tokens == 1
  return {
    stage: tuple(kernel and mixer_registry.get(c.mixer).paged_kernel for c in cached.stage(stage))
    for stage in STAGES
  }


def gather(
  pages: dict,
  page_table_BxP: jax.Array,
  context_B: jax.Array,
  layout: KVLayout,
  slot_B: jax.Array | None = None,
  slotted: bool = False,
  paged: dict | None = None,
  dtypes: dict | None = None,
) -> KVCache:
  """Dense cache of each row's pages (slots = P * page_size), with length_B = context_B, and of
  each row's state slot (slot_B; a zero state for a row starting at position 0). slotted
  (KVLayout.slotted_core): whether the shared core's pages lead with its policy's copies.
  paged ({stage: bool per layer}, kernel_layers): layers passed as their pages and the page
  table (a PagedKV, read by the kernel) instead of gathered. dtypes (page_dtypes): the pool is
  stored as_bits; what is gathered is read as these."""
  b, p = page_table_BxP.shape

  def as_paged(entry, axis):
    table = page_table_BxP.astype(jnp.int32)
    k, v = entry
    if axis:  # Copies in one pool, a table per copy (mixer_interface.PagedKV).
      copies, pages_per_copy = jax.tree.leaves(entry)[0].shape[:2]
      offset_C = jnp.arange(copies, dtype=jnp.int32) * pages_per_copy
      table = table[None] + offset_C[:, None, None]
      merge = lambda x: x.reshape(copies * pages_per_copy, *x.shape[2:])
      k, v = jax.tree.map(merge, k), jax.tree.map(merge, v)
    return PagedKV(k, v, table)

  def one(stage):
    axis = _batch_axis(stage, layout, slotted)

    def leaf(x, dtype):
      g = from_bits(x[page_table_BxP] if axis == 0 else x[:, page_table_BxP], dtype)
      shape = g.shape
      return g.reshape(shape[: axis + 1] + (p * shape[axis + 2],) + shape[axis + 3 :])

    def state(x, dtype):
      g = from_bits(x[slot_B] if axis == 0 else x[:, slot_B], dtype)
      fresh = (context_B == 0).reshape((1,) * axis + (b,) + (1,) * (g.ndim - axis - 1))
      return jnp.where(fresh, 0.0, g)

    kernel = paged[stage] if paged else (False,) * len(pages[stage])
    types = _stage_dtypes(pages, dtypes, stage)
    return [
      as_paged(entry, axis)
      if read
      else jax.tree.map(state if isinstance(entry, KDAState) else leaf, entry, dtype)
      for entry, read, dtype in zip(pages[stage], kernel, types, strict=True)
    ]

  layers = {stage: one(stage) for stage in STAGES}
  return KVCache(context_B.astype(jnp.int32), layers, layout)


def scatter(
  pages: dict,
  cache: KVCache,
  chunk: dict,
  page_table_BxP: jax.Array,
  context_B: jax.Array,
  num_new_B: jax.Array,
  num_slots: int,
  layout: KVLayout,
  slot_B: jax.Array | None = None,
  slotted: bool = False,
  dtypes: dict | None = None,
) -> dict:
  """Writes the chunk's entries (LoopedLM's aux['cache_chunk']: {stage: [entry]} of num_slots
  slots, as stored) into their pages at each row's context_b, and each row's new state into
  its state slot slot_B[b]; dtypes (page_dtypes) when the pool is stored as_bits.

  Slots j >= num_new_b of the chunk (padding) go to the scratch page; padding rows' slot_B is
  the scratch slot. A layer the model read as pages (PagedKV in `cache`, the model's
  aux['cache']) had its new entries written into them by the model (kv_cache.write_chunk): its
  pages are taken as they are. The chunk, not a window of the updated dense cache, is what is
  written: reading the window back keeps the whole updated dense cache alive, a copy of every
  cached layer's context per step (unshared bf16 pages on CPU, 8 rows of one token after 960:
  35 ms a step with the window, 16-21 ms without; experiments/results/serving_live/
  engine_chunk_write.json).
  """
  page_size = _page_size(pages, layout, slotted)
  num_pages = _num_pages(pages, layout, slotted)
  page_BxT, slot_BxT = kv_cache_lib.token_pages(
    page_table_BxP, context_B, num_new_B, num_slots, page_size, num_pages - 1
  )

  out = {}
  for stage in STAGES:
    axis = _batch_axis(stage, layout, slotted)

    def write(page_leaf, new, dtype, axis=axis):  # new: [.., B, T, ...].
      index = (slice(None),) * axis + (page_BxT, slot_BxT)
      return page_leaf.at[index].set(_stored(new.astype(dtype), page_leaf.dtype))

    def write_state(slot_leaf, new, dtype, axis=axis):
      index = (slice(None),) * axis + (slot_B,)
      return slot_leaf.at[index].set(_stored(new.astype(dtype), slot_leaf.dtype))

    def write_entry(entry, dense, new, dtype, write=write, write_state=write_state):
      if isinstance(dense, PagedKV):  # Copies' pools back to [copies, pages, ...].
        split = lambda new, old: new.reshape(old.shape)
        return jax.tree.map(split, (dense.k_pages, dense.v_pages), entry)
      fn = write_state if isinstance(entry, KDAState) else write
      return jax.tree.map(fn, entry, new, dtype)

    types = _stage_dtypes(pages, dtypes, stage)
    out[stage] = [
      write_entry(entry, dense, new, dtype)
      for entry, dense, new, dtype in zip(
        pages[stage], cache.layers[stage], chunk[stage], types, strict=True
      )
    ]
  return out


def _stored(x: jax.Array, storage) -> jax.Array:
  """x (at its dtype as read) in the pool's storage dtype: itself, or its bits (as_bits)."""
  return from_bits(x, storage)  # The same reinterpretation, the other way.


def _stage_dtypes(pages: dict, dtypes: dict | None, stage: str) -> list:
  """The dtypes a stage's entries are read as: page_dtypes', or the pool's own."""
  return dtypes[stage] if dtypes else [jax.tree.map(lambda x: x.dtype, e) for e in pages[stage]]


def _first_leaf(pages: dict):
  """The first paged (per-token) leaf: state slots have no page axes."""
  for stage in STAGES:
    for entry in pages[stage]:
      if not isinstance(entry, KDAState):
        return stage, jax.tree.leaves(entry)[0]
  raise ValueError("The model caches nothing per token.")


def _num_pages(pages: dict, layout: KVLayout, slotted: bool = False) -> int:
  """Pages in the arrays, the scratch page included."""
  stage, leaf = _first_leaf(pages)
  return leaf.shape[_batch_axis(stage, layout, slotted)]


def _page_size(pages: dict, layout: KVLayout, slotted: bool = False) -> int:
  stage, leaf = _first_leaf(pages)
  return leaf.shape[_batch_axis(stage, layout, slotted) + 1]
