"""The engine's attention through pallas_kernels.paged_decode (EngineConfig.attention_impl).

The kernel path (interpret mode on CPU) reads the pool's pages through each row's page table;
it must compute what the XLA path, which gathers the pages into a dense cache (checked against
each request alone in engine_test.py), computes: the same tokens, logits within float32
summation order (raw pages) or engine_test's KV-format bound, over chunked prefill, prefix
hits and preemption. The step function lowers for CUDA (Triton) and TPU (Mosaic) with the
kernel's custom calls in it, as tests/pallas_lowering_test.py lowers the kernels alone.
"""

import dataclasses
import re
from unittest import mock

import engine_test
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from jax._src.pallas.mosaic import tpu_info

from looped import config_checks
from looped.engine import checks, paged_cache
from looped.engine import engine as engine_lib
from looped.engine import executor as executor_lib
from looped.engine.config import GenConfig
from looped.engine.engine import Engine, EngineConfig
from looped.model import init_params
from looped.model.cache_layout import KVLayout
from looped.model.looped_lm import LoopedLM
from pallas_kernels import platform

CFG = engine_test.CFG  # head_dim 32: every KV format can store it.


def _generate(cfg, params, requests, attention_impl: str, **overrides):
  """3 rows, blocks of 8, 7 pages of 4 tokens (engine_test's setting): chunked prefill, prefix
  hits and preemption, one row and one token bucket (two compiled calls)."""
  config = dict(
    num_pages=7,
    page_size=4,
    max_num_batched_tokens=8,
    max_num_seqs=3,
    prefill_block=engine_test.BLOCK,
    row_buckets=(3,),
    token_buckets=(8,),
    column_buckets=(),
    record_logits=True,
    attention_impl=attention_impl,
  )
  engine = Engine(LoopedLM(cfg), params, EngineConfig(**{**config, **overrides}))
  gens = engine.generate(requests)
  logits = {g.request_id: engine.results[g.request_id].logits for g in gens}
  return engine, gens, logits


class EngineKernelTest(parameterized.TestCase):
  @parameterized.parameters(
    (True, None, "final"), (False, None, "final"), (True, "nvfp4", "stride2")
  )
  def test_kernel_engine_equals_gather_engine(self, share_kv, kv_format, kv_policy):
    """Same tokens, and logits within 1e-5 raw / 1e-2 in a format (engine_test's bounds: a
    last-bit flip before rounding moves a stored value by a quantum). In a format only the
    one-token calls read pages by the kernel (paged_cache.kernel_layers); the chunks gather.
    stride2 (R = 3) keeps two copies of the shared core: pages and page table lead with them."""
    params = engine_test._params()
    rng = np.random.default_rng(1)
    requests = engine_test._requests(4, rng, vocab=CFG.vocab_size, max_new=(3, 5), prefixes=1)
    kw = dict(share_kv=share_kv, kv_format=kv_format, kv_policy=kv_policy)
    engine, gens, got = _generate(CFG, params, requests, "pallas", **kw)
    self.assertEqual(engine.executor.attention_impl, "pallas")
    summary = engine.summary(gens)
    self.assertGreater(summary["hit_rate"], 0)
    self.assertGreater(summary["preemptions"], 0)
    _, want_gens, want = _generate(CFG, params, requests, "xla", **kw)
    atol = 1e-5 if kv_format is None else 1e-2
    compared = 0
    for g, w in zip(gens, want_gens, strict=True):
      self.assertEqual(g.tokens, w.tokens)
      self.assertEqual(sorted(got[g.request_id]), sorted(want[g.request_id]))
      for p, x in got[g.request_id].items():
        np.testing.assert_allclose(x, want[g.request_id][p], atol=atol, rtol=0)
        compared += 1
    self.assertGreater(compared, 30)

  def test_selection(self):
    """'auto' is XLA on CPU and the kernel on GPU / TPU with one device; invalid values and
    the kernel on a multi-device mesh are refused, naming the field."""
    resolve = engine_lib.attention_impl
    self.assertEqual(resolve("auto", (1, 1, 1)), "xla")  # CPU here.
    default = Engine(LoopedLM(CFG), None, EngineConfig(share_kv=True, num_pages=4))
    self.assertEqual(default.executor.attention_impl, "xla")
    for device in ("gpu", "tpu"):
      with mock.patch.object(platform, "platform", lambda device=device: device):
        self.assertEqual(resolve("auto", (1, 1, 1)), "pallas")
        self.assertEqual(resolve("auto", (1, 2, 1)), "xla")
        self.assertEqual(resolve("xla", (1, 1, 1)), "xla")
        # Page tiles Triton does not take stay on XLA on a GPU: under 16 rows (its dot
        # operands), or not a power of two.
        for page_size, head_dim in ((8, 128), (24, 128), (16, 96)):
          want = "xla" if device == "gpu" else "pallas"
          self.assertEqual(resolve("auto", (1, 1, 1), page_size, head_dim), want)
    self.assertEqual(resolve("pallas", (1, 1, 1)), "pallas")
    with self.assertRaisesRegex(ValueError, "attention_impl = 'triton': expected one of"):
      Engine(LoopedLM(CFG), None, EngineConfig(share_kv=True, num_pages=4, attention_impl="triton"))
    with self.assertRaisesRegex(ValueError, "attention_impl = 'pallas' runs on one device"):
      resolve("pallas", (1, 2, 1))
    # The programs' check, before anything is restored or compiled.
    config = GenConfig(attention_impl="pallas")
    self.assertEqual(checks.check_attention_impl(config, "gen", (1, 1, 1)), "pallas")
    with self.assertRaisesRegex(
      config_checks.ConfigError,
      r"config.gen.attention_impl = 'pallas' is invalid: the paged kernel runs on one device",
    ):
      checks.check_attention_impl(config, "gen", (2, 1, 1))

  def test_kernel_layers(self):
    """GQA layers read pages by the kernel; MLA layers, and a KV format's multi-token chunks,
    are gathered."""
    hybrid = dataclasses.replace(CFG, core_mixers=("mla", "gqa"), mla_kv_rank=32, mla_rope_dim=32)
    layers = paged_cache.kernel_layers(hybrid, KVLayout(False), 8)
    self.assertEqual(layers, {"prelude": (True,), "core": (False, True), "coda": (True,)})
    self.assertEqual(paged_cache.kernel_layers(hybrid, KVLayout(True, "fp8"), 1), layers)
    none = paged_cache.kernel_layers(hybrid, KVLayout(True, "fp8"), 8)
    self.assertEqual(none, {"prelude": (False,), "core": (False, False), "coda": (False,)})


S = jax.ShapeDtypeStruct


def _step_text(
  attention_impl: str, target: str, share_kv: bool, kv_format, tokens: int, cfg=CFG
) -> str:
  """The engine's whole jitted step (executor.compiled_call) on abstract inputs, lowered for
  `target` ('cuda' / 'tpu' with the platform mocked as pallas_lowering_test does, or 'cpu')."""
  cfg = dataclasses.replace(cfg, scan_unroll=1)  # The core's layers once in the scan body.
  rows, columns, num_pages, page_size = 2, 2, 6, 4  # A 7-page pool: not a power of two.
  params = jax.eval_shape(
    lambda: init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  )
  slots = rows if paged_cache.has_state(cfg) else 0  # KDA layers' state slots.
  layout = KVLayout(share_kv, kv_format, page_size=page_size)
  pages = jax.eval_shape(lambda: paged_cache.init_pages(cfg, num_pages, layout, slots))
  i32, f32 = jnp.int32, jnp.float32
  row = lambda dtype: S((rows,), dtype)
  args = (
    params,
    pages,
    S((rows, tokens), i32),  # tokens
    S((rows, columns), i32),  # page table
    row(i32),  # context
    row(i32),  # num_new
    row(f32),  # temperature
    row(i32),  # top_k
    row(f32),  # top_p
    row(i32),  # seed
    row(i32),  # index
    S((rows, tokens), i32),  # targets
    row(i32),  # slot
  )
  mesh = executor_lib.EngineMesh.create(cfg)
  step = executor_lib.compiled_call(cfg, layout, False, 0, mesh, attention_impl=attention_impl)
  # The executor's step function in a fresh function: jit's trace cache (keyed by the function)
  # does not see the mock, so one step would reuse its trace for the other target.
  call = step.__wrapped__
  step = jax.jit(lambda *a: call(*a))
  device = {"cuda": "gpu", "tpu": "tpu", "cpu": "cpu"}[target]
  with (
    mock.patch.object(platform, "platform", lambda: device),
    mock.patch.object(tpu_info, "get_device_kind", lambda: "TPU v5p"),
    mock.patch.object(tpu_info, "get_num_device_cores", lambda: 1),
    mesh.context(),
  ):
    return step.trace(*args).lower(lowering_platforms=(target,)).as_text()


# The kernel's custom call in each target's lowered text.
_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
_GQA_LAYERS = CFG.num_prelude_layers + CFG.num_core_layers + CFG.num_coda_layers


class EngineStepLoweringTest(parameterized.TestCase):
  """The step lowers for CUDA and TPU with one paged_decode call per GQA layer (the core's in
  the scan body once); the XLA step has none."""

  @parameterized.product(
    target=("cuda", "tpu"), case=((True, None, 8), (False, None, 1), (True, "nvfp4", 1))
  )
  def test_step_lowers_with_the_kernel(self, target, case):
    share_kv, kv_format, tokens = case
    text = _step_text("pallas", target, share_kv, kv_format, tokens)
    self.assertEqual(text.count(_CALL[target]), _GQA_LAYERS)

  def test_copies_read_the_whole_pool(self):
    """Unshared, the core's kernels read the pool of all R = 3 recurrences' pages (21 = 3 x 7,
    a table per recurrence), never a recurrence's slice of it (a copy as a kernel operand)."""
    text = _step_text("pallas", "cuda", False, None, 1)
    self.assertGreater(text.count("tensor<21x4x1x32xf32>"), 0)  # (The text is long to print.)
    self.assertIsNone(re.search(r"dynamic_slice[^\n]*-> tensor<1x7x4x1x32xf32>", text))

  @parameterized.parameters("cuda", "tpu")
  def test_xla_step_has_no_kernel(self, target):
    self.assertEqual(_step_text("xla", target, True, None, 1).count(_CALL[target]), 0)

  def test_hybrids_run_the_kernel_on_their_gqa_layers(self):
    """A KDA core (state slots) and an MLA core (gathered latents) between GQA prelude and
    coda: the kernel in the prelude and coda only."""
    kda = dataclasses.replace(CFG, core_mixers=("kda",))
    mla = dataclasses.replace(CFG, core_mixers=("mla",), mla_kv_rank=32, mla_rope_dim=32)
    for cfg in (kda, mla):
      text = _step_text("pallas", "cuda", False, None, 8, cfg)
      self.assertEqual(text.count(_CALL["cuda"]), 2)

  def test_a_format_chunk_gathers(self):
    """A multi-token chunk in a KV format keeps the XLA gather (kernel_layers)."""
    self.assertEqual(_step_text("pallas", "cuda", True, "fp8", 8).count(_CALL["cuda"]), 0)


if __name__ == "__main__":
  absltest.main()
