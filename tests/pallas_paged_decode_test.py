"""Paged decode attention (interpret mode) against looped's KV formats and attention math.

The reference never touches pallas_kernels: pages are packed by `looped.kv_quant` (per token,
as looped's caches store them), dequantized by `looped.kv_quant.dequantize`, gathered into a
dense cache and attended with `looped.model.attention.attend` (the model's decode math). The
kernel reads the packed pages through the page table after NaN was written into every slot that
no sequence uses, so any unmasked read shows up as NaN. The TPU variant (pages pipelined through
scalar-prefetched page ids) runs in Pallas' TPU interpreter against the same reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax.experimental import pallas as pl

from looped import kv_quant
from looped.model.attention import attend
from pallas_kernels import PackedKV, kv_formats, paged_decode

FORMATS = ("raw", "bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4")


def _quantize_rows(x, fmt):
  """looped's per-token packing: one quantize call per [K, D] token slice."""
  return jax.vmap(lambda tok: kv_quant.quantize(tok, fmt))(x)


def _packed(q: kv_quant.QuantizedKV) -> PackedKV:
  return PackedKV(q.data, q.scale, q.tensor_scale, q.fmt)


def _poison(a, used):
  """NaN (0xFF for bytes: an mx NaN scale, nvfp4 codes -6) wherever `used` is False."""
  used = used.reshape(used.shape + (1,) * (a.ndim - used.ndim))
  bad = (
    jnp.full(a.shape, 255, a.dtype) if a.dtype == jnp.uint8 else jnp.full(a.shape, jnp.nan, a.dtype)
  )
  return jnp.where(used, a, bad)


def _canonical_bits(x):
  bits = np.asarray(x, np.float32).view(np.uint32)
  return np.where(np.isnan(x), np.uint32(0x7FC00000), bits)


def _pack(x, fmt):
  """[pages, page_size, K, D] float32 -> (PackedKV as looped stores it, its dequantized values)."""
  if fmt == "raw":
    return PackedKV(x), x
  flat = _quantize_rows(x.reshape(-1, *x.shape[2:]), fmt)
  packed = jax.tree.map(lambda a: a.reshape(*x.shape[:2], *a.shape[1:]), flat)
  return _packed(packed), jax.vmap(kv_quant.dequantize)(flat).reshape(x.shape)


def _paged_case(fmt, page_size, lengths, kv_heads, d, seed=0):
  """Random K and V packed into shuffled pages with NaN in every slot no sequence uses.

  Returns (k_pages, v_pages, page_table, dense clean K, dense clean V): the dense caches are the
  dequantized values each row reads, in slot order, without the poison.
  """
  rng = np.random.default_rng(seed)
  b = len(lengths)
  pages_per_seq = max(pl.cdiv(n, page_size) for n in lengths) + 1  # One entry never used.
  num_pages = b * pages_per_seq + 2  # Two pages no sequence owns.
  table = rng.permutation(num_pages)[: b * pages_per_seq].reshape(b, pages_per_seq)
  used = np.zeros((num_pages, page_size), bool)
  for row, n in enumerate(lengths):
    for s in range(n):
      used[table[row, s // page_size], s % page_size] = True
  out = []
  for _ in ("k", "v"):
    # Per-token magnitudes over a wide range, so per-token / per-block scales matter.
    mag = np.exp2(rng.integers(-6, 3, (num_pages, page_size, kv_heads, 1)))
    x = rng.standard_normal((num_pages, page_size, kv_heads, d)) * mag
    packed, clean = _pack(jnp.asarray(x, jnp.float32), fmt)
    out.append(jax.tree.map(lambda a: _poison(a, jnp.asarray(used)), packed))
    out.append(clean[table].reshape(b, pages_per_seq * page_size, kv_heads, d))
  k_pages, k_dense, v_pages, v_dense = out
  return k_pages, v_pages, jnp.asarray(table, jnp.int32), k_dense, v_dense


class DequantTileTest(parameterized.TestCase):
  """kv_formats inside a kernel == looped.kv_quant.dequantize, bit for bit (NaN, Inf, tiny)."""

  @parameterized.parameters(*FORMATS[1:])
  def test_bit_exact_in_kernel(self, fmt):
    rng = np.random.default_rng(0)
    rows, d = 8, 64
    x = rng.standard_normal((rows, d)) * np.exp2(rng.integers(-40, 40, (rows, 1)))
    x[1] *= 2.0**-125  # mx scale at its floor: subnormal results.
    x[2, 3] = np.nan
    x[3, 40] = np.inf
    x[4] = -0.0
    x[5, :16] = 1e-39  # float32 subnormal inputs.
    q = _quantize_rows(jnp.asarray(x, jnp.float32)[:, None, :], fmt)
    q = jax.tree.map(lambda a: a[:, 0] if a.ndim > 1 else a, q)  # [rows, ...]
    if fmt.startswith("mxfp8"):  # A NaN scale byte over finite elements (e.g. a poisoned page).
      q = q.replace(scale=q.scale.at[6, 0].set(255))
    expected = jax.vmap(kv_quant.dequantize)(q)  # Per row: nvfp4's tensor scale is per token.
    leaves = [a for a in (q.data, q.scale, q.tensor_scale) if a is not None]

    def kernel(*refs):
      tiles, out_refs = [r[...] for r in refs[: len(leaves)]], refs[len(leaves) :]
      if fmt == "nvfp4":
        parts = kv_formats.nvfp4_halves(*tiles)
      else:
        parts = [
          kv_formats.dequantize_tile(tiles[0], tiles[1] if len(tiles) > 1 else None, None, fmt)
        ]
      for ref, part in zip(out_refs, parts):
        ref[...] = part

    width = d // 2 if fmt == "nvfp4" else d
    n_out = 2 if fmt == "nvfp4" else 1
    outs = pl.pallas_call(
      kernel,
      out_shape=[jax.ShapeDtypeStruct((rows, width), jnp.float32)] * n_out,
      interpret=True,
    )(*leaves)
    got = outs[0] if n_out == 1 else jnp.stack(outs, axis=-1).reshape(rows, d)
    np.testing.assert_array_equal(_canonical_bits(got), _canonical_bits(expected))
    self.assertTrue(np.isnan(got[2]).any() and np.isfinite(got[0]).all())


class PagedDecodeTest(parameterized.TestCase):
  def _check(
    self, fmt, page_size, lengths, t, hq, hkv, dtype=jnp.float32, atol=1e-5, variant="generic"
  ):
    # float32: outputs reach ~10 (tokens scaled up to 4x), so 1e-5 is a few ulps.
    d = 32
    k_pages, v_pages, table, k_dense, v_dense = _paged_case(fmt, page_size, lengths, hkv, d)
    rng = np.random.default_rng(3)
    b = len(lengths)
    q = jnp.asarray(rng.standard_normal((b, t, hq, d)), dtype)
    k_new, v_new = (jnp.asarray(rng.standard_normal((b, t, hkv, d)), dtype) for _ in range(2))
    lengths = jnp.asarray(lengths, jnp.int32)
    decode = functools.partial(paged_decode, variant=variant)
    out = jax.jit(decode)(q, k_new, v_new, k_pages, v_pages, table, lengths)
    self.assertFalse(bool(jnp.isnan(out).any()))
    s = k_dense.shape[1]
    past_mask = jnp.broadcast_to((jnp.arange(s)[None, :] < lengths[:, None])[:, None], (b, t, s))
    self_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    expected = jax.jit(attend)(
      q, k_new, v_new, self_mask, k_dense.astype(dtype), v_dense.astype(dtype), past_mask
    )
    self.assertEqual(out.dtype, dtype)
    np.testing.assert_allclose(
      np.asarray(out, np.float32), np.asarray(expected, np.float32), atol=atol, rtol=0
    )

  @parameterized.product(fmt=FORMATS, page_size=(16, 64))
  def test_every_format_ragged_gqa(self, fmt, page_size):
    # Empty cache, one slot, an exact page, pages plus a partial one.
    lengths = (0, 1, page_size, 2 * page_size + 5)
    self._check(fmt, page_size, lengths, t=1, hq=4, hkv=2)

  @parameterized.parameters("generic", "tpu")
  def test_chunk_of_new_tokens_is_causal(self, variant):
    self._check("nvfp4", 16, (3, 20), t=3, hq=2, hkv=1, variant=variant)

  @parameterized.parameters("generic", "tpu")
  def test_single_head_bfloat16(self, variant):
    self._check(
      "fp8", 16, (7, 33), t=1, hq=1, hkv=1, dtype=jnp.bfloat16, atol=2e-2, variant=variant
    )

  @parameterized.parameters(zip(FORMATS, (16, 64) * 3))
  def test_tpu_variant_every_format_ragged_gqa(self, fmt, page_size):
    # TPU interpreter: one page per grid step; lengths 0, 1, a page, pages plus a partial one.
    # Each format at one page size (CPU time); both sizes are covered, nvfp4 at 16 by the chunk.
    lengths = (0, 1, page_size, 2 * page_size + 5)
    self._check(fmt, page_size, lengths, t=1, hq=4, hkv=2, variant="tpu")

  def test_rejects_missing_scale(self):
    x = jnp.zeros((2, 16, 1, 32), jnp.float8_e4m3fn)
    with self.assertRaisesRegex(ValueError, "takes scale"):
      paged_decode(
        *(jnp.zeros((1, 1, 1, 32)),) * 3,
        PackedKV(x, fmt="fp8"),
        PackedKV(x, fmt="fp8"),
        jnp.zeros((1, 2), jnp.int32),
        jnp.zeros((1,), jnp.int32),
      )


if __name__ == "__main__":
  absltest.main()
