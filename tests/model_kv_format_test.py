"""Decode caches stored in a KV format, and the parallel forwards that read through it."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from looped import kv_quant
from looped.model import LoopedLM, ModelConfig, init_cache, init_params
from looped.model.cache_layout import cache_layout
from looped.model.kv_cache import cache_nbytes, num_cached_values, quantize_roundtrip
from looped.model.sharing import decode_forward, jacobi_forward

CFG = ModelConfig(
  vocab_size=61,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=32,  # A multiple of the mx block (32) and the nvfp4 block (16).
  mlp_dim=48,
  num_recurrences=3,
  max_seq_len=16,
  init_std=0.2,
)


def _setup():
  model = LoopedLM(CFG)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, CFG.vocab_size)
  params = init_params(model, jax.random.PRNGKey(0), tokens)
  return model, params, tokens


class KvFormatModelTest(parameterized.TestCase):
  @parameterized.parameters("bf16", "fp8", "mxfp8", "nvfp4")
  def test_decode_through_format_matches_parallel_forwards(self, fmt):
    model, params, tokens = _setup()
    t = tokens.shape[1]
    jacobi = jax.jit(lambda p, x, n: jacobi_forward(model, p, x, n, kv_format=fmt)[0])

    def decode(share):
      return jax.jit(lambda p, x: decode_forward(model, p, x, share_kv=share, kv_format=fmt))

    unshared, cache_un = decode(False)(params, tokens)
    shared, cache_sh = decode(True)(params, tokens)
    # Decode and the parallel forward compute K/V with different fusions: a float32 difference
    # of ~1e-7 can flip one rounding of a cached value, and every later position of that row
    # reads it (seen with jax 0.10.2: one flip in row 1 at position 3, 2.4e-3 for fp8). So
    # most outputs must agree to float noise (median), and none by more than a tenth of what
    # the format itself changes: a path that skips or doubles the quantization, or reads
    # another recurrence's entries, moves the median by the format's own error (>= 1e-3 here).
    exact = model.apply(params, tokens)[0]
    for got, share in ((unshared, False), (shared, True)):
      want = jacobi(params, tokens, t if share else 0)
      diff = np.abs(np.asarray(got) - np.asarray(want))
      own = float(jnp.abs(want - exact).max())
      self.assertLess(float(np.median(diff)), 1e-5, (fmt, share))
      self.assertLess(float(diff.max()), 0.1 * own, (fmt, share))
    # Quantized reads change the outputs (more for coarser formats) ...
    self.assertGreater(float(jnp.abs(unshared - exact).max()), 1e-4)
    # ... and the caches hold packed bytes, not dequantized copies.
    stored_dtypes = {x.dtype for x in jax.tree.leaves(cache_sh.layers)}
    expected = {
      "bf16": {jnp.dtype(jnp.bfloat16)},
      "fp8": {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)},
      "mxfp8": {jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)},
      "nvfp4": {jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32)},
    }[fmt]
    self.assertEqual(stored_dtypes, expected)
    for cache in (cache_un, cache_sh):
      values = num_cached_values(cache)
      # nvfp4 adds one float32 tensor scale per token slice [K, H] of each K and V entry.
      slices = values // (CFG.num_kv_heads * CFG.head_dim)
      extra = 4 * slices if fmt == "nvfp4" else 0
      self.assertEqual(
        cache_nbytes(cache), values * kv_quant.bytes_per_value(fmt, CFG.head_dim) + extra
      )
    self.assertEqual(
      num_cached_values(cache_un) * cache_layout(CFG, True).vectors_per_token,
      num_cached_values(cache_sh) * cache_layout(CFG, False).vectors_per_token,
    )

  def test_roundtrip_is_per_token(self):
    # A token's stored bytes do not depend on other tokens (nvfp4's tensor scale is per token).
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, CFG.num_kv_heads, CFG.head_dim))
    big = x.at[1, 3].multiply(1e3)
    a = quantize_roundtrip((x, x), "nvfp4")[0]
    b = quantize_roundtrip((big, big), "nvfp4")[0]
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1, :3], b[1, :3])
    one = kv_quant.dequantize(kv_quant.quantize(x[1, 2], "nvfp4"))
    np.testing.assert_array_equal(a[1, 2], one)

  def test_bad_format_fails_clearly(self):
    with self.assertRaisesRegex(ValueError, "Unknown KV format 'int4'"):
      init_cache(CFG, 1, 4, share_kv=True, kv_format="int4")


if __name__ == "__main__":
  absltest.main()
