"""Dequantization of packed K/V, written to run inside kernels on tiles of pages.

The storage layouts are those of `looped.kv_quant` (this package does not import it; the tests
check bit-equality against it). The float32 bit helpers below (`to_bits`, `from_bits`, `pow2`,
`mul_pow2_exact`, `e2m1_decode`) are the one implementation of those decoders: `looped.kv_quant`
imports them from here. Values are quantized along the last axis (head dim D):

  raw / bf16  float elements [..., D] (float32 or bfloat16), no scale.
  fp8         float8_e4m3fn [..., D], one float32 scale per vector [...].
  mxfp8(_rceil)  float8_e4m3fn [..., D], one uint8 biased E8M0 exponent per 32 values
              [..., D // 32] (255 = NaN).
  nvfp4       uint8 [..., D // 2], element 2i in the low nibble, 2i+1 in the high nibble; one
              float8_e4m3fn scale per 16 values [..., D // 16]; a float32 tensor scale [...]
              (one per token in looped's caches; broadcast a per-page scale to its slots).

Everything is elementwise or a broadcast along the last axis, so the helpers apply equally to a
page tile [page_size, D] in a kernel and to a whole cache in the reference. nvfp4 is returned as
its even and odd halves (`nvfp4_halves`): a kernel contracts them against the even and odd
columns of q (and produces the even and odd output columns) instead of interleaving nibbles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

FORMATS = ("raw", "bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4")
MX_BLOCK = 32
NVFP4_BLOCK = 16


@dataclasses.dataclass(frozen=True)
class PackedKV:
  """Stored K or V values: element bytes, scales, and the format name (static)."""

  data: jax.Array
  scale: jax.Array | None = None
  tensor_scale: jax.Array | None = None
  fmt: str = "raw"

  def __post_init__(self):
    if self.fmt not in FORMATS:
      raise ValueError(f"Unknown KV format {self.fmt!r}; allowed: {FORMATS}.")

  @property
  def head_dim(self) -> int:
    return self.data.shape[-1] * (2 if self.fmt == "nvfp4" else 1)


jax.tree_util.register_dataclass(
  PackedKV, data_fields=["data", "scale", "tensor_scale"], meta_fields=["fmt"]
)


# Float32 bit helpers: the one implementation of the bit-level decoders, used by the kernels
# here and by `looped.kv_quant` (which imports them; this package imports nothing of looped).
# They build values from bit patterns, so XLA:CPU's flush-to-zero does not change a result, and
# use no op that Triton or Mosaic lacks (no round).


def to_bits(x_f32):
  """The int32 bit pattern of float32 values."""
  return lax.bitcast_convert_type(x_f32, jnp.int32)


def from_bits(b_i32):
  """float32 values of int32 bit patterns."""
  return lax.bitcast_convert_type(b_i32, jnp.float32)


def pow2(k_i32):
  """2^k as float32 for integer k in [-126, 127], from the exponent bits."""
  return from_bits((k_i32 + 127) << 23)


def repeat_last(x, times: int):
  """[..., n] -> [..., n * times], each entry repeated `times` times (block scale -> values)."""
  return jnp.broadcast_to(x[..., None], (*x.shape, times)).reshape(*x.shape[:-1], -1)


def mul_pow2_exact(v_f32, k_i32):
  """v * 2^k for decoded e4m3 v and k in [-127, 127], IEEE float32 with gradual underflow.

  v is zero, Inf, NaN or a normal e4m3 value (a multiple of 2^-9). Results below 2^-126 are
  built from their subnormal bit pattern, so that flush-to-zero arithmetic (XLA:CPU) gives the
  same bits as IEEE arithmetic.
  """
  k1 = jnp.clip(k_i32, -126, 127)
  fast = v_f32 * pow2(k1) * pow2(k_i32 - k1)
  bits = to_bits(v_f32)
  biased_exp = (bits >> 23) & 0xFF
  tiny = (biased_exp + k_i32 < 1) & (biased_exp > 0)
  # |v| * 2^(k + 149) is the subnormal's integer mantissa, exactly: e4m3 values are multiples
  # of 2^-9 and k >= -127, so no rounding is needed (Triton has no round).
  q = (jnp.abs(v_f32) * pow2(jnp.minimum(k_i32 + 149, 127))).astype(jnp.int32)
  sub = from_bits((bits & jnp.int32(-0x80000000)) | q)
  return jnp.where(tiny, sub, fast)


def e2m1_decode(codes):
  """float32 values of float4_e2m1fn codes (the low nibble of an integer array)."""
  c = codes.astype(jnp.int32)
  e, m = (c >> 1) & 3, c & 1
  bits = jnp.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))  # 0.5 m or 2^(e-1)(1+m/2)
  return from_bits(bits | ((c & 8) << 28))


def mx_dequantize(data, scale_u8):
  """mxfp8: e4m3 element times 2^(scale - 127); scale byte 255 is NaN."""
  biased = repeat_last(scale_u8.astype(jnp.int32), MX_BLOCK)
  out = mul_pow2_exact(data.astype(jnp.float32), biased - 127)
  return jnp.where(biased == 255, jnp.nan, out)


def nvfp4_halves(data_u8, scale_e4m3, tensor_scale):
  """nvfp4 values split into even and odd elements, each [..., D // 2] float32.

  Packed byte i holds elements 2i (low nibble) and 2i + 1 (high nibble), both in scale block
  2i // 16 = i // 8.
  """
  # The tensor scale covers leading axes of the scales (a token, a page): align it on the left.
  tensor_scale = tensor_scale.reshape(
    tensor_scale.shape + (1,) * (scale_e4m3.ndim - tensor_scale.ndim)
  )
  block_scale = tensor_scale * scale_e4m3.astype(jnp.float32)
  scale = repeat_last(block_scale, NVFP4_BLOCK // 2)
  even = e2m1_decode(data_u8 & 0xF) * scale
  odd = e2m1_decode(data_u8 >> 4) * scale
  return even, odd


def dequantize_tile(data, scale, tensor_scale, fmt: str):
  """float32 values [..., D] of one packed tile (every format except nvfp4: see nvfp4_halves)."""
  if fmt in ("raw", "bf16"):
    return data.astype(jnp.float32)
  if fmt == "fp8":
    return data.astype(jnp.float32) * scale[..., None]
  if fmt in ("mxfp8", "mxfp8_rceil"):
    return mx_dequantize(data, scale)
  raise ValueError(f"dequantize_tile does not take {fmt!r} (use nvfp4_halves).")


def dequantize(packed: PackedKV):
  """float32 values [..., D] of a packed array (the reference's full-copy dequantization)."""
  if packed.fmt == "nvfp4":
    even, odd = nvfp4_halves(packed.data, packed.scale, packed.tensor_scale)
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], -1)
  return dequantize_tile(packed.data, packed.scale, packed.tensor_scale, packed.fmt)
