"""Paged KV storage for the engine: one page array per cached entry, in either sharing layout.

Every per-token cache entry of the model (GQA's K and V, MLA's latent and RoPE key) is stored as
pages [N + 1, page_size, ...], with the leading R axis looped.model.cache_layout gives a layer
cached per recurrence ([R, N + 1, page_size, ...]: core layers in the unshared layout). Page N is a
scratch page: writes of padding tokens and page-table slots past a request's pages point there,
so every step has static shapes. With a KV format the pages hold the packed bytes and scales
exactly as looped.model.kv_cache stores them per token, so a page is never dequantized in place.

A step gathers each row's pages through its page table into a dense `KVCache` (the model's own
decode path then runs unchanged), and scatters the new tokens' entries back into their pages.
This dense-gather path is the first implementation; pallas_kernels.paged_decode reads pages
directly but is not wired in yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from looped.model import cache_layout, mixers
from looped.model import kv_cache as kv_cache_lib
from looped.model.cache_layout import STAGES
from looped.model.config import ModelConfig
from looped.model.kv_cache import KVCache


def check_model(cfg: ModelConfig) -> None:
  """Raises ValueError if the model has a layer the paged engine cannot serve."""
  for stage in STAGES:
    if "kda" in cfg.mixers(stage):
      raise ValueError(
        f"The engine pages per-token K/V; {stage} layers use 'kda', whose cache is a per-sequence "
        "state (not pageable, so not prefix-cacheable). Use 'gqa' or 'mla' mixers."
      )


def init_pages(
  cfg: ModelConfig, num_pages: int, page_size: int, share_kv: bool, kv_format: str | None
) -> dict:
  """Zeroed pages (plus the scratch page) for every cached layer: {stage: [entry]}."""
  check_model(cfg)
  if kv_format is not None:
    mixers.check_kv_format(cfg, kv_format)

  def zeros(shape):
    x = jnp.zeros(shape, cfg.compute_dtype)
    return x if kv_format is None else kv_cache_lib.quantize_tokens(x, kv_format)

  layout = cache_layout.cache_layout(cfg, share_kv)
  return {
    stage: [
      tuple(zeros(layer.lead + (num_pages + 1, page_size, *s)) for s in layer.cache.token_shapes)
      for layer in layout.stage(stage)
    ]
    for stage in STAGES
  }


def bytes_per_token(cfg: ModelConfig, share_kv: bool, kv_format: str | None) -> float:
  """Stored bytes per token over all paged layers: raw pages at the compute dtype, or packed
  elements and scales with nvfp4's per-token tensor scale included, as init_pages stores them.
  A model with KDA layers is refused by check_model; for it this is what the pages would hold
  (KDA's per-sequence state is not paged)."""
  return cache_layout.cache_layout(cfg, share_kv).bytes_per_token(
    kv_format, raw_itemsize=cfg.compute_dtype.itemsize, tensor_scales=True
  )


def _batch_axis(stage: str, share_kv: bool) -> int:
  return 1 if cache_layout.per_recurrence(stage, share_kv) else 0


def gather(
  pages: dict, page_table_BxP: jax.Array, context_B: jax.Array, share_kv: bool, kv_format
) -> KVCache:
  """Dense cache of each row's pages (slots = P * page_size), with length_B = context_B."""
  b, p = page_table_BxP.shape

  def one(stage):
    axis = _batch_axis(stage, share_kv)

    def leaf(x):
      g = x[page_table_BxP] if axis == 0 else x[:, page_table_BxP]
      shape = g.shape
      return g.reshape(shape[: axis + 1] + (p * shape[axis + 2],) + shape[axis + 3 :])

    return [jax.tree.map(leaf, entry) for entry in pages[stage]]

  layers = {stage: one(stage) for stage in STAGES}
  return KVCache(context_B.astype(jnp.int32), layers, share_kv, kv_format)


def scatter(
  pages: dict,
  cache: KVCache,
  page_table_BxP: jax.Array,
  context_B: jax.Array,
  num_new_B: jax.Array,
  num_slots: int,
  share_kv: bool,
) -> dict:
  """Writes slots [context_b, context_b + num_new_b) of the dense cache back into their pages.

  Slots j >= num_new_b of the num_slots-wide window (padding) go to the scratch page.
  """
  page_size = _page_size(pages, share_kv)
  j_T = jnp.arange(num_slots)
  pos_BxT = context_B[:, None] + j_T[None, :]
  col_BxT = jnp.clip(pos_BxT // page_size, 0, page_table_BxP.shape[1] - 1)
  page_BxT = jnp.take_along_axis(page_table_BxP, col_BxT, axis=1)
  num_pages = _num_pages(pages, share_kv)
  page_BxT = jnp.where(j_T[None, :] < num_new_B[:, None], page_BxT, num_pages - 1)
  slot_BxT = pos_BxT % page_size

  def window(x, axis):  # [.., B, S, ...] -> [.., B, T, ...] at each row's context.
    fn = lambda row, c: jax.lax.dynamic_slice_in_dim(row, c, num_slots, axis=axis)
    return jax.vmap(fn, in_axes=(axis, 0), out_axes=axis)(x, context_B)

  out = {}
  for stage in STAGES:
    axis = _batch_axis(stage, share_kv)

    def write(page_leaf, dense_leaf, axis=axis):
      new = window(dense_leaf, axis)
      index = (slice(None),) * axis + (page_BxT, slot_BxT)
      return page_leaf.at[index].set(new.astype(page_leaf.dtype))

    out[stage] = [
      jax.tree.map(write, entry, dense)
      for entry, dense in zip(pages[stage], cache.layers[stage], strict=True)
    ]
  return out


def _first_leaf(pages: dict, share_kv: bool):
  for stage in STAGES:
    if pages[stage]:
      return stage, jax.tree.leaves(pages[stage][0])[0]
  raise ValueError("The model caches nothing per token.")


def _num_pages(pages: dict, share_kv: bool) -> int:
  """Pages in the arrays, the scratch page included."""
  stage, leaf = _first_leaf(pages, share_kv)
  return leaf.shape[_batch_axis(stage, share_kv)]


def _page_size(pages: dict, share_kv: bool) -> int:
  stage, leaf = _first_leaf(pages, share_kv)
  return leaf.shape[_batch_axis(stage, share_kv) + 1]
