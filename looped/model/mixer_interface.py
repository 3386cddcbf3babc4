"""The sequence-mixer interface: what a mixer layer is called with, returns and caches.

Every mixer (GQA `attention.py`, MLA `mla.py`, KDA `kda.py`) maps x_BxTxD to y_BxTxD and returns
the per-token entry a decode cache stores for it. What the new tokens may attend to is described
by a `MixerContext`, so the same layer serves every KV-sharing mode (docs/design.md §3):

- parallel unshared forward: no past; causal attention among the T tokens themselves;
- Jacobi shared pass: past = final-recurrence entries of the same positions (s < t), plus the
  token's own entry on the diagonal;
- decode / chunked prefill: past = the cache (slots < length), plus the new chunk causally.

What each mixer caches is stated here once, as a `MixerCache`, and named by its record (`Mixer`,
in the registry mixer_registry.py), so that the cache layout (cache_layout.py), the model's
caches, the engine's pages, the evaluation's byte counts and the serving simulator all read the
same shapes:

gqa  per token K and V, [num_kv_heads, head_dim] each.
mla  per token the latent c_kv [1, mla_kv_rank] and the RoPE key [1, mla_rope_dim].
kda  nothing per token; per sequence the state [num_heads, head_dim, head_dim] and the conv
     tail [kda_conv_size - 1, 3 x num_heads x head_dim], float32, never quantized.

This module holds no layer, so the layers (and pallas_attention.py) import it and not each
other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax

from looped import kv_quant

KV = tuple[jax.Array, jax.Array]  # (k_BxSxKxH, v_BxSxKxH)

STATE_BYTES = 4  # Per-sequence states are float32.
TENSOR_SCALE_BYTES = 4  # nvfp4's float32 tensor scale, one per quantized [K, H] token slice.


@dataclasses.dataclass(frozen=True)
class MixerContext:
  """What the new tokens of one mixer call may attend to.

  self_mask_BxTxT: which of the chunk's own tokens each token sees (causal, or diagonal only).
  past: None, a cache-format entry for slots S, or a function of the chunk's own entry returning
    the past entry (lets a Jacobi pass choose, per recurrence, the shared or its own keys).
  past_mask_BxTxS: which past slots each new token sees (ignored when past is None).
  read_past: optional function applied to the past entry on every read (e.g. dequantize).
  prefill_block: the block size C (a static int) of a parallel block-prefill pass, where
    past(own) returns [shared-or-own ; own] under the block masks (looped_lm.block_masks);
    kernels that read no masks (pallas_attention) need it.
  num_new_B: decode only: how many of each row's T tokens are real (None: all). The rest are
    padding of a batched call; a recurrent state (KDA) must not advance over them. Attention
    needs no such count: a padding token's K/V is never read by a real one (causal order).
  segment_ids_BxT: the new tokens' documents (int32; None: one document). The masks already
    hide other documents' slots; layers that read no masks (pallas_attention) or keep a state
    (KDA: reset where a document starts) read the ids. A parallel past holds the same positions,
    so it has the same ids.
  tail_segment_ids_BxW: decode with segment ids: the documents of the W = max(kda_conv_size - 1,
    1) positions before the chunk (the last one is the position whose state a KDA cache holds).
  tokens_BxT: the new tokens' ids, read by a layer with a value embedding (a per-token table
    added to its values, model.value_embed_layers).
  """

  self_mask_BxTxT: jax.Array
  past: KV | Callable[[KV], KV] | None = None
  past_mask_BxTxS: jax.Array | None = None
  read_past: Callable[[Any], KV] | None = None
  prefill_block: int | None = None
  num_new_B: jax.Array | None = None
  segment_ids_BxT: jax.Array | None = None
  tail_segment_ids_BxW: jax.Array | None = None
  tokens_BxT: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class CacheAndOwnChunk:
  """A decode context's past under a KV format: the cache entry followed by the chunk's own
  entry stored in the format (called with the chunk's entry, as any callable past). `cache` is
  kept for kernels that read the cache themselves (pallas_attention)."""

  cache: Any
  join: Callable[[Any], Any]

  def __call__(self, own):
    return self.join(own)


@dataclasses.dataclass(frozen=True)
class PagedKV:
  """A decode context's past held as pages and read through page tables, not as a dense cache
  (the engine's pool, looped/engine/paged_cache.py): K and V page pools [pages, page_size, K, H]
  (raw arrays, or QuantizedKV as kv_cache stores tokens) whose last page is a scratch page, and
  each row's page table [B, P] (slot s of row b lies at page_table_BxP[b, s // page_size],
  s % page_size). Attention reads it with pallas_kernels.paged_decode (pallas_attention.py);
  kv_cache.write_chunk writes the new tokens into their pages.

  A layer cached in C copies (per recurrence, a KV policy's copies) keeps them in one pool of
  C x pages (copy c's pages from c x pages on) and a table per copy, [C, B, P]: reading copy c
  indexes the table (`copy`) and never slices the pool, which as a kernel operand would be
  copied whole."""

  k_pages: Any
  v_pages: Any
  page_table_BxP: jax.Array

  @property
  def page_size(self) -> int:
    return jax.tree.leaves(self.k_pages)[0].shape[-3]

  @property
  def num_slots(self) -> int:
    """Slots each row's page table spans (a dense cache's max_len)."""
    return self.page_table_BxP.shape[-1] * self.page_size

  def copy(self, i) -> PagedKV:
    """Copy i of a layer cached in several copies: the same pools, copy i's page table."""
    return PagedKV(self.k_pages, self.v_pages, self.page_table_BxP[i])


jax.tree_util.register_dataclass(
  PagedKV, data_fields=["k_pages", "v_pages", "page_table_BxP"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class MixerCache:
  """What one layer of a mixer caches.

  token_shapes: the per-token entries, each a [K, H] slice (quantized one slice at a time by a
    KV format, along H); a cache holds one per slot.
  state_shapes: the per-sequence state (float32, never quantized), replaced by every chunk.
  """

  token_shapes: tuple[tuple[int, int], ...] = ()
  state_shapes: tuple[tuple[int, ...], ...] = ()

  def bytes_per_token(
    self, kv_format: str | None, raw_itemsize: float = 2, tensor_scales: bool = False
  ) -> float:
    """Bytes one token's entries take: in kv_format (block and vector scales included, see
    kv_quant.bytes_per_value), or raw at raw_itemsize bytes per value when kv_format is None.
    tensor_scales adds nvfp4's float32 tensor scale per token slice, which a cache that
    quantizes one token at a time (kv_cache.py, the engine's pages) stores and
    kv_quant.bytes_per_value leaves out."""
    total = 0.0
    for heads, width in self.token_shapes:
      if kv_format is None:
        total += heads * width * raw_itemsize
      else:
        total += heads * width * kv_quant.bytes_per_value(kv_format, width)
        if tensor_scales and kv_format == "nvfp4":
          total += TENSOR_SCALE_BYTES
    return total

  @property
  def values_per_token(self) -> int:
    return sum(math.prod(s) for s in self.token_shapes)

  @property
  def vectors_per_token(self) -> int:
    """Cached last-axis vectors per token (K and V heads for GQA)."""
    return sum(heads for heads, _ in self.token_shapes)

  @property
  def bytes_per_sequence(self) -> int:
    return STATE_BYTES * sum(math.prod(s) for s in self.state_shapes)


def gqa_cache(cfg) -> MixerCache:
  """Grouped-query attention: post-RoPE K and V of every token."""
  return MixerCache(token_shapes=((cfg.num_kv_heads, cfg.head_dim),) * 2)


def mla_cache(cfg) -> MixerCache:
  """Multi-head latent attention: the normalized latent c_kv and the decoupled RoPE key."""
  return MixerCache(token_shapes=((1, cfg.mla_kv_rank), (1, cfg.mla_rope_dim)))


def kda_cache(cfg) -> MixerCache:
  """Kimi delta attention: the delta-rule state and the short convolution's tail."""
  h, d = cfg.num_heads, cfg.head_dim
  return MixerCache(state_shapes=((h, d, d), (cfg.kda_conv_size - 1, 3 * h * d)))


@dataclasses.dataclass(frozen=True)
class LayerMacs:
  """Multiply-adds per token of one application of a layer's sequence mixer.

  weights: its projections (and KDA's depthwise conv, one multiply-add per weight);
  per_key: for each position the token attends over (scores and the weighted values);
  state: KDA's delta-rule update and read of its per-sequence state.
  """

  weights: int
  per_key: int = 0
  state: int = 0


@dataclasses.dataclass(frozen=True)
class Mixer:
  """Everything the code outside a mixer's layer needs of it: one record per mixer, registered
  by name in mixer_registry.py. Callers ask a capability (the boolean fields), never a name.

  Every function takes a cfg with the fields it reads (a ModelConfig, or the simulator's
  ModelShape).

  module, scope: the layer (a SequenceMixer) and its param scope in a Block (checkpoints name it).
  cache: what one layer caches (MixerCache); the layer's `mixer_cache`.
  macs: (cfg, absorbed) -> LayerMacs per token of one application (looped/model/flops.py;
    `absorbed`: the form cached calls run, where it differs).
  params: cfg -> stored values of one layer's mixer (matrices, norms, biases).
  entry_zeros: (cfg, batch, length) -> zeros shaped like the per-token entry a parallel forward
    returns (the Jacobi passes' first 'final K/V').

  pages_its_cache: per-token entries, which the engine stores in pages and KV formats quantize
    (else a per-sequence state, which neither does).
  attends: computes scores over the positions it reads (its cost grows with the context).
  kv_policies: can be cached under KV policies other than 'final' (kv_policy.py: several
    recurrences' entries, a recurrence reading another's).
  block_prefill: a parallel forward can run block prefill (reads the past as [shared-or-own ;
    own] under block masks, looped_lm.block_masks).
  paged_kernel: the engine's 'pallas' attention reads its pages in place
    (pallas_kernels.paged_decode) instead of gathering them into a dense cache.
  plain_attention: its parameters are a plain attention block's (query, key, value and output
    projections, optional q/k norms and biases): what the public looped families (Huginn,
    Ouro, Parcae) store, so their converters and exporters can map it.
  """

  name: str
  module: type
  scope: str
  cache: Callable[[Any], MixerCache]
  macs: Callable[[Any, bool], LayerMacs]
  params: Callable[[Any], int]
  entry_zeros: Callable[[Any, int, int], Any]
  pages_its_cache: bool
  attends: bool
  kv_policies: bool
  block_prefill: bool
  paged_kernel: bool
  plain_attention: bool


CAPABILITIES = tuple(f.name for f in dataclasses.fields(Mixer) if f.type == "bool")


@runtime_checkable
class SequenceMixer(Protocol):
  """A sequence-mixer layer (a Flax module built as Mixer(cfg, out_std)).

  Called with x_BxTxD, positions_BxT and a MixerContext; returns y_BxTxD and the layer's
  per-token entry for the cache (GQA: (k, v); MLA: (c_kv, k_rope); KDA: a KDARecord from
  parallel forwards, a KDAState from decode). `mixer_cache` is its record's `cache` (Mixer).
  """

  mixer_cache: ClassVar[Callable[[Any], MixerCache]]

  def __call__(self, x_BxTxD: jax.Array, positions_BxT: jax.Array, ctx: MixerContext) -> Any: ...
