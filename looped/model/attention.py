"""GQA attention with RoPE and QK-norm, behind the sequence-mixer interface.

The layer (mixer_interface.SequenceMixer) returns post-RoPE keys and values as its cache entry;
its `MixerContext` says what the new tokens attend to (docs/design.md §3): nothing past (causal
within the chunk), a function of its own K/V (Jacobi and BeNice! passes), or the cache (decode,
chunked prefill). `attend` is the reference math; attention_impl='pallas' (and 'auto' on GPU/TPU,
pallas_attention.uses_kernel) routes through pallas_attention.py instead, and so does a past held
as pages (mixer_interface.PagedKV).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from looped.model import pallas_attention
from looped.model.layers import RMSNorm, projection, rope, rope_table
from looped.model.mixer_interface import KV, MixerContext, gqa_cache

if TYPE_CHECKING:  # Annotations only: the config imports the mixer registry, which imports this.
  from looped.model.config import ModelConfig


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


class ValueEmbedding(nn.Module):
  """Parcae's value embedding: 2 sigmoid(x[..., :G] W) * table[token], per KV head, a [K, H]
  vector per token added to a layer's values (so caches and shared reads hold it as any value).
  G = value_embed_gate_dim; x is the layer's normalized input."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array, tokens_BxT: jax.Array | None) -> jax.Array:
    cfg = self.cfg
    if tokens_BxT is None:
      raise ValueError("A layer with a value embedding needs MixerContext.tokens_BxT.")
    init = nn.with_logical_partitioning(
      nn.initializers.normal(cfg.init_std), ("vocab", "kv_heads", "head_dim")
    )
    table_VxKxH = self.param(
      "table", init, (cfg.vocab_size, cfg.num_kv_heads, cfg.head_dim), cfg.weight_dtype
    )
    gate = projection(cfg, cfg.num_kv_heads, cfg.init_std, "gate", axes=(None, "kv_heads"))
    gate_BxTxK = 2 * nn.sigmoid(gate(x_BxTxD[..., : cfg.value_embed_gate_dim]))
    ve_BxTxKxH = jnp.take(table_VxKxH, tokens_BxT, axis=0).astype(gate_BxTxK.dtype)
    return gate_BxTxK[..., None] * ve_BxTxKxH


class Attention(nn.Module):
  """Grouped-query attention: num_heads queries share num_kv_heads keys/values."""

  cfg: ModelConfig
  out_std: float
  value_embed: bool = False  # Adds this layer's value embedding (model.value_embed_layers).
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
    if self.value_embed:
      ve_BxTxKxH = ValueEmbedding(cfg, name="value_embed")(x_BxTxD, ctx.tokens_BxT)
      v_BxTxKxH = v_BxTxKxH + ve_BxTxKxH.astype(v_BxTxKxH.dtype)
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
      q_BxTxNxH = RMSNorm(cfg.weight_dtype, cfg.qk_norm_eps, name="query_norm")(q_BxTxNxH)
      k_BxTxKxH = RMSNorm(cfg.weight_dtype, cfg.qk_norm_eps, name="key_norm")(k_BxTxKxH)
    table_SxFx2 = None
    if cfg.rope_table:  # A fixed table (a converted checkpoint's buffer): read, never trained.
      init = lambda key, shape, dtype: rope_table(shape[0], cfg.head_dim, cfg.rope_base)
      table_SxFx2 = self.param(
        "rope_table",
        nn.with_logical_partitioning(init, (None, None, None)),
        (cfg.max_seq_len, cfg.head_dim // 2, 2),
        jnp.float32,
      )
      table_SxFx2 = jax.lax.stop_gradient(table_SxFx2)
    q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, cfg.rope_base, table_SxFx2)
    k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, cfg.rope_base, table_SxFx2)
    own = (k_BxTxKxH, v_BxTxKxH)

    # Flash / paged kernels; a page pool as the past (the engine's) is only read by the kernel.
    t = q_BxTxNxH.shape[1]
    kernel = pallas_attention.uses_kernel(cfg.attention_impl, ctx, cfg.head_dim, t)
    if kernel or pallas_attention.is_paged(ctx):
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
