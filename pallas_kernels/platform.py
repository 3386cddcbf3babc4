"""Which Pallas lowering a kernel uses, and its default block sizes, by platform.

CPU has no Pallas backend: kernels run in interpret mode (the kernel body traced as ordinary JAX
over the grid), which is what the tests exercise. GPU lowers through Pallas Triton, TPU through
Mosaic. The same kernel bodies serve all three.
"""

from __future__ import annotations

import jax

# (block_q, block_k) for the shared-cache flash attention, per platform. Interpret mode runs the
# grid as a loop of XLA ops, so small blocks only cost loop trips; accelerators want MXU/tensor-
# core sized tiles.
FLASH_BLOCKS = {"cpu": (32, 32), "gpu": (64, 64), "tpu": (128, 128)}


def platform() -> str:
  """'cpu', 'gpu' or 'tpu' (the default backend)."""
  backend = jax.default_backend()
  return backend if backend in ("gpu", "tpu") else "cpu"


VARIANTS = ("generic", "tpu")


def variant_default(variant: str | None) -> str:
  """Which kernel variant: 'generic' (one body for interpret, Triton, Mosaic) or 'tpu' (blocks
  pipelined by Mosaic through BlockSpecs). None means 'tpu' exactly on TPU."""
  if variant is None:
    return "tpu" if platform() == "tpu" else "generic"
  if variant not in VARIANTS:
    raise ValueError(f"Unknown kernel variant {variant!r}; allowed: {VARIANTS}.")
  return variant


def interpret_default(interpret, variant: str = "generic"):
  """interpret=None means: interpret exactly when there is no accelerator. For the 'tpu'
  variant, interpret=True is Pallas' TPU interpreter (simulated VMEM and DMAs, uninitialized
  memory NaN, out-of-bounds reads raise); an `InterpretParams` passes through."""
  if interpret is None:
    interpret = platform() == "cpu"
  if not isinstance(interpret, bool):
    return interpret
  if interpret and variant == "tpu":
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams()
  return interpret


def compiler_params(interpret: bool, num_warps: int = 4, num_stages: int = 2):
  """Backend-specific pallas_call compiler params (None in interpret mode)."""
  if interpret:
    return None
  if platform() == "gpu":
    from jax.experimental.pallas import triton as pltriton

    # Passing Triton params selects the Triton lowering over Mosaic GPU.
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  if platform() == "tpu":
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.CompilerParams()
  return None
