"""Engine vs each request computed alone under the same semantics (engine_reference.py): logits
per mixer, KV format and layout, and 200 concurrent requests' greedy tokens, with pages, prefix
hits and preemption."""

import dataclasses

import engine_reference
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from looped.engine import padding, paged_cache
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import init_params
from looped.model.cache_layout import KVLayout
from looped.model.looped_lm import LoopedLM
from looped.scheduler import pages, replay, scheduler
from looped.sim import cost_model, hardware, shape
from looped_testing import TINY_MODEL

# head_dim 32 so that every KV format (mxfp8 blocks of 32) can store the cache.
CFG = dataclasses.replace(TINY_MODEL, num_heads=2, num_kv_heads=1, head_dim=32, max_seq_len=48)
FORMATS = (None, "bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4")
BLOCK = 8  # Prefill block: two pages of 4 tokens.
# Formats share one code path in both layouts; three of them unshared keep the runtime down.
CASES = [(True, f) for f in FORMATS] + [(False, f) for f in (None, "fp8", "nvfp4")]


def _params(cfg=CFG):
  return init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


def _requests(n, rng, *, vocab, max_new=(2, 8), prefixes=4, spread_s=0.0):
  """Random prompts, most of them behind one of a few shared prefixes (page-aligned or not)."""
  heads = [list(rng.integers(0, vocab, rng.integers(5, 14))) for _ in range(prefixes)]
  out = []
  for i in range(n):
    head = heads[rng.integers(prefixes)] if rng.random() < 0.8 else []
    tail = list(rng.integers(0, vocab, rng.integers(1, 12)))
    sp = SamplingParams(max_new_tokens=int(rng.integers(*max_new, endpoint=True)))
    arrival = float(rng.uniform(0, spread_s)) if spread_s else 0.0
    out.append(GenRequest(i, tuple(int(t) for t in head + tail), sp, arrival_s=arrival))
  return out


def _padded(seqs):
  length = max(len(s) for s in seqs)
  return jnp.asarray([s + [0] * (length - len(s)) for s in seqs], jnp.int32)


MLA = dataclasses.replace(
  CFG,
  prelude_mixers=("mla",),
  core_mixers=("mla",),
  coda_mixers=("mla",),
  mla_kv_rank=32,
  mla_rope_dim=32,
)
# KDA core layers (state slots) between GQA prelude and coda (pages), and a KDA:MLA hybrid core
# between MLA layers.
KDA = dataclasses.replace(CFG, core_mixers=("kda",))
KDA_MLA = dataclasses.replace(MLA, core_mixers=("kda", "mla"))
KDA_CASES = [
  (KDA, True, None),
  (KDA, False, None),
  (KDA_MLA, True, None),
  (KDA_MLA, False, None),
  (KDA_MLA, True, "nvfp4"),
  (KDA_MLA, False, "fp8"),
]


KDA_BLOCK = 4  # Every prompt block is padded to the 8-token bucket.


def _kda_requests(rng, vocab):
  """Prompts of 20 and 12 tokens, so blocks of exactly KDA_BLOCK tokens: the unpadded
  reference compiles two call lengths, 4 and 1. In 7 pages of 4 tokens, requests are
  preempted in both layouts."""
  return [
    GenRequest(
      i, tuple(int(t) for t in rng.integers(0, vocab, n)), SamplingParams(max_new_tokens=4)
    )
    for i, n in enumerate((20, 12, 12, 20))
  ]


class EngineLogitsTest(parameterized.TestCase):
  """Engine logits = each request computed alone on a dense cache under the same block
  semantics (engine_reference.py), to 1e-5 fp32, with chunked prefill, prefix hits and
  preemption; and the engine's greedy tokens are the argmax of those logits."""

  @parameterized.parameters(*CASES)
  def test_logits_equal_reference(self, share_kv, kv_format, cfg=CFG):
    self._check(cfg, share_kv, kv_format)

  @parameterized.parameters((True, None), (False, "fp8"), (True, "nvfp4"))
  def test_mla_logits_equal_reference(self, share_kv, kv_format):
    self._check(MLA, share_kv, kv_format)

  @parameterized.parameters(*KDA_CASES)
  def test_kda_logits_equal_reference(self, cfg, share_kv, kv_format):
    """KDA states in slots, padded rows and chunks, preemption; prefix hits are off."""
    self._check(cfg, share_kv, kv_format)

  def test_kv_policy_logits_equal_reference(self):
    """A KV-sharing policy's pages (R = 3: stride2 reads 2 2 3 and keeps two copies, in fp8)
    against the same policy's dense decode."""
    self._check(CFG, True, "fp8", "stride2")

  def _check(self, cfg, share_kv, kv_format, kv_policy="final"):
    model, params = LoopedLM(cfg), _params(cfg)
    rng = np.random.default_rng(1)
    stateful = paged_cache.has_state(cfg)
    if stateful:
      requests, block = _kda_requests(rng, cfg.vocab_size), KDA_BLOCK
    else:
      requests = _requests(6, rng, vocab=cfg.vocab_size, max_new=(3, 6), prefixes=1)
      block = BLOCK
    # 3 rows, blocks of 8 (KDA: 4), 7 pages of 4 tokens: chunked prefill, prefix hits (not for
    # KDA), preemption.
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=share_kv,
        kv_format=kv_format,
        kv_policy=kv_policy,
        num_pages=7,
        page_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=3,
        prefill_block=block,
        row_buckets=(3,),
        token_buckets=(8,),
        column_buckets=(),  # One page-table width: fewer compilations.
        record_logits=True,
        check_invariants=True,
      ),
    )
    gens = engine.generate(requests)
    summary = engine.summary(gens)
    if stateful:  # A KDA state is not a function of a page: no prefix hits.
      self.assertEqual(summary["hit_rate"], 0)
    else:
      self.assertGreater(summary["hit_rate"], 0)
    self.assertGreater(summary["preemptions"], 0)
    slots = engine.executor.padding.column_buckets[-1] * 4
    tokens, ref = engine_reference.block_reference(
      cfg,
      params,
      requests,
      share_kv=share_kv,
      block=block,
      kv_format=kv_format,
      slots=slots,
      kv_policy=kv_policy,
    )
    compared = 0
    for i, (r, g) in enumerate(zip(requests, gens)):
      self.assertEqual(g.tokens, tokens[i])
      logits = engine.results[r.request_id].logits
      end = r.prompt_len + len(g.tokens) - 1
      # Every position from the first uncached one on was computed by this request.
      first = min(logits)
      self.assertEqual(sorted(logits), list(range(first, end)))
      got = np.stack([logits[p] for p in range(first, end)])
      want = np.stack([ref[i][p] for p in range(first, end)])
      # Raw pages agree to float32 summation order. In a format, a last-bit difference before
      # rounding can move a stored value by one quantum (MLA's batch-dependent matmuls do), and
      # every later position of the request reads it (seen: 1.5e-3 in fp8 from one flip, and
      # from an early flip most positions of a request); a moved block boundary changes logits
      # by ~1e-1.
      atol = 1e-5 if kv_format is None else 1e-2
      np.testing.assert_allclose(got, want, atol=atol, rtol=0)
      # The engine's greedy tokens are the argmax of its logits at the sampled positions.
      last = [logits[p].argmax() for p in range(r.prompt_len - 1, end)]
      self.assertEqual(g.tokens, [int(t) for t in last])
      compared += len(got)
    self.assertGreater(compared, 40)


class EngineConcurrencyTest(parameterized.TestCase):
  """200 concurrent requests = each decoded alone under the same semantics, no page leaks, and
  the prefix-cache hit rate of the simulator on the same stream and budget."""

  @parameterized.parameters(False, True)
  def test_200_requests(self, share_kv):
    model, params = LoopedLM(CFG), _params()
    rng = np.random.default_rng(2)
    requests = _requests(200, rng, vocab=CFG.vocab_size, spread_s=0.5)
    page_size, num_pages = 4, 24  # Tight: 24 pages = 96 tokens for up to 8 running requests.
    sched_config = dict(max_num_batched_tokens=16, max_num_seqs=8)
    model_shape = shape.ModelShape.from_config(dataclasses.asdict(CFG))
    price = lambda: cost_model.CostModelExecutor(
      model_shape, hardware.PROFILES["h200"], KVLayout(share_kv, "bf16")
    )
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=share_kv,
        num_pages=num_pages,
        page_size=page_size,
        prefill_block=BLOCK,
        row_buckets=(8,),
        token_buckets=(8,),
        check_invariants=True,
        **sched_config,
      ),
      clock=price(),
    )
    gens = engine.generate(requests)
    expected, _ = engine_reference.block_reference(
      CFG, params, requests, share_kv=share_kv, block=BLOCK
    )
    mismatched = [g.request_id for g, e in zip(gens, expected) if g.tokens != e]
    self.assertEqual(mismatched, [])
    summary = engine.summary(gens)
    self.assertGreater(summary["preemptions"], 0)
    self.assertEqual(summary["pages_in_use_at_end"], 0)
    self.assertEqual(engine.scheduler.pool.num_in_use, 0)
    self.assertGreater(summary["hit_rate"], 0.1)

    # The simulator on the same request list, page pool, scheduling rules and step pricing.
    pool = pages.PagePool(num_pages)
    sim = scheduler.Scheduler(engine.config, pool, price())
    replay.replay(sorted(requests, key=lambda r: r.arrival_s), sim)
    stats = sim.stats
    self.assertEqual(summary["hit_rate"], stats.first_cached_tokens / stats.first_prompt_tokens)
    self.assertEqual(summary["preemptions"], stats.num_preemptions)
    sim_cached = {s.request.request_id: s.cached_tokens for s in sim.finished}
    self.assertEqual({g.request_id: g.cached_prompt_tokens for g in gens}, sim_cached)


class PagedCacheTest(absltest.TestCase):
  def test_bytes_per_token_counts_layout_and_format(self):
    # 4 per-token layers shared (P + B + C), 8 unshared (P + R*B + C with R = 3): K and V of
    # one head of 32 values each.
    values = 2 * 32
    self.assertEqual(KVLayout(True, None).bytes_per_token(CFG), 4 * values * 4)
    self.assertEqual(KVLayout(False, None).bytes_per_token(CFG), 8 * values * 4)
    self.assertEqual(KVLayout(True, "bf16").bytes_per_token(CFG), 4 * values * 2)
    # fp8: one byte per value plus a float32 scale per head vector.
    self.assertEqual(KVLayout(False, "fp8").bytes_per_token(CFG), 8 * 2 * (32 + 4))

  def test_executor_pads_as_the_simulator_prices(self):
    engine = Engine(
      LoopedLM(CFG),
      None,
      EngineConfig(
        share_kv=False,
        kv_format="fp8",
        num_pages=4,
        page_size=4,
      ),
    )
    expected = padding.Padding.engine_default(engine.config)
    self.assertEqual(engine.executor.padding, expected)

  def test_kda_only_model_is_refused(self):
    kda = ("kda",)
    cfg = dataclasses.replace(CFG, prelude_mixers=kda, core_mixers=kda, coda_mixers=kda)
    with self.assertRaisesRegex(ValueError, "at least one 'gqa' or 'mla' layer to page"):
      Engine(
        LoopedLM(cfg),
        None,
        EngineConfig(
          share_kv=True,
          num_pages=4,
        ),
      )

  def test_unservable_request_is_refused_before_compute(self):
    engine = Engine(
      LoopedLM(CFG),
      _params(),
      EngineConfig(
        share_kv=True,
        num_pages=2,
        page_size=4,
      ),
    )
    long = GenRequest(7, tuple(range(10)), SamplingParams(max_new_tokens=4))
    with self.assertRaisesRegex(ValueError, "request 7: needs 4 KV pages"):
      engine.generate([long])
    with self.assertRaisesRegex(ValueError, "request 3: the prompt is empty"):
      engine.generate([GenRequest(3, ())])


if __name__ == "__main__":
  absltest.main()
