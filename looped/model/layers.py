"""Building blocks shared by every layer: RMSNorm, RoPE, MLPs, initialisers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # Annotations only: the config imports the mixer registry, which imports this.
  from looped.model.config import ModelConfig


def normal_init(std: float):
  return nn.initializers.normal(stddev=std)


class Projection(nn.Module):
  """Bias-free linear map contracting `axis` of x with a kernel [x.shape[axis]..., features...].

  Like nn.DenseGeneral (same parameter name, shape, init values and math), but its kernel carries
  logical axis names, so one rule table (looped.sharding) decides how it is sharded on any mesh.
  """

  features: tuple[int, ...]
  axis: tuple[int, ...]
  axes: tuple[str | None, ...]  # Logical name of every kernel dimension (in dims, then out).
  std: float
  dtype: jnp.dtype
  param_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    axis = tuple(a % x.ndim for a in self.axis)
    shape = tuple(x.shape[a] for a in axis) + self.features
    if len(self.axes) != len(shape):
      raise ValueError(f"{self.name}: {len(self.axes)} logical axes {self.axes} for kernel {shape}")
    init = nn.with_logical_partitioning(normal_init(self.std), self.axes)
    kernel = self.param("kernel", init, shape, self.param_dtype)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.dtype)
    contract = (axis, tuple(range(len(axis))))
    return jax.lax.dot_general(x, kernel, (contract, ((), ())))


def projection(cfg: ModelConfig, features, std: float, name: str, *, axes, axis=-1) -> Projection:
  """Bias-free linear map in the model's compute/param dtypes (every matmul of the model).

  axes: logical names of the kernel's dimensions, e.g. ('embed', 'heads', 'head_dim').
  """
  features = (features,) if isinstance(features, int) else tuple(features)
  axis = (axis,) if isinstance(axis, int) else tuple(axis)
  return Projection(
    features, axis, tuple(axes), std, cfg.compute_dtype, cfg.weight_dtype, name=name
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


def rope_table(length: int, head_dim: int, base: float) -> jax.Array:
  """[length, head_dim/2, 2] (cos, sin) of rope's angles at positions 0..length-1."""
  half = head_dim // 2
  inv_freq_F = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles_SxF = jnp.arange(length, dtype=jnp.float32)[:, None] * inv_freq_F
  return jnp.stack([jnp.cos(angles_SxF), jnp.sin(angles_SxF)], axis=-1)


def rope(
  x_BxTxNxH: jax.Array,
  positions_BxT: jax.Array,
  base: float,
  table_SxFx2: jax.Array | None = None,
) -> jax.Array:
  """Rotary position embedding (rotate-half convention), computed in float32. With a table
  (rope_table's layout), cos and sin are read from it at the positions rather than computed:
  a checkpoint's stored table (e.g. rounded to bfloat16) is then used as its reference uses it."""
  if table_SxFx2 is None:
    half = x_BxTxNxH.shape[-1] // 2
    inv_freq_F = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles_BxTxF = positions_BxT[..., None].astype(jnp.float32) * inv_freq_F
    sin = jnp.sin(angles_BxTxF)[:, :, None, :]
    cos = jnp.cos(angles_BxTxF)[:, :, None, :]
  else:
    # Clipped: a position past the table (padding beyond max_seq_len) reads its last row, not NaN.
    cs_BxTxFx2 = jnp.take(table_SxFx2.astype(jnp.float32), positions_BxT, axis=0, mode="clip")
    cos, sin = cs_BxTxFx2[:, :, None, :, 0], cs_BxTxFx2[:, :, None, :, 1]
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
    dense = lambda n, std, name, axes: projection(cfg, n, std, name, axes=axes)
    up_BxTxF = dense(cfg.mlp_dim, cfg.init_std, "up", ("embed", "mlp"))(x_BxTxD)
    if cfg.mlp_type == "swiglu":
      gate_BxTxF = dense(cfg.mlp_dim, cfg.init_std, "gate", ("embed", "mlp"))(x_BxTxD)
      h_BxTxF = nn.silu(gate_BxTxF) * up_BxTxF
    else:
      h_BxTxF = jnp.square(nn.relu(up_BxTxF))
    h_BxTxF = nn.with_logical_constraint(h_BxTxF, ("batch", "length", "mlp"))
    return dense(cfg.d_model, self.out_std, "down", ("mlp", "embed"))(h_BxTxF)
