"""Multi-head latent attention (MLA, DeepSeek-V2/V3) behind the sequence-mixer interface.

    q = (RMSNorm(x W_DQ)) W_UQ  (or x W_Q when mla_q_rank = 0)  -> [q_nope (H) ; q_rope (R)]
    [c_kv ; k_r] = x W_DKV,  c_kv <- RMSNorm(c_kv) [C],  k_r <- RoPE(k_r) [R] shared by heads
    k_nope = c_kv W_UK, v = c_kv W_UV  (per head, H wide)
    logits = (q_nope . k_nope + RoPE(q_rope) . k_r) / sqrt(H + R)

A token's cache entry is (c_kv, k_r), stored as [.., 1, C] and [.., 1, R] so the per-token
[K, H] slices of the KV-cache code (and its KV formats) apply unchanged. Parallel forwards
(training, Jacobi passes) use the expanded form; decode uses the absorbed form: q_nope W_UK^T
against the cached latents, output through W_UV. Both read the same entries, so under sharing
the core layers read the final recurrence's latent and RoPE key for s < t and the token's own
on the diagonal, as for GQA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from looped.model.layers import RMSNorm, normal_init, projection, rope
from looped.model.mixer_interface import MixerContext, mla_cache

if TYPE_CHECKING:  # Annotations only: the config imports the mixer registry, which imports this.
  from looped.model.config import ModelConfig

Entry = tuple[jax.Array, jax.Array]  # (c_kv_BxSx1xL, k_rope_BxSx1xY)


def _softmax_rows(logits_BxNxTxS, mask_BxTxS):
  """Masked softmax in float32; rows that see nothing are zeros (as attention.attend)."""
  mask = mask_BxTxS[:, None]
  logits = jnp.where(mask, logits_BxNxTxS, -jnp.inf)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  p = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
  return p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)


def _f32(*xs):
  return tuple(x.astype(jnp.float32) for x in xs)


def mla_expanded(
  q_nope_BxTxNxH, q_rope_BxTxNxY, c_BxSx1xL, k_rope_BxSx1xY, w_uk_LxNxH, w_uv_LxNxH, mask_BxTxS
):
  """MLA as ordinary multi-head attention on the up-projected keys and values."""
  q_nope, q_rope, c, k_rope, w_uk, w_uv = _f32(
    q_nope_BxTxNxH,
    q_rope_BxTxNxY,
    c_BxSx1xL[:, :, 0],
    k_rope_BxSx1xY[:, :, 0],
    w_uk_LxNxH,
    w_uv_LxNxH,
  )
  scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
  k_nope_BxSxNxH = jnp.einsum("bsc,cnh->bsnh", c, w_uk)
  v_BxSxNxH = jnp.einsum("bsc,cnh->bsnh", c, w_uv)
  logits = jnp.einsum("btnh,bsnh->bnts", q_nope, k_nope_BxSxNxH)
  logits = (logits + jnp.einsum("btnr,bsr->bnts", q_rope, k_rope)) * scale
  return jnp.einsum("bnts,bsnh->btnh", _softmax_rows(logits, mask_BxTxS), v_BxSxNxH)


def mla_absorbed(
  q_nope_BxTxNxH, q_rope_BxTxNxY, c_BxSx1xL, k_rope_BxSx1xY, w_uk_LxNxH, w_uv_LxNxH, mask_BxTxS
):
  """The same attention with W_UK absorbed into the query and W_UV applied after the sum, so
  the latents are read as they are cached (decode form)."""
  q_nope, q_rope, c, k_rope, w_uk, w_uv = _f32(
    q_nope_BxTxNxH,
    q_rope_BxTxNxY,
    c_BxSx1xL[:, :, 0],
    k_rope_BxSx1xY[:, :, 0],
    w_uk_LxNxH,
    w_uv_LxNxH,
  )
  scale = (q_nope.shape[-1] + q_rope.shape[-1]) ** -0.5
  q_latent_BxTxNxL = jnp.einsum("btnh,cnh->btnc", q_nope, w_uk)
  logits = jnp.einsum("btnc,bsc->bnts", q_latent_BxTxNxL, c)
  logits = (logits + jnp.einsum("btnr,bsr->bnts", q_rope, k_rope)) * scale
  out_latent_BxTxNxL = jnp.einsum("bnts,bsc->btnc", _softmax_rows(logits, mask_BxTxS), c)
  return jnp.einsum("btnc,cnh->btnh", out_latent_BxTxNxL, w_uv)


class MLA(nn.Module):
  """Multi-head latent attention with num_heads heads; see the module docstring.

  ctx (mixer_interface.MixerContext) as for GQA; a concrete ctx.past (a cache read)
  selects the absorbed form, None or a function of the own entries the expanded one.
  """

  cfg: ModelConfig
  out_std: float
  mixer_cache: ClassVar = staticmethod(mla_cache)

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, ctx: MixerContext) -> tuple[jax.Array, Entry]:
    cfg = self.cfg
    n, h, c, r = cfg.num_heads, cfg.head_dim, cfg.mla_kv_rank, cfg.mla_rope_dim
    if cfg.mla_q_rank:
      c_q = projection(cfg, cfg.mla_q_rank, cfg.init_std, "query_down", axes=("embed", None))(
        x_BxTxD
      )
      c_q = RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="query_norm")(c_q)
      q_BxTxNxE = projection(cfg, (n, h + r), cfg.init_std, "query_up", axes=(None, "heads", None))(
        c_q
      )
    else:
      q_BxTxNxE = projection(cfg, (n, h + r), cfg.init_std, "query", axes=("embed", "heads", None))(
        x_BxTxD
      )
    q_nope_BxTxNxH = q_BxTxNxE[..., :h]
    q_rope_BxTxNxY = rope(q_BxTxNxE[..., h:], positions_BxT, cfg.rope_base)
    kv_BxTxE = projection(cfg, c + r, cfg.init_std, "kv_down", axes=("embed", None))(x_BxTxD)
    c_BxTx1xL = RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="kv_norm")(kv_BxTxE[..., :c])[
      :, :, None, :
    ]
    k_rope_BxTx1xY = rope(kv_BxTxE[:, :, None, c:], positions_BxT, cfg.rope_base)
    own = (c_BxTx1xL, k_rope_BxTx1xY)
    up_init = nn.with_logical_partitioning(normal_init(cfg.init_std), (None, "heads", "head_dim"))
    up = lambda name: self.param(name, up_init, (c, n, h), cfg.weight_dtype)
    w_uk_LxNxH, w_uv_LxNxH = up("key_up"), up("value_up")

    absorbed = ctx.past is not None and not callable(ctx.past)
    past = ctx.past(own) if callable(ctx.past) else ctx.past
    if past is not None and ctx.read_past is not None:
      past = ctx.read_past(past)
    c_all, k_rope_all, mask = own[0], own[1], ctx.self_mask_BxTxT
    if past is not None:
      c_all = jnp.concatenate([past[0].astype(c_all.dtype), c_all], axis=1)
      k_rope_all = jnp.concatenate([past[1].astype(k_rope_all.dtype), k_rope_all], axis=1)
      mask = jnp.concatenate([ctx.past_mask_BxTxS, mask], axis=-1)
    form = mla_absorbed if absorbed else mla_expanded
    out_BxTxNxH = form(
      q_nope_BxTxNxH, q_rope_BxTxNxY, c_all, k_rope_all, w_uk_LxNxH, w_uv_LxNxH, mask
    ).astype(cfg.compute_dtype)
    y_BxTxD = projection(
      cfg, cfg.d_model, self.out_std, "out", axis=(-2, -1), axes=("heads", "head_dim", "embed")
    )(out_BxTxNxH)
    return y_BxTxD, own
