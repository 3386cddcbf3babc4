"""Building blocks shared by every layer: RMSNorm, RoPE, MLPs, initialisers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from looped.model.config import ModelConfig


def normal_init(std: float):
  return nn.initializers.normal(stddev=std)


def projection(cfg: ModelConfig, features, std: float, name: str, axis=-1) -> nn.DenseGeneral:
  """Bias-free linear map in the model's compute/param dtypes (every matmul of the model)."""
  return nn.DenseGeneral(
    features,
    axis=axis,
    use_bias=False,
    kernel_init=normal_init(std),
    dtype=cfg.compute_dtype,
    param_dtype=cfg.weight_dtype,
    name=name,
  )


class RMSNorm(nn.Module):
  """RMSNorm over the last axis with a learned scale (computed in float32)."""

  param_dtype: jnp.dtype = jnp.float32
  eps: float = 1e-6

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, base: float) -> jax.Array:
  """Rotary position embedding (rotate-half convention), computed in float32."""
  half = x_BxTxNxH.shape[-1] // 2
  inv_freq_F = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq_F
  sin = jnp.sin(angles_BxTxF)[:, :, None, :]
  cos = jnp.cos(angles_BxTxF)[:, :, None, :]
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


class Mlp(nn.Module):
  """SwiGLU or ReLU^2 feed-forward."""

  cfg: ModelConfig
  out_std: float

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.cfg
    dense = lambda n, std, name: projection(cfg, n, std, name)
    up_BxTxF = dense(cfg.mlp_dim, cfg.init_std, "up")(x_BxTxD)
    if cfg.mlp_type == "swiglu":
      gate_BxTxF = dense(cfg.mlp_dim, cfg.init_std, "gate")(x_BxTxD)
      h_BxTxF = nn.silu(gate_BxTxF) * up_BxTxF
    else:
      h_BxTxF = jnp.square(nn.relu(up_BxTxF))
    return dense(cfg.d_model, self.out_std, "down")(h_BxTxF)
