"""Quantized storage for K/V vectors: bf16, fp8, mxfp8 (OCP MX, two scale roundings), nvfp4.

Every KV cache in the project stores its pages through `quantize` and reads them through
`dequantize` (docs/design.md §4: quantization is evaluated by running the real round trip on
every cache read). Values are quantized along the last axis (the head dim); leading axes are
arbitrary ([..., heads, head_dim], [pages, page_size, heads, head_dim], ...).

Formats (FORMATS):
  bf16         bfloat16 elements, no scale.
  fp8          float8_e4m3fn elements, one float32 scale per last-axis vector: absmax / 448.
  mxfp8        OCP Microscaling v1.0: e4m3 elements, one E8M0 scale per 32 values with exponent
               floor(log2(amax)) - 8 (8 = emax of e4m3), elements saturated to +-448.
  mxfp8_rceil  Same storage; scale 2^ceil(log2(amax / 448)), the rounding of NVIDIA's hardware
               conversion (cvt.rp.satfinite.ue8m0), with TransformerEngine's reciprocal rules.
  nvfp4        float4_e2m1fn elements packed two per byte, one e4m3 scale per 16 values, one
               float32 per-tensor scale amax / (448 * 6) over the array passed to `quantize`
               (the caller picks the granularity: a page, a layer) or a calibrated one.

Numerics are bit-exact with torchao's reference implementation (torchao.prototype.mx_formats:
`to_mx` FLOOR/RCEIL and `nvfp4_quantize`, with their dequantizers), including NaN/Inf, except
where torchao departs from the format's definition (tests/kv_quant_test.py lists each case):
  * mxfp8 blocks whose scale is 2^-127 (amax < 2^-118): torchao divides by 2^-126 (a
    compiler workaround it documents) but multiplies back by 2^-127, halving such values; we
    divide by the stored 2^-127 as the OCP spec says.
  * mxfp8_rceil: torchao's eager fallback takes ceil of a float32 log2, which rounds to the
    power of two when amax / 448 is a few ulps above it; we take the exact ceil from the bits,
    as the hardware instruction does.
  * nvfp4: the per-tensor scale is floored at 2^-114 (_NVFP4_MIN_TENSOR_SCALE); torchao turns
    an all-zero tensor into NaN (0 / 0), here it stays zero.
XLA on CPU flushes float32 subnormals to zero in arithmetic while torch does not; power-of-two
scalings therefore go through explicit bit manipulation wherever a subnormal can reach a stored
or returned value, and the fp8 per-vector scale is floored at 2^-100 so that no subnormal
arises at all.

NaN/Inf (torchao's behaviour, reproduced; fp8 follows from its formula the same way):
  fp8    a NaN or Inf makes its scale non-finite and its whole vector NaN; other vectors are
         unaffected.
  mxfp8  a NaN makes its block NaN (scale byte 0xFF). An Inf keeps its sign and comes back as
         Inf; its block scale becomes 2^120 (mxfp8, the exponent field of Inf) or 2^127
         (mxfp8_rceil, byte 0xFE), so block neighbours below 2^110 (resp. 2^117) round to 0.
  nvfp4  with the computed tensor scale, a NaN or Inf anywhere makes the whole array NaN (the
         tensor scale is non-finite). With a finite calibrated tensor scale a NaN makes its
         block NaN and an Inf saturates to +-6 * 448 * tensor_scale.

Storage accounting: `bytes_per_value` counts elements and block/vector scales. The single
float32 nvfp4 tensor scale (4 bytes per quantized array) is excluded: it is amortised over a page
or a layer, whichever the caller quantizes at once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from pallas_kernels.kv_formats import e2m1_decode, from_bits, mul_pow2_exact, pow2, to_bits

FORMATS = ("bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4")

# Values per scale along the head dim (fp8's per-vector scale spans the whole head dim).
BLOCK_SIZES = {"mxfp8": 32, "mxfp8_rceil": 32, "nvfp4": 16}

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_E4M3_MIN_NORMAL = 2.0**-6  # Floor of nvfp4 block scales (torchao's E4M3_EPS).
_FP8_MIN_SCALE = 2.0**-100  # fp8 per-vector scale floor: keeps all intermediates normal.
# nvfp4 tensor-scale floor: with tensor scale >= 2^-114 every float32 intermediate of the
# quantizer and dequantizer is normal or irrelevant (it rounds to 0 in e2m1), so flushing
# subnormals (XLA) and keeping them (torch) give the same bits. Only tensors with amax < 1.3e-31
# (or a smaller calibrated scale) are affected.
_NVFP4_MIN_TENSOR_SCALE = 2.0**-114

_F32_ABS = np.int32(0x7FFFFFFF)
_F32_MANT = np.int32(0x007FFFFF)
_F32_INF_BITS = np.int32(0x7F800000)
# Smallest float32 amax whose IEEE quotient amax / 448 (with gradual underflow) exceeds 2^-127:
# 448 * (2^-127 + 2^-150) rounded up to float32 (exact rational derivation in the test).
_RCEIL_SUBNORMAL_THRESHOLD_BITS = np.int32(0x04600002)


@struct.dataclass
class QuantizedKV:
  """Quantized K or V values: a pytree whose leaves are the stored arrays.

  Attributes:
    data: elements, shape [..., D] (bf16 / float8_e4m3fn) or [..., D // 2] uint8 for nvfp4
      (element 2i in the low nibble, 2i+1 in the high nibble).
    scale: None (bf16); float32 [...] (fp8); uint8 biased E8M0 exponents [..., D // 32]
      (mxfp8*; 255 = NaN); float8_e4m3fn [..., D // 16] (nvfp4).
    tensor_scale: float32 scalar for nvfp4, else None.
    fmt: the format name (static metadata, not a leaf).
  """

  data: jax.Array
  scale: jax.Array | None
  tensor_scale: jax.Array | None
  fmt: str = struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the unquantized array."""
    if self.fmt == "nvfp4":
      return (*self.data.shape[:-1], self.data.shape[-1] * 2)
    return tuple(self.data.shape)


def check_format(fmt: str, head_dim: int | None = None) -> None:
  """Raises ValueError naming the problem if `fmt` (with `head_dim`) cannot be stored."""
  if fmt not in FORMATS:
    raise ValueError(f"Unknown KV format {fmt!r}; allowed: {', '.join(map(repr, FORMATS))}.")
  if head_dim is None:
    return
  if not isinstance(head_dim, (int, np.integer)) or head_dim <= 0:
    raise ValueError(f"head_dim must be a positive integer, got {head_dim!r}.")
  block = BLOCK_SIZES.get(fmt)
  if block and head_dim % block:
    raise ValueError(
      f"KV format {fmt!r} needs head_dim (the last axis) to be a multiple of its block size "
      f"{block}; got {head_dim}. Formats without that constraint: 'bf16', 'fp8'."
    )


def bytes_per_value(fmt: str, head_dim: int) -> float:
  """Bytes one stored K or V value takes, block/vector scales included.

  Excludes nvfp4's single float32 tensor scale, amortised over whatever array is quantized at
  once (a page, a layer): add 4 bytes per such array.
  """
  check_format(fmt, head_dim)
  if fmt == "bf16":
    return 2.0
  if fmt == "fp8":
    return 1.0 + 4.0 / head_dim
  if fmt in ("mxfp8", "mxfp8_rceil"):
    return 1.0 + 1.0 / BLOCK_SIZES[fmt]
  return 0.5 + 1.0 / BLOCK_SIZES[fmt]


# ---------------------------------------------------------------------------------------------
# Exact float32 bit helpers (XLA:CPU flushes subnormals; these do not depend on that). The
# bit-level decoders (to_bits, from_bits, pow2, mul_pow2_exact, e2m1_decode) live in
# pallas_kernels.kv_formats, shared with the kernels that dequantize pages in place.


def _amax(x_f32: jax.Array, axis) -> jax.Array:
  """max |x| via the integer order of |x|'s bits, as torch.amax: NaN wins over Inf.

  XLA:CPU's vectorized float max can drop a NaN, and its denormals-are-zero mode can pick the
  wrong subnormal; comparing bit patterns as integers has neither problem.
  """
  abs_bits = to_bits(x_f32) & _F32_ABS
  return from_bits(jnp.max(abs_bits, axis=axis, initial=0))


def _amax_last(x_f32: jax.Array) -> jax.Array:
  """_amax over the last axis: halves combined elementwise down to 4 wide, then a reduction.

  XLA:CPU vectorizes elementwise maxima of halves much better than a reduction over a short
  minor axis (up to 6x for 128 values). The final step stays a reduction because XLA does not
  fuse a reduction into its consumers, whereas an all-elementwise tree would be fused and
  recomputed for every element of the block (20x slower).
  """
  v = to_bits(x_f32) & _F32_ABS
  while v.shape[-1] > 4 and v.shape[-1] % 2 == 0:
    half = v.shape[-1] // 2
    v = jnp.maximum(v[..., :half], v[..., half:])
  return from_bits(jnp.max(v, axis=-1))


def _div(a, b) -> jax.Array:
  """IEEE float32 a / b.

  XLA rewrites a / broadcast(b) (a scalar or a constant divisor included) into a * (1 / b), which
  rounds differently from torch, numpy and the GPU kernels. The divisor is therefore broadcast
  to the full shape behind an optimization barrier. OR-ing in a's bits AND 0 (folded away by
  XLA) makes the divisor batched whenever `a` is, so that under vmap the broadcast also happens
  before the barrier instead of being added by the batching rule after it.
  """
  a = jnp.asarray(a, jnp.float32)
  shape = jnp.broadcast_shapes(a.shape, jnp.shape(b))
  b_bits = to_bits(jnp.broadcast_to(jnp.asarray(b, jnp.float32), shape)) | (to_bits(a) & 0)
  return a / lax.optimization_barrier(from_bits(b_bits))


def _mul_pow2_for_cast(x_f32: jax.Array, k_i32: jax.Array) -> jax.Array:
  """x * 2^k, exact whenever the result is >= 2^-126 in magnitude, x subnormal included.

  Smaller results keep their sign but may be flushed; the caller casts to e4m3, where they round
  to zero anyway. Subnormal x is rebuilt as (its integer mantissa) * 2^-149 so that XLA's
  denormals-are-zero does not drop it.
  """
  bits = to_bits(x_f32)
  is_sub = (bits & _F32_INF_BITS) == 0
  mant_f32 = (bits & _F32_MANT).astype(jnp.float32)
  mant_f32 = jnp.where(bits < 0, -mant_f32, mant_f32)
  x_n = jnp.where(is_sub, mant_f32, x_f32)
  k_n = jnp.where(is_sub, k_i32 - 149, k_i32)
  k1 = jnp.clip(k_n, -126, 127)
  k2 = jnp.clip(k_n - k1, -126, 127)
  return x_n * pow2(k1) * pow2(k2)


def _blocks(x_f32: jax.Array, block: int) -> jax.Array:
  return x_f32.reshape(*x_f32.shape[:-1], x_f32.shape[-1] // block, block)


def _clip_to_e4m3(y_f32: jax.Array) -> jax.Array:
  """Saturates to +-448 before the cast: e4m3fn has no Inf, an unclipped overflow is NaN."""
  return jnp.clip(y_f32, -_E4M3_MAX, _E4M3_MAX).astype(jnp.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------
# Formats.


def _quantize_fp8(x_f32: jax.Array) -> QuantizedKV:
  scale = jnp.maximum(_div(_amax_last(x_f32), _E4M3_MAX), _FP8_MIN_SCALE)
  # Multiplying by a per-vector reciprocal keeps the per-element work a multiply.
  data = _clip_to_e4m3(x_f32 * _div(1.0, scale)[..., None])
  return QuantizedKV(data=data, scale=scale, tensor_scale=None, fmt="fp8")


def _mx_scale_floor(amax_f32: jax.Array) -> jax.Array:
  """OCP MX scale exponent floor(log2(amax)) - 8 from amax's exponent bits, biased, as int32.

  A subnormal amax has exponent bits 0 (floor(log2) <= -127) and clamps to the minimum scale
  2^-127 like any amax < 2^-118; Inf gives 2^120 (torchao); NaN gives the E8M0 NaN 0xFF.
  """
  bits = to_bits(amax_f32)
  unbiased = jnp.clip((bits >> 23) - 127 - 8, -127, 127)
  return jnp.where(bits > _F32_INF_BITS, 255, unbiased + 127)


def _mx_scale_rceil(amax_f32: jax.Array) -> jax.Array:
  """Biased exponent of 2^ceil(log2(amax / 448)) computed exactly, clamped to [-127, 127].

  amax / 448 is the IEEE float32 quotient (as torch and the GPU compute it). Its ceil(log2) is
  read from its bits (exponent, +1 unless the mantissa is zero). When the quotient is subnormal
  (XLA flushes it to 0) the answer is -126 if it exceeds 2^-127, else the clamp -127: a fixed
  threshold on amax. Inf gives 0xFE, NaN 0xFF (torchao / TransformerEngine).
  """
  descale = _div(amax_f32, _E4M3_MAX)
  d_bits = to_bits(descale)
  d_exp = (d_bits >> 23) & 0xFF
  ceil_log2 = d_exp - 127 + ((d_bits & _F32_MANT) != 0).astype(jnp.int32)
  normal = jnp.clip(ceil_log2, -127, 127) + 127
  amax_bits = to_bits(amax_f32)
  subnormal = (amax_bits >= _RCEIL_SUBNORMAL_THRESHOLD_BITS).astype(jnp.int32)
  biased = jnp.where(d_exp == 0, subnormal, normal)
  biased = jnp.where(amax_bits == _F32_INF_BITS, 254, biased)
  return jnp.where(amax_bits > _F32_INF_BITS, 255, biased)


def _quantize_mx(x_f32: jax.Array, fmt: str) -> QuantizedKV:
  x_blk = _blocks(x_f32, BLOCK_SIZES[fmt])
  amax = _amax_last(x_blk)
  if fmt == "mxfp8":
    biased = _mx_scale_floor(amax)
    # Elements are x / 2^s exactly (s = -127 included: torchao uses 2^-126 there).
    k = 127 - biased
  else:
    biased = _mx_scale_rceil(amax)
    # TransformerEngine's reciprocal: 1 for the zero exponent, 2^-127 for Inf.
    k = jnp.where(biased == 0, 0, jnp.where(biased == 254, -127, 127 - biased))
  data = _mul_pow2_for_cast(x_blk, k[..., None])
  data = jnp.where((biased == 255)[..., None], jnp.nan, data)
  data = _clip_to_e4m3(data).reshape(x_f32.shape)
  return QuantizedKV(data=data, scale=biased.astype(jnp.uint8), tensor_scale=None, fmt=fmt)


def _e2m1_encode(y_f32: jax.Array) -> jax.Array:
  """float4_e2m1fn codes (uint8, low nibble) of y in [-6, 6], rounding to nearest even.

  Counting the rounding boundaries (ties go to the even codes 0, 2, 4, 6: 0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4) is several times faster on CPU than XLA's
  cast to float4_e2m1fn, whose sub-byte arrays do not fuse well. NaN encodes as a zero; its block
  scale is NaN, so it still decodes to NaN.
  """
  a = jnp.abs(y_f32)
  steps = (a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0)
  magnitude = sum(s.astype(jnp.uint8) for s in steps)
  sign = (lax.bitcast_convert_type(y_f32, jnp.uint32) >> 28).astype(jnp.uint8) & 8
  return magnitude | sign


# Nibble (un)packing goes through a uint16 bitcast of byte pairs (little-endian, as on every
# JAX backend) because strided even/odd slices made XLA:CPU's fused quantizer ~7x slower.


def _pack_nibbles(codes: jax.Array) -> jax.Array:
  """uint8 [..., n, 2] codes < 16 -> [..., n] bytes, element 2i in the low nibble."""
  v = lax.bitcast_convert_type(codes, jnp.uint16)  # codes[0] | codes[1] << 8
  return (v | (v >> 4)).astype(jnp.uint8)


def _unpack_nibbles(packed: jax.Array) -> jax.Array:
  """[..., n] bytes -> uint8 [..., 2n] codes, the inverse of _pack_nibbles."""
  v = (packed & 0xF).astype(jnp.uint16) | ((packed >> 4).astype(jnp.uint16) << 8)
  codes = lax.bitcast_convert_type(v, jnp.uint8)
  return codes.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _quantize_nvfp4(x_f32: jax.Array, tensor_scale) -> QuantizedKV:
  x_blk = _blocks(x_f32, BLOCK_SIZES["nvfp4"])
  block_amax = _amax_last(x_blk)
  if tensor_scale is None:  # The max of the block maxima: no second pass over x.
    tensor_scale = _div(_amax(block_amax, axis=None), _E4M3_MAX * _E2M1_MAX)
  else:
    tensor_scale = jnp.asarray(tensor_scale, jnp.float32)
    if tensor_scale.shape != ():
      raise ValueError(f"tensor_scale must be a scalar, got shape {tensor_scale.shape}.")
  tensor_scale = jnp.maximum(tensor_scale, _NVFP4_MIN_TENSOR_SCALE)
  block_scale = _div(block_amax, _E2M1_MAX)
  # Two-level scaling in torchao's operation order (which follows NVIDIA's kernel numerics).
  scale_e4m3 = jnp.clip(_div(block_scale, tensor_scale), _E4M3_MIN_NORMAL, _E4M3_MAX)
  scale_e4m3 = scale_e4m3.astype(jnp.float8_e4m3fn)
  reciprocal = _div(_div(1.0, tensor_scale), scale_e4m3.astype(jnp.float32))
  y = jnp.clip(x_blk * reciprocal[..., None], -_E2M1_MAX, _E2M1_MAX)
  codes = _e2m1_encode(y).reshape(*x_f32.shape[:-1], x_f32.shape[-1] // 2, 2)
  packed = _pack_nibbles(codes)
  return QuantizedKV(data=packed, scale=scale_e4m3, tensor_scale=tensor_scale, fmt="nvfp4")


@functools.partial(jax.jit, static_argnames=("fmt",))
def quantize(x: jax.Array, fmt: str, tensor_scale: jax.Array | float | None = None) -> QuantizedKV:
  """Quantizes x along its last axis into format `fmt` (one of FORMATS).

  Args:
    x: float array [..., D] (float32, bfloat16, float16); D must be a multiple of the block size
      (32 for mxfp8*, 16 for nvfp4).
    fmt: format name, static under jit.
    tensor_scale: nvfp4 only: a calibrated float32 scalar to use instead of amax(|x|) / 2688
      (floored at 2^-114; bit-exact with torchao for scales up to 2^116).

  Returns:
    QuantizedKV holding the packed data and scales.

  Jitted (fmt static); calling it inside another jit/vmap just inlines it.
  """
  check_format(fmt)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(
      f"quantize needs a floating-point array (float32, bfloat16, float16); got dtype {x.dtype}."
    )
  if x.ndim == 0:
    raise ValueError("quantize needs an array with a last (head_dim) axis; got a scalar.")
  check_format(fmt, x.shape[-1])
  if tensor_scale is not None and fmt != "nvfp4":
    raise ValueError(f"tensor_scale applies only to 'nvfp4'; got it with {fmt!r}.")
  if fmt == "bf16":
    return QuantizedKV(data=x.astype(jnp.bfloat16), scale=None, tensor_scale=None, fmt=fmt)
  x_f32 = x.astype(jnp.float32)
  if fmt == "fp8":
    return _quantize_fp8(x_f32)
  if fmt == "nvfp4":
    return _quantize_nvfp4(x_f32, tensor_scale)
  return _quantize_mx(x_f32, fmt)


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize(q: QuantizedKV, dtype=jnp.float32) -> jax.Array:
  """Returns the values q stands for, shape q.shape, in `dtype` (computed in float32)."""
  check_format(q.fmt)
  if not jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
    raise ValueError(f"dequantize needs a floating-point dtype; got {dtype}.")
  if q.fmt == "bf16":
    return q.data.astype(dtype)
  if q.fmt == "fp8":
    return (q.data.astype(jnp.float32) * q.scale[..., None]).astype(dtype)
  if q.fmt == "nvfp4":
    v_blk = _blocks(e2m1_decode(_unpack_nibbles(q.data)), BLOCK_SIZES["nvfp4"])
    block_scale = q.tensor_scale * q.scale.astype(jnp.float32)
    return (v_blk * block_scale[..., None]).reshape(q.shape).astype(dtype)
  v_blk = _blocks(q.data.astype(jnp.float32), BLOCK_SIZES[q.fmt])
  biased = q.scale.astype(jnp.int32)[..., None]
  out = mul_pow2_exact(v_blk, biased - 127)
  out = jnp.where(biased == 255, jnp.nan, out)
  return out.reshape(q.shape).astype(dtype)


def nbytes(q: QuantizedKV) -> int:
  """Bytes of every array in q (the nvfp4 tensor scale included)."""
  return int(sum(math.prod(a.shape) * a.dtype.itemsize for a in jax.tree.leaves(q)))
