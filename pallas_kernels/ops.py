"""In-kernel helpers shared by the kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


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
