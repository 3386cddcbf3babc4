"""The throughput a training step is measured against: float32 n x n x n matmuls, one per device
at once, in the benchmarks' own process.

Each measurement warms up first and times its calls one by one (median): on the CPU backend the
first few calls after a training step run at 15-60% of the steady state (measured 2026-12-03,
2 cores), and an unwarmed limit makes every step look closer to it than it is.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


class MatmulLimit:
  """Times one float32 n^3 matmul per device of `mesh` (the default device when None)."""

  def __init__(self, mesh=None, n: int = 1024):
    self.devices = 1 if mesh is None else mesh.devices.size
    self.flops = self.devices * 2 * n**3
    x_DxNxN = jax.random.normal(jax.random.PRNGKey(1), (self.devices, n, n), jnp.float32)
    if mesh is not None:  # One matrix per device, split like the batch.
      spec = jax.sharding.PartitionSpec(tuple(mesh.axis_names))
      x_DxNxN = jax.device_put(x_DxNxN, jax.sharding.NamedSharding(mesh, spec))
    self._x = x_DxNxN
    self._matmul = jax.jit(lambda a: a @ a)
    self.seconds: list[float] = []

  def measure(self, repeats: int = 5, warmup: int = 5) -> None:
    """Adds `repeats` timed calls (each blocked on) after `warmup` untimed ones."""
    for _ in range(warmup):
      jax.block_until_ready(self._matmul(self._x))
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(self._matmul(self._x))
      self.seconds.append(time.perf_counter() - t0)

  def flops_per_s(self) -> float:
    """Median FLOP/s over every timed call so far."""
    return self.flops / statistics.median(self.seconds)
