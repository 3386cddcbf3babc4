"""The engine's pool stored as bits (looped/engine/paged_cache.py, `as_bits`): narrow floats kept
in unsigned integers of their width, so XLA:CPU scatters a step's rows in place instead of
converting the whole pool to float32 and back every step.

Checked here: the bit round trip is exact for every bit pattern; gather and scatter over a pool
stored as bits give exactly what they give over the same pool stored as values; and the CPU
step compiled over a bf16 pool converts the whole pool to float32 when stored as values and does
not when stored as bits (the defect the storage removes, found in XLA's optimized HLO).
"""

import re

import engine_test
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from looped.engine import executor as executor_lib
from looped.engine import paged_cache
from looped.engine.executor import ModelExecutor
from looped.engine.padding import Padding
from looped.model import init_params
from looped.model.cache_layout import KVLayout
from looped.model.looped_lm import LoopedLM

CFG = engine_test.CFG  # head_dim 32: every KV format can store it.
S = jax.ShapeDtypeStruct


class BitsRoundTripTest(absltest.TestCase):
  def test_every_bit_pattern(self):
    for dtype, bits in ((jnp.bfloat16, np.uint16), (jnp.float8_e4m3fn, np.uint8)):
      with self.subTest(dtype=jnp.dtype(dtype).name):
        every = np.arange(np.iinfo(bits).max + 1, dtype=bits)  # NaNs, infinities, -0 included.
        x = jax.lax.bitcast_convert_type(jnp.asarray(every), dtype)
        stored = paged_cache.to_bits(x)
        self.assertEqual(stored.dtype, bits)
        np.testing.assert_array_equal(np.asarray(stored), every)
        back = paged_cache.from_bits(stored, jnp.dtype(dtype))
        self.assertEqual(back.dtype, dtype)
        np.testing.assert_array_equal(np.asarray(paged_cache.to_bits(back)), every)
    f32 = jnp.arange(4, dtype=jnp.float32)
    self.assertIs(paged_cache.to_bits(f32), f32)  # Float32 (raw pages, states) as it is.


def _pool(share_kv, kv_format, as_bits, num_pages=6, page_size=4):
  layout = KVLayout(share_kv, kv_format, page_size=page_size)
  return paged_cache.init_pages(CFG, num_pages, layout, 0, as_bits=as_bits)


class GatherScatterTest(parameterized.TestCase):
  @parameterized.product(share_kv=(False, True), kv_format=(None, "bf16", "fp8", "nvfp4"))
  def test_as_bits_equals_as_values(self, share_kv, kv_format):
    """Random entries scattered into both pools, then gathered: the same bits everywhere."""
    values, bits = _pool(share_kv, kv_format, False), _pool(share_kv, kv_format, True)
    layout = KVLayout(share_kv, kv_format, page_size=4)
    dtypes = paged_cache.page_dtypes(CFG, layout)
    self.assertEqual(jax.tree.map(lambda x: x.dtype, values), dtypes)
    narrow = [x for x in jax.tree.leaves(values) if x.dtype.itemsize < 4]
    self.assertEqual(bool(narrow), kv_format is not None)
    for leaf in jax.tree.leaves(bits):  # No float narrower than 32 bits is left.
      self.assertFalse(jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype.itemsize < 4)
    table_BxP = jnp.array([[2, 4], [1, 0]], jnp.int32)
    context_B, num_new_B = jnp.array([3, 0], jnp.int32), jnp.array([2, 3], jnp.int32)
    cache = paged_cache.gather(values, table_BxP, context_B, layout)
    # A chunk of 4 slots per row, shaped as the model's: a one-page gather's cache.
    one_page = paged_cache.gather(values, table_BxP[:, :1], context_B, layout)
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 64))

    def fill(x):  # Random bits in every slot of the dense cache, at its dtype.
      if x.ndim == 0 or jnp.issubdtype(x.dtype, jnp.integer) and x.dtype.itemsize == 4:
        return x
      if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 4:
        return jax.random.normal(next(keys), x.shape, x.dtype)
      width = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
      raw = jax.random.bits(next(keys), x.shape, width)
      if x.dtype == width:
        return raw
      # No NaNs: XLA's scatter into a value pool canonicalizes their payloads (the bit round
      # trip above covers every pattern).
      value = jax.lax.bitcast_convert_type(raw, x.dtype)
      return jnp.where(jnp.isnan(value), jnp.zeros_like(value), value)

    chunk = jax.tree.map(fill, one_page.layers)
    args = (table_BxP, context_B, num_new_B, 4, layout)
    out_values = paged_cache.scatter(values, cache, chunk, *args)
    out_bits = paged_cache.scatter(bits, cache, chunk, *args, dtypes=dtypes)
    as_bits = lambda tree: jax.tree.map(lambda x: np.asarray(paged_cache.to_bits(x)), tree)
    for stage in ("prelude", "core", "coda"):  # Every page but the scratch page (padding).
      axis = paged_cache._batch_axis(stage, layout)
      real = lambda x, axis=axis: x[(slice(None),) * axis + (slice(0, 6),)]
      stored = [jax.tree.map(real, as_bits(t[stage])) for t in (out_values, out_bits)]
      jax.tree.map(np.testing.assert_array_equal, *stored)
    again = paged_cache.gather(out_values, table_BxP, context_B + 2, layout)
    again_bits = paged_cache.gather(out_bits, table_BxP, context_B + 2, layout, dtypes=dtypes)
    self.assertEqual(
      jax.tree.map(lambda x: x.dtype, again), jax.tree.map(lambda x: x.dtype, again_bits)
    )
    jax.tree.map(np.testing.assert_array_equal, as_bits(again), as_bits(again_bits))
    # Each row's real new slots hold its chunk, at its context; the slots before are untouched.
    before = paged_cache.gather(values, table_BxP, context_B, layout)
    for stage in ("prelude", "core", "coda"):
      axis = paged_cache._batch_axis(stage, layout)
      layers = (again.layers[stage], chunk[stage], before.layers[stage])
      leaves = zip(*(jax.tree.leaves(x) for x in layers), strict=True)
      for got, new, old in leaves:
        if got.ndim < axis + 2:  # A per-tensor scale: not per slot.
          continue
        for b in range(2):
          c, n = int(context_B[b]), int(num_new_B[b])
          np.testing.assert_array_equal(_slots(got, axis, b, c, c + n), _slots(new, axis, b, 0, n))
          np.testing.assert_array_equal(_slots(got, axis, b, 0, c), _slots(old, axis, b, 0, c))


def _slots(x, axis: int, b: int, lo: int, hi: int) -> np.ndarray:
  """Row b's slots [lo, hi) of a cache leaf whose rows are on `axis`, as bits."""
  return np.asarray(paged_cache.to_bits(x))[(slice(None),) * axis + (b, slice(lo, hi))]


def _compiled_cpu_step(pages) -> str:
  """XLA's optimized HLO of the engine's 'xla' step (2 rows of 1 token, 2 columns) on CPU."""
  params = jax.eval_shape(
    lambda: init_params(LoopedLM(CFG), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  )
  i32, f32 = jnp.int32, jnp.float32
  row = lambda dtype: S((2,), dtype)
  args = (params, pages, S((2, 1), i32), S((2, 2), i32), row(i32), row(i32), row(f32))
  args += (row(i32), row(f32), row(i32), row(i32), S((2, 1), i32), row(i32))
  step = executor_lib.compiled_call(CFG, KVLayout(False, "bf16", page_size=4), False)
  return step.trace(*args).lower().compile().as_text()


_UNSHARED_BF16 = KVLayout(False, "bf16", page_size=4)


class WholePoolConvertTest(absltest.TestCase):
  def test_cpu_step_converts_no_pool(self):
    """A pool of 37 pages of 4 tokens: its first dims (37 + 1 scratch, 4) name its arrays."""
    shapes = lambda as_bits: jax.eval_shape(
      lambda: paged_cache.init_pages(CFG, 37, _UNSHARED_BF16, 0, as_bits=as_bits)
    )
    pool = re.compile(r"f32\[(\d+,)?38,4,")  # A float32 array of the pool's shape.
    self.assertRegex(_compiled_cpu_step(shapes(False)), pool)  # Values: the defect is there.
    self.assertNotRegex(_compiled_cpu_step(shapes(True)), pool)  # Bits: gone.

  def test_cpu_step_writes_only_the_chunk(self):
    """Unshared, 2 rows over 2 pages of 4 (8 slots): the step writes the chunk into the pages
    and neither writes the dense cache ([(R,) 2, 8, ...]) nor copies a pool ([(R,) 38, 4, ...]).
    Writing the dense cache and reading the window back made the unshared step copy every
    recurrence's context; writing before the pool's reads are done made XLA copy pools."""
    pages = jax.eval_shape(lambda: paged_cache.init_pages(CFG, 37, _UNSHARED_BF16, as_bits=True))
    hlo = _compiled_cpu_step(pages)
    pool = r"u16\[(\d+,)?38,4,1,32\]"
    self.assertNotRegex(hlo, rf"= {pool}\S* copy\(")
    dense = r"\w+\[(\d+,)?2,8,1,32\]"
    self.assertRegex(hlo, rf"= {dense}")  # The gathered cache is there, read.
    self.assertNotRegex(hlo, rf"= {dense}\S* (scatter|dynamic-update-slice)\(")
    self.assertNotRegex(hlo, rf"%wrapped_scatter\S* = {dense}")

  def test_the_executor_stores_bits(self):
    model = LoopedLM(CFG)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    padding = Padding.create(4, (2,), (1,), (2,), 16)
    layout = KVLayout(True, "nvfp4", page_size=4)
    ex = ModelExecutor(model, params, num_pages=6, layout=layout, padding=padding)
    dtypes = {x.dtype.name for x in jax.tree.leaves(ex.pages)}
    self.assertEqual(dtypes, {"uint8", "float32"})  # Elements and e4m3 scales; tensor scales.


if __name__ == "__main__":
  absltest.main()
