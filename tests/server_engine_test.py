"""The two engine hooks the server needs: Scheduler.abort (a client went away) and per-position
logprobs (echo / top_logprobs), each against an independent reference."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import init_params
from looped.model.looped_lm import LoopedLM
from looped.scheduler import pages, scheduler
from looped.server.engine_loop import EngineLoop
from looped.server.metrics import Metrics
from looped.sim import traces


class _Unit:
  def execute(self, batch):
    return 1.0


def _req(rid, prompt, output, hashes):
  return traces.Request(rid, 0.0, prompt, output, tuple(hashes), block_size=4)


class AbortTest(absltest.TestCase):
  def _sched(self, num_pages=6):
    pool = pages.PagePool(num_pages, debug=True)
    config = scheduler.SchedulerConfig(4, 64, 2)
    return scheduler.Scheduler(config, pool, _Unit(), fast_forward=False, check_invariants=True)

  def test_abort_running_and_waiting(self):
    sched = self._sched()
    for rid, hashes in ((0, (1, 2)), (1, (3, 4)), (2, (1, 2))):
      sched.add_request(_req(rid, 9, 4, hashes))
    now = sched.step(0.0)  # Admits 0 and 1 (running cap 2); 2 waits.
    self.assertEqual([s.request.request_id for s in sched.running], [0, 1])
    self.assertEqual(sched.pool.num_in_use, 6)  # 3 pages each: 9 prompt tokens.
    self.assertIsNone(sched.abort(7))  # Unknown: nothing happens.
    seq = sched.abort(0)  # Running: its pages are released, its two full ones stay cached.
    self.assertEqual(seq.request.request_id, 0)
    self.assertEqual(sched.pool.num_in_use, 3)
    self.assertEqual(sched.pool.num_cached, 4)
    sched.check()
    now = sched.step(now)  # 2 is admitted and hits 0's two full pages.
    self.assertEqual(sched.running[-1].cached_tokens, 8)
    self.assertIsNotNone(sched.abort(2))
    sched.add_request(_req(3, 9, 4, (5, 6)))
    self.assertIsNotNone(sched.abort(3))  # Waiting: just leaves the queue.
    self.assertEqual(len(sched.waiting), 0)
    while sched.has_work():
      now = sched.step(now)
    self.assertEqual([s.request.request_id for s in sched.finished], [1])
    self.assertEqual(sched.pool.num_in_use, 0)
    sched.check()


class PositionLogprobsTest(parameterized.TestCase):
  @parameterized.parameters(True, False)
  def test_equal_log_softmax_of_the_engine_logits(self, share_kv):
    model = LoopedLM(testing.TINY_MODEL)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=share_kv,
        num_pages=8,
        page_size=4,
        max_num_batched_tokens=5,  # Prompts of 7 and 9 tokens: chunked prefill.
        max_num_seqs=2,
        row_buckets=(2,),
        token_buckets=(5,),
        column_buckets=(),
        record_logits=True,
        top_logprobs=3,
      ),
    )
    prompt = tuple(range(3, 12))
    requests = [
      GenRequest(0, prompt, SamplingParams(max_new_tokens=4)),
      GenRequest(1, prompt, SamplingParams(max_new_tokens=4), position_logprobs=True),
      GenRequest(
        2,
        prompt[:7],
        SamplingParams(max_new_tokens=3, temperature=1.0, seed=5),
        position_logprobs=True,
      ),
    ]
    gens = engine.generate(requests)
    self.assertEqual(gens[1].tokens, gens[0].tokens)  # Recording changes no token.
    self.assertEqual(engine.results[0].positions, {})  # Only those that ask record.
    for r, g in zip(requests[1:], gens[1:]):
      state = engine.results[r.request_id]
      everything = list(r.prompt_tokens) + g.tokens
      # No prefix hit (request 1 repeats request 0's prompt): every position was computed.
      self.assertEqual(sorted(state.positions), list(range(len(everything) - 1)))
      for p, (lp, top_ids, top) in state.positions.items():
        ref = np.asarray(jax.nn.log_softmax(jnp.asarray(state.logits[p], jnp.float32)))
        self.assertAlmostEqual(lp, ref[everything[p + 1]], delta=1e-5)
        np.testing.assert_allclose(top, np.sort(ref)[::-1][:3], atol=1e-5)
        np.testing.assert_allclose(ref[top_ids], top, atol=1e-5)
      np.testing.assert_allclose(
        [state.positions[r.prompt_len - 1 + j][0] for j in range(len(g.tokens))],
        g.logprobs,
        atol=1e-6,
      )
    self.assertEqual(gens[1].cached_prompt_tokens, 0)


class SubmitTest(absltest.TestCase):
  def test_engine_loop_refuses_what_the_engine_would(self):
    # Behind the HTTP checks: a request the engine cannot serve never reaches the queue.
    model = LoopedLM(testing.TINY_MODEL)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=True,
        num_pages=8,
        page_size=4,
      ),
    )
    loop = EngineLoop(engine, max_waiting=4, metrics=Metrics("tiny"))  # Not started.
    for sampling, pattern in (
      (SamplingParams(temperature=float("nan")), "temperature"),
      (SamplingParams(max_new_tokens=0), "max_new_tokens"),
      (SamplingParams(max_new_tokens=15), "exceeds max_model_len 16"),
    ):
      with self.assertRaisesRegex(ValueError, pattern):
        loop.submit([GenRequest(0, (1, 2), sampling)], [lambda event: None])
    self.assertEqual(loop.num_waiting(), 0)
    loop.submit([GenRequest(0, (1, 2), SamplingParams(max_new_tokens=4))], [lambda event: None])
    self.assertEqual(loop.num_waiting(), 1)


if __name__ == "__main__":
  absltest.main()
