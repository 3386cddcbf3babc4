"""In-kernel helpers shared by the kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kv_formats


def dot_f32(a, b, contract_a: int = 1, contract_b: int = 0):
  """2-D matmul accumulated in float32; float32 inputs use exact float32 products (no TF32 or
  bf16 passes), so interpret mode and GPU/TPU agree with the float32 references."""
  exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
  return lax.dot_general(
    a,
    b,
    (((contract_a,), (contract_b,)), ((), ())),
    precision=lax.Precision.HIGHEST if exact else None,
    preferred_element_type=jnp.float32,
  )


def past_mask(q_start, k_start, block_q: int, block_k: int):
  """[block_q, block_k] bool: key position s < query position t."""
  t = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
  s = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
  return s < t


def past_tile(leaf_refs, start, size: int, fmt: str | None, dtype):
  """Past K or V rows [start, start + size) as [size, D]; a packed past is dequantized here.

  Packed leaves (kernel layout, one row per token): data [T, H or H / 2], fp8 scale [T, 1],
  mx / nvfp4 scales [T, H / block], nvfp4 tensor scale [T, 1].
  """
  rows = pl.ds(start, size)
  data = leaf_refs[0][rows, :]
  if fmt is None:
    return data
  # Scales stay 2-D columns ([size, 1]), as TPU tiles them; values as kv_formats computes them.
  if fmt == "fp8":
    values = data.astype(jnp.float32) * leaf_refs[1][rows, :]
  else:
    scale = leaf_refs[1][rows, :] if len(leaf_refs) > 1 else None
    tensor_scale = leaf_refs[2][rows, :] if fmt == "nvfp4" else None
    values = kv_formats.dequantize(kv_formats.PackedKV(data, scale, tensor_scale, fmt))
  return values.astype(dtype)  # Rounded as a cache read would be.
