"""GQA attention with RoPE and QK-norm, behind the sequence-mixer interface.

The layer (mixer_interface.SequenceMixer) returns post-RoPE keys and values as its cache entry;
its `MixerContext` says what the new tokens attend to (docs/design.md §3): nothing past (causal
within the chunk), a function of its own K/V (Jacobi and BeNice! passes), or the cache (decode,
chunked prefill). `attend` is the reference math; attention_impl='pallas' routes through
pallas_attention.py instead.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from looped.model import pallas_attention
from looped.model.config import ModelConfig
from looped.model.layers import RMSNorm, projection, rope
from looped.model.mixer_interface import KV, MixerContext, gqa_cache


def attend(
  q_BxTxNxH: jax.Array,
  k_BxTxKxH: jax.Array,
  v_BxTxKxH: jax.Array,
  self_mask_BxTxT: jax.Array,
  past_k_BxSxKxH: jax.Array | None = None,
  past_v_BxSxKxH: jax.Array | None = None,
  past_mask_BxTxS: jax.Array | None = None,
) -> jax.Array:
  """Softmax attention over [past slots ; own chunk] with boolean masks (reference math).

  Rows that see nothing return zeros (never NaN). Logits and softmax in float32.
  """
  b, t, n, h = q_BxTxNxH.shape
  kh = k_BxTxKxH.shape[2]
  g = n // kh
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, g, h).astype(jnp.float32) * (h**-0.5)
  keys, values, masks = [k_BxTxKxH], [v_BxTxKxH], [self_mask_BxTxT]
  if past_k_BxSxKxH is not None:
    keys.insert(0, past_k_BxSxKxH)
    values.insert(0, past_v_BxSxKxH)
    masks.insert(0, past_mask_BxTxS)
  k_BxSxKxH = jnp.concatenate(keys, axis=1).astype(jnp.float32)
  v_BxSxKxH = jnp.concatenate(values, axis=1).astype(jnp.float32)
  mask_BxTxS = jnp.concatenate(masks, axis=-1)
  logits_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH)
  mask = mask_BxTxS[:, None, None, :, :]
  logits_BxKxGxTxS = jnp.where(mask, logits_BxKxGxTxS, -jnp.inf)
  row_max = jnp.max(logits_BxKxGxTxS, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(logits_BxKxGxTxS - row_max), 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  out_BxTxKxGxH = jnp.einsum("bkgts,bskh->btkgh", p, v_BxSxKxH)
  return out_BxTxKxGxH.reshape(b, t, n, h).astype(q_BxTxNxH.dtype)


class Attention(nn.Module):
  """Grouped-query attention: num_heads queries share num_kv_heads keys/values."""

  cfg: ModelConfig
  out_std: float
  mixer_cache: ClassVar = staticmethod(gqa_cache)

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, ctx: MixerContext) -> tuple[jax.Array, KV]:
    cfg = self.cfg
    proj = lambda heads, name, axis: projection(
      cfg, (heads, cfg.head_dim), cfg.init_std, name, axes=("embed", axis, "head_dim")
    )
    q_BxTxNxH = proj(cfg.num_heads, "query", "heads")(x_BxTxD)
    k_BxTxKxH = proj(cfg.num_kv_heads, "key", "kv_heads")(x_BxTxD)
    v_BxTxKxH = proj(cfg.num_kv_heads, "value", "kv_heads")(x_BxTxD)
    q_BxTxNxH = nn.with_logical_constraint(q_BxTxNxH, ("batch", "length", "heads", "head_dim"))
    if cfg.qk_bias:
      bias = lambda name, heads, axis: self.param(
        name,
        nn.with_logical_partitioning(nn.initializers.zeros, (axis, "head_dim")),
        (heads, cfg.head_dim),
        cfg.weight_dtype,
      )
      q_BxTxNxH = q_BxTxNxH + bias("query_bias", cfg.num_heads, "heads").astype(q_BxTxNxH.dtype)
      k_BxTxKxH = k_BxTxKxH + bias("key_bias", cfg.num_kv_heads, "kv_heads").astype(k_BxTxKxH.dtype)
    if cfg.qk_norm:
      q_BxTxNxH = RMSNorm(cfg.weight_dtype, name="query_norm")(q_BxTxNxH)
      k_BxTxKxH = RMSNorm(cfg.weight_dtype, name="key_norm")(k_BxTxKxH)
    q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, cfg.rope_base)
    k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, cfg.rope_base)
    own = (k_BxTxKxH, v_BxTxKxH)

    if cfg.attention_impl == "pallas" and pallas_attention.handles(ctx):  # Flash / paged.
      out_BxTxNxH = pallas_attention.attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, ctx)
    else:
      past = ctx.past(own) if callable(ctx.past) else ctx.past
      if past is not None and ctx.read_past is not None:
        past = ctx.read_past(past)
      past_k, past_v = past if past is not None else (None, None)
      out_BxTxNxH = attend(
        q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, ctx.self_mask_BxTxT, past_k, past_v, ctx.past_mask_BxTxS
      )
    out_BxTxNxH = nn.with_logical_constraint(out_BxTxNxH, ("batch", "length", "heads", "head_dim"))
    y_BxTxD = projection(
      cfg, cfg.d_model, self.out_std, "out", axis=(-2, -1), axes=("heads", "head_dim", "embed")
    )(out_BxTxNxH)
    return y_BxTxD, own
