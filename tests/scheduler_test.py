"""Scheduler: exact hit rates, pages in use, eviction order, preemption, invariants, no leaks."""

import math
import random

from absl.testing import absltest

from looped.model.cache_layout import KVLayout
from looped.scheduler import pages, replay, scheduler
from looped.sim import cost_model, hardware, metrics, shape, traces

_TINY = shape.ModelShape(
  vocab_size=257,
  d_model=64,
  num_heads=2,
  num_kv_heads=1,
  head_dim=32,
  mlp_dim=128,
  mlp_type="swiglu",
  num_prelude_layers=1,
  num_core_layers=2,
  num_coda_layers=1,
  num_recurrences=4,
  tie_embeddings=True,
)


class UnitStepExecutor:
  """Every step takes one second, so hand-derived timelines are easy to state."""

  def __init__(self, fast_forward: bool = True):
    self.batches = []
    if fast_forward:
      self.decode_step_time = lambda num_seqs, context: 1.0

  def execute(self, batch):
    self.batches.append(list(zip([s.request.request_id for s in batch.seqs], batch.num_new_tokens)))
    return 1.0


def _req(rid, arrival, prompt, output, hashes, block=4):
  return traces.Request(rid, arrival, prompt, output, tuple(hashes), block_size=block)


class RecordingPool(pages.PagePool):
  """Remembers every evicted page, in order."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.evicted = []

  def _evict(self, n):
    got = super()._evict(n)
    self.evicted.extend(got)
    return got


def _run(requests, num_pages, *, page_size=4, budget=64, max_seqs=8, executor=None, ff=True):
  executor = executor or UnitStepExecutor(fast_forward=ff)
  pool = RecordingPool(num_pages, debug=True)
  config = scheduler.SchedulerConfig(page_size, budget, max_seqs)
  sched = scheduler.Scheduler(config, pool, executor, fast_forward=ff, check_invariants=True)
  replay.replay(requests, sched)
  return sched


class HandBuiltTracesTest(absltest.TestCase):
  def test_hits_and_tail_first_eviction(self):
    # Page = block = 4 tokens, 4 pages in all.
    reqs = [
      _req(0, 0.0, 12, 1, [1, 2, 3]),  # A: 3 pages, all registered.
      _req(1, 5.0, 10, 2, [1, 2, 9]),  # B: hits A's pages 0-1 (8 tokens), adds 1 page.
      _req(2, 10.0, 8, 1, [5, 6]),  # D: B's keyless page 3 + evicts A's tail page 2.
      _req(3, 20.0, 13, 1, [1, 2, 3, 4]),  # C: A's prefix; page 2 is gone, so 8 tokens hit.
    ]
    sched = _run(reqs, num_pages=4)
    by_id = {s.request.request_id: s for s in sched.finished}
    self.assertEqual([by_id[i].cached_tokens for i in range(4)], [0, 8, 0, 8])
    # A holds pages [0, 1, 2], released tail first; D holds [3, 2]; C hits A's 0, 1 and evicts
    # D's pages, tail (2) first.
    self.assertEqual(sched.pool.evicted, [2, 2, 3])
    m = metrics.summarize(sched, page_bytes=1.0)
    self.assertEqual(m["hit_rate"], 16 / 43)
    self.assertEqual(m["peak_pages_in_use"], 4)  # C: 13 prompt tokens = 4 pages.
    self.assertEqual([by_id[i].finish_s for i in range(4)], [1.0, 7.0, 11.0, 21.0])
    self.assertEqual(m["ttft_s"]["p50"], 1.0)
    self.assertEqual((sched.pool.num_in_use, sched.pool.num_free), (0, 4))

  def test_last_prompt_token_is_always_computed(self):
    reqs = [_req(0, 0.0, 8, 1, [1, 2]), _req(1, 9.0, 8, 1, [1, 2])]
    sched = _run(reqs, num_pages=None)
    self.assertEqual([s.cached_tokens for s in sched.finished], [0, 4])

  def test_concurrent_requests_share_pages(self):
    reqs = [
      _req(0, 0.0, 8, 10, [1, 2]),  # E: decodes steps 2..10.
      _req(1, 0.5, 9, 5, [1, 2, 7]),  # F: joins at t=1, hits E's 2 pages while E decodes.
    ]
    sched = _run(reqs, num_pages=None)
    e, f = sorted(sched.finished, key=lambda s: s.request.request_id)
    self.assertEqual(f.cached_tokens, 8)
    self.assertEqual((e.first_token_s, e.finish_s, f.first_token_s, f.finish_s), (1, 10, 2, 6))
    # At t=6 both hold 2 shared + 2 own pages: 6 distinct pages.
    self.assertEqual(sched.pool.peak_in_use, 6)
    m = metrics.summarize(sched, page_bytes=1.0)
    self.assertEqual(m["hit_rate"], 8 / 17)
    self.assertEqual(m["ttft_s"]["p90"], 1.0 + 0.9 * 0.5)  # TTFTs 1.0 and 1.5.
    self.assertEqual(m["tpot_s"]["p50"], (9 / 9 + 4 / 4) / 2)

  def test_preemption_victim_is_last_admitted_and_is_recomputed(self):
    reqs = [
      _req(0, 0.0, 8, 9, [1, 2]),  # G: up to 16 tokens of K/V = 4 pages.
      _req(1, 0.0, 4, 9, [3]),  # H: up to 12 tokens = 3 pages; 5 pages cannot hold both.
    ]
    for ff in (True, False):
      with self.subTest(fast_forward=ff):
        sched = _run(reqs, num_pages=5, ff=ff)
        g, h = sorted(sched.finished, key=lambda s: s.request.request_id)
        self.assertEqual((g.num_preemptions, h.num_preemptions), (0, 1))
        self.assertEqual(sched.stats.num_preemptions, 1)
        # Step 6 (t 5->6): G needs its 4th page, H (last admitted) is preempted with 5 outputs.
        # G finishes at t=9; H re-admits at t=9 hitting its prompt page (its output page was
        # evicted first: tail first), recomputes 5 tokens and decodes its last 3.
        self.assertEqual((g.finish_s, h.first_token_s, h.finish_s), (9.0, 1.0, 13.0))
        self.assertEqual((sched.stats.readmit_tokens, sched.stats.readmit_cached_tokens), (9, 4))
        self.assertEqual(sched.stats.first_cached_tokens, 0)
        self.assertEqual(sched.pool.num_in_use, 0)

  def test_chunked_prefill_respects_token_budget_and_fcfs(self):
    reqs = [_req(0, 0.0, 10, 2, [1, 2, 3]), _req(1, 0.0, 6, 1, [4, 5])]
    executor = UnitStepExecutor(fast_forward=False)
    _run(reqs, num_pages=None, budget=4, executor=executor, ff=False)
    self.assertEqual(
      executor.batches, [[(0, 4)], [(0, 4)], [(0, 2), (1, 2)], [(0, 1), (1, 3)], [(1, 1)]]
    )

  def test_running_cap(self):
    reqs = [_req(i, 0.0, 4, 3, [10 + i]) for i in range(3)]
    executor = UnitStepExecutor(fast_forward=False)
    _run(reqs, num_pages=None, max_seqs=2, executor=executor, ff=False)
    self.assertEqual(max(len(b) for b in executor.batches), 2)
    self.assertEqual(executor.batches[3], [(2, 4)])  # Admitted once the first two finished.

  def test_requests_that_cannot_fit_are_rejected(self):
    reqs = [_req(0, 0.0, 16, 2, [1, 2, 3, 4]), _req(1, 0.0, 4, 1, [5])]
    sched = _run(reqs, num_pages=4)  # Request 0 needs ceil(17 / 4) = 5 pages.
    self.assertEqual([r.request_id for r in sched.rejected], [0])
    self.assertLen(sched.finished, 1)
    m = metrics.summarize(sched, page_bytes=1.0)
    self.assertEqual((m["num_requests"], m["num_rejected"]), (2, 1))


class SlotRecorder(UnitStepExecutor):
  """Also records each batch's state slots."""

  def __init__(self):
    super().__init__(fast_forward=False)
    self.slots = []

  def execute(self, batch):
    self.slots.append({s.request.request_id: s.slot for s in batch.seqs})
    return super().execute(batch)


class StateSlotsTest(absltest.TestCase):
  """state_slots: one slot per running request, taken at admission, given back on finish and
  preemption; prefix_caching off: no hits, not even on a request's own pages."""

  def test_slots_follow_admission_finish_and_preemption(self):
    reqs = [
      _req(0, 0.0, 8, 9, [1, 2]),  # G: 4 pages at its longest.
      _req(1, 0.0, 4, 9, [3]),  # H: preempted at step 6 when G needs its 4th page.
      _req(2, 0.5, 8, 1, [1, 2]),  # G's prompt: would hit G's pages with prefix caching.
    ]
    executor = SlotRecorder()
    config = scheduler.SchedulerConfig(4, 64, 2, state_slots=True, prefix_caching=False)
    pool = pages.PagePool(5, debug=True)
    sched = scheduler.Scheduler(config, pool, executor, fast_forward=False, check_invariants=True)
    replay.replay(reqs, sched)
    g, h, k = sorted(sched.finished, key=lambda s: s.request.request_id)
    self.assertEqual((g.num_preemptions, h.num_preemptions), (0, 1))
    self.assertEqual(executor.slots[0], {0: 0, 1: 1})  # Lowest free slot first.
    # H's slot went back when it was preempted; the queued K waits for G's pages; H is
    # re-admitted once G finishes and takes the lowest free slot, 0.
    h_slots = [step[1] for step in executor.slots if 1 in step]
    self.assertEqual(h_slots[0], 1)
    self.assertEqual(h_slots[-1], 0)
    for step in executor.slots:  # Never two running requests on one slot.
      self.assertLen(set(step.values()), len(step))
    self.assertEqual((g.slot, h.slot, k.slot), (None, None, None))
    self.assertEqual(sorted(sched.free_slots), [0, 1])
    self.assertEqual(sched.stats.first_cached_tokens + sched.stats.readmit_cached_tokens, 0)
    self.assertEqual(sched.pool.num_in_use, 0)


class CostModelTimingTest(absltest.TestCase):
  def _executor(self):
    hw = hardware.Hardware("slow", 1e9, 1e9, 1.0, 1e-3, "test")
    return cost_model.CostModelExecutor(_TINY, hw, KVLayout(True, "bf16"))

  def test_lone_request_ttft_is_the_prefill_time(self):
    # Hand-derived for _TINY: N = 64*64*2 + 64*32*2 + 3*64*128 = 36864 per layer, L = 1+4*2+1 =
    # 10 executions, L_kv = 4 shared layers of 1*32*2*2 = 128 bytes per token.
    n_layer, executions, head = 36864, 10, 257 * 64

    def step(q, c, sampled):
      flops = 2 * executions * n_layer * q + 4 * 2 * 32 * executions * (q * c + q * (q + 1) // 2)
      flops += 2 * head * sampled
      moved = 2 * (executions * n_layer + head) + executions * 128 * c + 4 * 128 * q
      return max(flops / 1e9, moved / 1e9) + 1e-3

    for prompt, budget, expected in (
      (1000, 8192, step(1000, 0, 1)),
      (1000, 256, step(256, 0, 0) + step(256, 256, 0) + step(256, 512, 0) + step(232, 768, 1)),
    ):
      with self.subTest(budget=budget):
        reqs = [_req(0, 3.0, prompt, 1, range(math.ceil(prompt / 512)), block=512)]
        sched = _run(reqs, None, page_size=16, budget=budget, executor=self._executor())
        (seq,) = sched.finished
        self.assertAlmostEqual(seq.first_token_s - seq.arrival_s, expected, places=12)


def _random_workload(rng, n):
  spec = traces.SyntheticSpec(
    num_requests=n,
    rate_per_s=rng.choice([5.0, 50.0, 500.0]),
    num_sessions=rng.randint(1, 12),
    system_prompt_tokens=rng.choice([0, 100, 512]),
    mean_turn_tokens=rng.choice([20.0, 150.0]),
    mean_output_tokens=rng.choice([3.0, 30.0]),
    max_prompt_tokens=rng.choice([700, 2000]),
    seed=rng.randint(0, 1 << 30),
  )
  return traces.synthetic(spec)


class RandomWorkloadTest(absltest.TestCase):
  def test_invariants_no_leak_and_fast_forward_is_exact(self):
    rng = random.Random(0)
    hw = hardware.PROFILES["h200"]
    total = 0
    while total < 1000:
      reqs = _random_workload(rng, rng.randint(60, 160))
      total += len(reqs)
      page_size = rng.choice([1, 7, 16, 48, 512])
      share = rng.random() < 0.5
      config = scheduler.SchedulerConfig(page_size, rng.choice([32, 300, 2048]), rng.randint(1, 20))
      longest = max(-(-(r.prompt_len + r.output_len - 1) // page_size) for r in reqs)
      num_pages = rng.choice([None, int(longest * rng.uniform(0.8, 3.0)) + 1])
      finish = {}
      for ff in (True, False):
        executor = cost_model.CostModelExecutor(_TINY, hw, KVLayout(share, "fp8"))
        pool = pages.PagePool(num_pages, debug=ff)
        sched = scheduler.Scheduler(config, pool, executor, fast_forward=ff, check_invariants=ff)
        replay.replay(reqs, sched)
        self.assertEqual(pool.num_in_use, 0)
        self.assertEqual(pool.num_free, math.inf if num_pages is None else num_pages)
        self.assertLen(sched.finished + sched.rejected, len(reqs))
        finish[ff] = (
          sorted((s.request.request_id, s.first_token_s, s.finish_s) for s in sched.finished),
          sched.stats.num_preemptions,
          sched.stats.first_cached_tokens,
        )
      self.assertEqual(finish[True], finish[False])


class MooncakeReuseTest(absltest.TestCase):
  def test_unbounded_non_overlapping_hit_rate_equals_trace_prefix_reuse(self):
    reqs = traces.load_mooncake("mooncake_conversation", max_requests=400)
    reqs = [
      traces.Request(r.request_id, 1e5 * i, r.prompt_len, 1, r.block_hashes)
      for i, r in enumerate(reqs)
    ]
    for page_size in (512, 16, 48):
      with self.subTest(page_size=page_size):
        seen, hit, total = set(), 0, 0
        for r in reqs:  # Reference: leading blocks seen before, capped before the last token.
          run = 0
          while run < len(r.block_hashes) and r.block_hashes[run] in seen:
            run += 1
          covered = min(run * 512, r.prompt_len - 1)
          hit += covered // page_size * page_size
          total += r.prompt_len
          seen.update(r.block_hashes)
        executor = cost_model.CostModelExecutor(
          _TINY, hardware.PROFILES["h200"], KVLayout(True, "bf16")
        )
        config = scheduler.SchedulerConfig(page_size, 8192, 64)
        sched = scheduler.Scheduler(config, pages.PagePool(None), executor)
        replay.replay(reqs, sched)
        self.assertLess(max(s.finish_s - s.arrival_s for s in sched.finished), 1e5)  # Disjoint.
        self.assertEqual(sched.stats.first_cached_tokens, hit)
        self.assertEqual(sched.stats.first_prompt_tokens, total)
        self.assertGreater(hit / total, 0.1)
        if page_size == 512:
          self.assertEqual(traces.ideal_hit_rate(reqs), hit / total)


if __name__ == "__main__":
  absltest.main()
