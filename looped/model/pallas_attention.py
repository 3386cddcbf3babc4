"""model.attention_impl = 'pallas': the attention contexts LoopedLM builds, on pallas_kernels.

LoopedLM (looped_lm.py) builds three kinds of MixerContext; each maps onto one kernel:
  past is None        parallel causal attention              -> shared_attention, past = own K/V
  past is a function  parallel Jacobi / BeNice! pass, or quantized reads of the own past: the
                      past K/V (after read_past) at s < t, own K/V at s = t -> shared_attention;
                      with ctx.prefill_block C (block prefill) past(own) is [past ; own] and the
                      masks are the block ones -> shared_attention(prefill_block=C) on its
                      first T slots (raw K/V only: there read_past would also apply to the own
                      block's reads, which the kernel takes raw)
  past is a cache     decode / chunked prefill: slots < length, then the new chunk causally
                      -> paged_decode over the cache viewed as pages, still packed in its KV
                      format (dequantized inside the kernel; read_past is not applied); a
                      PagedKV past (the engine's pool) is read through its own page tables
The boolean masks are therefore not read, except for the decode lengths (the first row of the
past mask, a prefix of the cache); a context with other masks needs attention_impl='xla'.
Document masking: parallel contexts pass ctx.segment_ids_BxT to shared_attention (past and own
K/V hold the same positions); a decode context with segment ids is not one paged_decode handles
(its slots are a prefix, not a document), so `handles` says no and the layer uses its XLA math.

model.attention_impl = 'auto' (`uses_kernel`) takes the flash kernel where it is known to lower
and pay: the parallel contexts (training, evaluation, Jacobi and BeNice! passes) on GPU or TPU,
on one device (a pallas_call has no partitioning rule, so on a mesh GSPMD would gather its
operands), with Triton's tiles on GPU. Everything else (CPU, decode from a dense cache, block
prefill through a KV format) is the XLA math.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from looped import kv_quant
from looped.model.mixer_interface import CacheAndOwnChunk, MixerContext, PagedKV
from pallas_kernels import platform

_PAGE_SIZES = (64, 32, 16, 8, 4, 2, 1)


def _packed(x, pages=lambda a: a) -> pallas_kernels.PackedKV:
  """A cache entry (raw array or per-token QuantizedKV) as the kernel's PackedKV, each leaf
  passed through `pages` (a reshape into pages, or none for a pool already paged)."""
  if isinstance(x, kv_quant.QuantizedKV):
    leaves = [None if a is None else pages(a) for a in (x.data, x.scale, x.tensor_scale)]
    return pallas_kernels.PackedKV(*leaves, fmt=x.fmt)
  return pallas_kernels.PackedKV(pages(x))


def _as_pages(x, page_size: int) -> pallas_kernels.PackedKV:
  """A [B, S, ...] cache entry (raw array or per-token QuantizedKV) as [B*S/page, page, ...]."""
  return _packed(
    x, lambda a: a.reshape(a.shape[0] * a.shape[1] // page_size, page_size, *a.shape[2:])
  )


def _decode(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, ctx: MixerContext) -> jax.Array:
  past = ctx.past
  if isinstance(past, CacheAndOwnChunk):  # A cache in a KV format.
    if q_BxTxNxH.shape[1] > 1:
      raise ValueError(
        "attention_impl='pallas' decodes one token at a time from a cache in a KV format; a "
        "chunk reads its own earlier tokens through the format, which needs attention_impl='xla'."
      )
    past = past.cache
  # The cache's slots are a prefix of each row: the first row of the past mask counts them
  # (with a KV format and one token, the own-chunk columns after them are all False).
  lengths_B = jnp.sum(ctx.past_mask_BxTxS[:, 0, :], axis=-1, dtype=jnp.int32)
  if isinstance(past, PagedKV):  # The engine's pool, read through the rows' page tables.
    k_pages, v_pages = _packed(past.k_pages), _packed(past.v_pages)
    page_table_BxP = past.page_table_BxP
  else:  # A dense cache viewed as pages with an identity page table.
    cache_k, cache_v = past
    b, s = ctx.past_mask_BxTxS.shape[0], jax.tree.leaves(cache_k)[0].shape[1]
    page_size = next(p for p in _PAGE_SIZES if s % p == 0)
    page_table_BxP = jnp.arange(b * s // page_size, dtype=jnp.int32).reshape(b, s // page_size)
    k_pages, v_pages = _as_pages(cache_k, page_size), _as_pages(cache_v, page_size)
  return pallas_kernels.paged_decode(
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, k_pages, v_pages, page_table_BxP, lengths_B
  )


def _is_decode(ctx: MixerContext) -> bool:
  return ctx.past is not None and (not callable(ctx.past) or isinstance(ctx.past, CacheAndOwnChunk))


def is_paged(ctx: MixerContext) -> bool:
  """Whether ctx's past is a page pool (PagedKV), which only the kernel reads."""
  past = ctx.past.cache if isinstance(ctx.past, CacheAndOwnChunk) else ctx.past
  return isinstance(past, PagedKV)


def handles(ctx: MixerContext) -> bool:
  """Whether `attend` computes ctx on the kernels (not: decode with document masking)."""
  return not (_is_decode(ctx) and ctx.segment_ids_BxT is not None)


def _one_device() -> bool:
  """Whether the trace runs on one device: no ambient mesh (jax.set_mesh), or one of size 1."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


def _triton_tiles(head_dim: int, t: int) -> bool:
  """Whether Triton takes the kernel's tiles: [block, head_dim] dot operands, both powers of
  two of at least 16 (the default block is T's next power of two, at least 8: T > 8)."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and t > 8


def uses_kernel(attention_impl: str, ctx: MixerContext, head_dim: int, t: int) -> bool:
  """Whether a GQA layer computes ctx on the kernels under model.attention_impl (module
  docstring); a PagedKV past is read by the kernel whatever this says."""
  if attention_impl == "pallas":
    return handles(ctx)
  if attention_impl != "auto":
    return False
  device = platform.platform()
  if device == "cpu" or _is_decode(ctx) or not _one_device():
    return False
  if ctx.prefill_block is not None and ctx.read_past is not None:  # Needs 'xla' (attend).
    return False
  return device == "tpu" or _triton_tiles(head_dim, t)


def attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, ctx: MixerContext) -> jax.Array:
  """The attention output for ctx, as `attention.attend` computes it with ctx's masks."""
  if is_paged(ctx) and not handles(ctx):
    raise ValueError("A paged past (PagedKV) is read by paged_decode, without document masking.")
  if ctx.past is None:
    past_k, past_v = k_BxTxKxH, v_BxTxKxH
  elif callable(ctx.past) and not isinstance(ctx.past, CacheAndOwnChunk):
    past_k, past_v = ctx.past((k_BxTxKxH, v_BxTxKxH))
    if ctx.prefill_block is not None:
      if ctx.read_past is not None:
        raise ValueError(
          "attention_impl='pallas' block prefill reads raw K/V; with a kv_format the own "
          "block's reads go through the format too, which needs attention_impl='xla'."
        )
      t = q_BxTxNxH.shape[1]  # [past ; own] slots: the kernel reads the own K/V itself.
      past_k, past_v = past_k[:, :t], past_v[:, :t]
    if ctx.read_past is not None:
      past_k, past_v = ctx.read_past((past_k, past_v))
  else:
    return _decode(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, ctx)
  dtype = q_BxTxNxH.dtype
  return pallas_kernels.shared_attention(
    q_BxTxNxH,
    k_BxTxKxH.astype(dtype),
    v_BxTxKxH.astype(dtype),
    past_k.astype(dtype),
    past_v.astype(dtype),
    prefill_block=ctx.prefill_block,
    segment_ids_BxT=ctx.segment_ids_BxT,
  )
