"""The kernels lower through Pallas Triton for a CUDA target, on a machine without a GPU.

`jit(...).trace(...).lower(lowering_platforms=('cuda',))` runs the whole Pallas -> Triton IR
lowering (sm_90 when no GPU is present), which rejects unsupported primitives, dtypes and block
shapes. It does not compile to PTX or run anything: numerics are checked in interpret mode by the
other pallas_* tests. Shapes are the benchmark's (head dim 128, bf16).

The TPU variants lower the same way for a TPU target (device kind mocked as a TPU v5p, which
the Pallas -> Mosaic lowering reads for its tiling): that runs Pallas' block-shape checks and
lowers every primitive of the kernel to Mosaic MLIR, serialized into a `tpu_custom_call`. The
Mosaic compiler proper (layout inference, VMEM allocation) is in libtpu and is not run.
"""

from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax._src.pallas.mosaic import tpu_info

import pallas_kernels
from pallas_kernels import PackedKV, platform

S = jax.ShapeDtypeStruct


def _triton_calls(fn, *args) -> int:
  with mock.patch.object(platform, "platform", lambda: "gpu"):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  return lowered.as_text().count("__gpu$xla.gpu.triton")


def _mosaic_calls(fn, *args) -> int:
  with (
    mock.patch.object(platform, "platform", lambda: "tpu"),
    mock.patch.object(tpu_info, "get_device_kind", lambda: "TPU v5p"),
    mock.patch.object(tpu_info, "get_num_device_cores", lambda: 1),
  ):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
  return lowered.as_text().count("tpu_custom_call")


def _pages(fmt, pages=8, page_size=64, heads=4, d=128):
  lead = (pages, page_size, heads)
  if fmt == "bf16":
    return PackedKV(S((*lead, d), jnp.bfloat16), fmt=fmt)
  if fmt == "fp8":
    return PackedKV(S((*lead, d), jnp.float8_e4m3fn), S(lead, jnp.float32), fmt=fmt)
  if fmt.startswith("mxfp8"):
    return PackedKV(S((*lead, d), jnp.float8_e4m3fn), S((*lead, d // 32), jnp.uint8), fmt=fmt)
  scale = S((*lead, d // 16), jnp.float8_e4m3fn)
  return PackedKV(S((*lead, d // 2), jnp.uint8), scale, S(lead[:2], jnp.float32), fmt=fmt)


class _LoweringCases(parameterized.TestCase):
  """Every kernel lowered for one target; `calls(fn, *args)` counts its custom calls."""

  calls = None

  def test_shared_attention_forward_and_backward(self):
    q, kv = S((1, 256, 8, 128), jnp.bfloat16), S((1, 256, 4, 128), jnp.bfloat16)
    attention = lambda *a: pallas_kernels.shared_attention(*a, interpret=False)
    grads = jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    self.assertEqual(type(self).calls(attention, q, kv, kv, kv, kv), 1)
    self.assertEqual(type(self).calls(grads, q, kv, kv, kv, kv), 3)  # fwd, dq, dk/dv.

  @parameterized.parameters("fp8", "mxfp8", "nvfp4")
  def test_shared_attention_packed_past(self, fmt):
    q, kv = S((1, 256, 8, 128), jnp.bfloat16), S((1, 256, 4, 128), jnp.bfloat16)
    past = _pages(fmt, pages=1, page_size=256)  # Leaves [B, T, K, ...] (tensor scale [B, T]).
    attention = lambda q, k, v, kp, vp: pallas_kernels.shared_attention(
      q, k, v, kp, vp, interpret=False
    )
    grads = jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    self.assertEqual(type(self).calls(grads, q, kv, kv, past, past), 2)  # fwd, dq (no past grad).

  @parameterized.parameters(64, 96)  # Block prefill: C a multiple of the tiles, and not.
  def test_shared_attention_block_prefill(self, c):
    q, kv = S((1, 256, 8, 128), jnp.bfloat16), S((1, 256, 4, 128), jnp.bfloat16)
    attention = lambda *a: pallas_kernels.shared_attention(*a, interpret=False, prefill_block=c)
    grads = jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    self.assertEqual(type(self).calls(attention, q, kv, kv, kv, kv), 1)
    self.assertEqual(type(self).calls(grads, q, kv, kv, kv, kv), 3)  # fwd, dq, dk/dv (both).

  @parameterized.parameters(None, 96)  # Document masking, plain and block form.
  def test_shared_attention_segment_ids(self, c):
    q, kv = S((1, 256, 8, 128), jnp.bfloat16), S((1, 256, 4, 128), jnp.bfloat16)
    seg = S((1, 256), jnp.int32)
    attention = lambda q, k, v, kp, vp, seg: pallas_kernels.shared_attention(
      q, k, v, kp, vp, interpret=False, prefill_block=c, segment_ids_BxT=seg
    )
    grads = jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    self.assertEqual(type(self).calls(attention, q, kv, kv, kv, kv, seg), 1)
    self.assertEqual(type(self).calls(grads, q, kv, kv, kv, kv, seg), 3)  # fwd, dq, dk/dv.

  def test_shared_attention_block_prefill_packed_past(self):
    q, kv = S((1, 256, 8, 128), jnp.bfloat16), S((1, 256, 4, 128), jnp.bfloat16)
    past = _pages("fp8", pages=1, page_size=256)
    attention = lambda q, k, v, kp, vp: pallas_kernels.shared_attention(
      q, k, v, kp, vp, interpret=False, prefill_block=96
    )
    grads = jax.grad(lambda *a: jnp.sum(attention(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    # fwd, dq, and the key-tile kernel for the own K/V's in-block reads (no past gradient).
    self.assertEqual(type(self).calls(grads, q, kv, kv, past, past), 3)

  @parameterized.parameters((3, 3), (12, 2), (24, 1))
  def test_paged_decode_chunk(self, t, group):
    """Chunks whose query rows (T x G) or own tokens are not a power of two (Triton pads)."""
    q, kv = S((2, t, 2 * group, 64), jnp.bfloat16), S((2, t, 2, 64), jnp.bfloat16)
    table, lengths = S((2, 2), jnp.int32), S((2,), jnp.int32)
    decode = lambda *a: pallas_kernels.paged_decode(*a, interpret=False)
    pages = _pages("bf16", pages=7, page_size=16, heads=2, d=64)
    self.assertEqual(type(self).calls(decode, q, kv, kv, pages, pages, table, lengths), 1)

  @parameterized.parameters("bf16", "fp8", "mxfp8", "nvfp4")
  def test_paged_decode(self, fmt):
    q, kv = S((4, 1, 16, 128), jnp.bfloat16), S((4, 1, 4, 128), jnp.bfloat16)
    table, lengths = S((4, 2), jnp.int32), S((4,), jnp.int32)
    decode = lambda *a: pallas_kernels.paged_decode(*a, interpret=False)
    pages = _pages(fmt)
    self.assertEqual(type(self).calls(decode, q, kv, kv, pages, pages, table, lengths), 1)


class TritonLoweringTest(_LoweringCases):
  calls = staticmethod(_triton_calls)


class MosaicLoweringTest(_LoweringCases):
  """The TPU variants (the default on TPU) through Pallas -> Mosaic for a TPU target."""

  calls = staticmethod(_mosaic_calls)

  def test_tpu_is_the_default_variant_on_tpu(self):
    with mock.patch.object(platform, "platform", lambda: "tpu"):
      self.assertEqual(platform.variant_default(None), "tpu")
    self.assertEqual(platform.variant_default(None), "generic")  # CPU here.
    with self.assertRaisesRegex(ValueError, "Unknown kernel variant"):
      platform.variant_default("triton")


del _LoweringCases  # Only its subclasses run (unittest would collect the base too).

if __name__ == "__main__":
  absltest.main()
