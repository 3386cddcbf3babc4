"""Model FLOPs utilisation: a step's model FLOPs over the time it took and the mesh's peak.

The peak of an accelerator is its vendor's dense bf16 matmul figure, looked up by
`device.device_kind`; on the CPU backend, which has no such figure, it is the float32 matmul
throughput measured at start-up (`MatmulLimit`, well under 2 s). `train.peak_tflops` overrides
both (per device). An unknown accelerator has no peak, and MFU is then left out of the logs.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import logging

# Dense (no structured sparsity) bf16 peak TFLOP/s per JAX device, by a substring of its
# device_kind, first match wins (so 'TPU v5 lite' is tried before 'TPU v5'). Sources:
#   H100 / H200 SXM: NVIDIA H100 datasheet, BF16 Tensor Core 1,979 TFLOPS "with sparsity",
#     half of it dense (nvidia.com/en-us/data-center/h100); the H200 has the same Hopper die
#     and figure (nvidia.com/en-us/data-center/h200). H100 PCIe: 1,513 sparse, 756 dense.
#   A100 (SXM4 and PCIe): NVIDIA A100 datasheet, BF16 Tensor Core 312 TFLOPS dense.
#   TPU v4: 275 TFLOPs per chip (cloud.google.com/tpu/docs/v4; one JAX device per chip).
#   TPU v5e ('TPU v5 lite'): 197 TFLOPs per chip (cloud.google.com/tpu/docs/v5e).
#   TPU v5p ('TPU v5'): 459 TFLOPs per chip (cloud.google.com/tpu/docs/v5p).
#   TPU v6e ('TPU v6 lite', Trillium): 918 TFLOPs per chip (cloud.google.com/tpu/docs/v6e).
PEAK_TFLOPS = (
  ("H100 PCIe", 756.0),
  ("H100", 989.0),
  ("H200", 989.0),
  ("A100", 312.0),
  ("TPU v4", 275.0),
  ("TPU v5 lite", 197.0),
  ("TPU v5e", 197.0),
  ("TPU v5p", 459.0),
  ("TPU v5", 459.0),
  ("TPU v6 lite", 918.0),
  ("TPU v6e", 918.0),
)


def known_peak_tflops(device_kind: str) -> float | None:
  """The table's dense bf16 TFLOP/s for a device_kind, or None when it is not listed."""
  for name, tflops in PEAK_TFLOPS:
    if name.lower() in device_kind.lower():
      return tflops
  return None


class MatmulLimit:
  """Times one float32 n^3 matmul per device of `mesh` (the default device when None).

  Each measurement warms up first and times its calls one by one (median): on the CPU backend
  the first few calls after a training step run at 15-60% of the steady state (measured
  2026-12-03, 2 cores), and an unwarmed limit makes every step look closer to it than it is.
  """

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


def mesh_peak_flops(mesh, peak_tflops: float = 0.0) -> tuple[float | None, str]:
  """(peak FLOP/s of all of `mesh`'s devices together, where the figure comes from).

  peak_tflops > 0: that, per device. Else the table's figure for the devices' kind; on CPU the
  measured matmul limit of the whole mesh (512^3 matmuls, one per device at once, ~0.3 s on 2
  cores); None for an accelerator the table does not list.
  """
  devices = mesh.devices.size
  if peak_tflops > 0:
    return peak_tflops * 1e12 * devices, f"train.peak_tflops = {peak_tflops:g} per device"
  device = mesh.devices.flat[0]
  if device.platform == "cpu":
    limit = MatmulLimit(mesh, n=512)
    limit.measure(repeats=5, warmup=3)
    return limit.flops_per_s(), "float32 matmul throughput measured at start-up (CPU)"
  tflops = known_peak_tflops(device.device_kind)
  if tflops is None:
    logging.warning(
      "No peak TFLOP/s known for device kind %r: MFU is not logged (set train.peak_tflops).",
      device.device_kind,
    )
    return None, f"unknown device kind {device.device_kind!r}"
  return tflops * 1e12 * devices, f"{device.device_kind}: {tflops:g} bf16 TFLOP/s per device"


def mfu(flops_per_step: float, seconds_per_step: float, peak_flops: float) -> float:
  """The fraction of the peak a step's model FLOPs reach in the time it took."""
  return flops_per_step / seconds_per_step / peak_flops
