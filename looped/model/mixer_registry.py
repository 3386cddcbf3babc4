"""The registry of sequence mixers: one record (mixer_interface.Mixer) per mixer, by name.

A record holds a mixer's layer and param scope, what it caches, its multiply-adds and parameters,
the zero entry a parallel forward starts from, and its capabilities; the config's mixer names
(`*_mixers`) are this registry's keys, and callers outside the model ask a capability
(mixers.all_with / any_with), never a name.

The config imports this module and this module the layers, so the layers import the config for
their annotations only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

from looped.model.attention import Attention
from looped.model.kda import KDA, KDARecord
from looped.model.mixer_interface import (
  CAPABILITIES,
  LayerMacs,
  Mixer,
  MixerCache,
  gqa_cache,
  kda_cache,
  mla_cache,
)
from looped.model.mla import MLA


def token_entry_zeros(cache: Callable[[Any], MixerCache]):
  """entry_zeros of a mixer whose parallel entry is its cached per-token entries (one array per
  token shape, in the compute dtype)."""

  def zeros(cfg, batch: int, length: int):
    shapes = cache(cfg).token_shapes
    return tuple(jnp.zeros((batch, length, *s), cfg.compute_dtype) for s in shapes)

  return zeros


def gqa_macs(cfg, absorbed: bool = False) -> LayerMacs:
  """Q and O (N heads), K and V (K heads) projections; per key Q K^T and P V."""
  del absorbed  # One form.
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  return LayerMacs(d * h * (2 * n + 2 * cfg.num_kv_heads), per_key=2 * n * h)


def gqa_params(cfg) -> int:
  """The matrices plus the query and key norms and biases."""
  n, h, k = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads
  return gqa_macs(cfg).weights + 2 * h * cfg.qk_norm + (n + k) * h * cfg.qk_bias


def mla_macs(cfg, absorbed: bool = False) -> LayerMacs:
  """In the expanded form (training's parallel forward: keys and values projected up from the
  latent, per_key N (H + Y) + N H), or with `absorbed` in the form every cached call runs
  (decode, block prefill, the engine: W_UK folded into the query and W_UV applied after the
  sum, so the same 2 L N H weights per token and per_key N (L + Y) + N L over the latents as
  cached)."""
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  latent, rope = cfg.mla_kv_rank, cfg.mla_rope_dim
  if cfg.mla_q_rank:  # Down to the query latent, then up to every head's query.
    query = d * cfg.mla_q_rank + cfg.mla_q_rank * n * (h + rope)
  else:
    query = d * n * (h + rope)
  # kv_down to the latent and the shared RoPE key; key_up and value_up at every position; the
  # output projection.
  weights = query + d * (latent + rope) + 2 * latent * n * h + n * h * d
  if absorbed:  # Scores against the latent and the RoPE key; P times the latent.
    return LayerMacs(weights, per_key=n * (latent + rope) + n * latent)
  return LayerMacs(weights, per_key=n * (h + rope) + n * h)  # Scores (with RoPE); P V.


def mla_params(cfg) -> int:
  """The matrices plus kv_norm and (with low-rank queries) query_norm."""
  return mla_macs(cfg).weights + cfg.mla_kv_rank + cfg.mla_q_rank


def kda_macs(cfg, absorbed: bool = False) -> LayerMacs:
  """N heads of key width H and value width E = H, W conv taps: projections x -> q|k|v
  (D x 3NH), decay D x H then H x NH, beta D x N, output gate D x H then H x NH, output NH x D,
  and the conv (W x 3NH). Its recurrent form per token and head (kda.kda_recurrent) decays
  S [H, E] (elementwise, not counted), reads k^T S (H E), adds b k (v - k^T S)^T (H E) and reads
  q^T S (H E): state = 3 N H E multiply-adds."""
  del absorbed  # One form.
  d, n, h = cfg.d_model, cfg.num_heads, cfg.head_dim
  channels = 3 * n * h  # q, k, v.
  projections = d * channels + (d * h + h * n * h) * 2 + d * n + n * h * d
  return LayerMacs(projections + cfg.kda_conv_size * channels, state=3 * n * h * h)


def kda_params(cfg) -> int:
  """The matrices and conv plus A_log, dt_bias, the output gate's bias and out_norm."""
  n, h = cfg.num_heads, cfg.head_dim
  return kda_macs(cfg).weights + n + 2 * n * h + h


def kda_entry_zeros(cfg, batch: int, length: int) -> KDARecord:
  """A KDARecord of zeros: pre-conv projections (compute dtype), decay and beta (float32)."""
  h, d = cfg.num_heads, cfg.head_dim
  return KDARecord(
    jnp.zeros((batch, length, 3 * h * d), cfg.compute_dtype),
    jnp.zeros((batch, length, h, d), jnp.float32),
    jnp.zeros((batch, length, h), jnp.float32),
  )


GQA_MIXER = Mixer(
  name="gqa",
  module=Attention,
  scope="attn",
  cache=gqa_cache,
  macs=gqa_macs,
  params=gqa_params,
  entry_zeros=token_entry_zeros(gqa_cache),
  pages_its_cache=True,
  attends=True,
  kv_policies=True,
  block_prefill=True,
  paged_kernel=True,
  plain_attention=True,
)
MLA_MIXER = Mixer(
  name="mla",
  module=MLA,
  scope="mla",
  cache=mla_cache,
  macs=mla_macs,
  params=mla_params,
  entry_zeros=token_entry_zeros(mla_cache),
  pages_its_cache=True,
  attends=True,
  kv_policies=True,
  block_prefill=True,
  paged_kernel=False,  # Its latent cache is gathered (the kernel reads K/V heads).
  plain_attention=False,  # Low-rank latent projections and a decoupled RoPE key.
)
KDA_MIXER = Mixer(
  name="kda",
  module=KDA,
  scope="kda",
  cache=kda_cache,
  macs=kda_macs,
  params=kda_params,
  entry_zeros=kda_entry_zeros,
  pages_its_cache=False,  # A per-sequence state, held in state slots.
  attends=False,
  kv_policies=False,  # One state per sequence: the final recurrence's.
  block_prefill=False,  # The chunkwise form reads no block past.
  paged_kernel=False,
  plain_attention=False,  # A delta-rule state, a decay and a short convolution.
)

REGISTRY: dict[str, Mixer] = {m.name: m for m in (GQA_MIXER, MLA_MIXER, KDA_MIXER)}


def get(name: str) -> Mixer:
  """The record of mixer `name`; a ValueError names the known ones."""
  if name not in REGISTRY:
    raise ValueError(f"unknown mixer {name!r}; the mixers are {', '.join(REGISTRY)}.")
  return REGISTRY[name]


def names_with(capability: str, value: bool = True) -> tuple[str, ...]:
  """The registered mixers whose `capability` is `value` (for messages and per-mixer tables)."""
  if capability not in CAPABILITIES:
    raise ValueError(f"unknown mixer capability {capability!r}; they are {CAPABILITIES}.")
  return tuple(name for name, m in REGISTRY.items() if getattr(m, capability) == value)
