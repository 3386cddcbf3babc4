"""One request that breaks an engine step fails alone; every other request's tokens equal the
engine's batch mode (Engine.generate without it), token for token.

Three kinds of failure are injected into a running batch of the server's engine loop:
- on the request's own data while its row's results are applied (the executor names it);
- in the step as a whole, before the device runs it (no request named: the loop quarantines the
  step's requests and re-admits them one at a time until the failure names its culprit);
- on the device, after the step took the pages (every cached K/V is gone: the requests in flight
  fail, and the engine serves the next ones from fresh pages).
"""

import threading
import time
from unittest import mock

from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.engine import sampling
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model.looped_lm import LoopedLM
from looped.server.engine_loop import Done, EngineLoop, Failed
from looped.server.metrics import Metrics

POISON = 59  # A token id only the poisoned request's prompt holds.
POISON_STOP = "never generated"  # A stop string only the poisoned request has.


def _engine(model, params, share_kv):
  return Engine(
    model,
    params,
    EngineConfig(
      share_kv=share_kv,
      num_pages=24,
      page_size=4,
      max_num_batched_tokens=8,  # Chunked prefill: the poisoned prompt shares steps with others.
      max_num_seqs=4,
      row_buckets=(4,),
      token_buckets=(8,),
    ),
  )


def _requests():
  """Greedy and seeded-sampling requests of mixed lengths; request 3 is the poisoned one."""
  out = []
  for rid in range(7):
    prompt = tuple((rid * 7 + j) % 50 + 1 for j in range(3 + rid % 4))
    if rid == 3:
      prompt = prompt + (POISON,)
    temperature = 0.0 if rid % 2 else 1.0
    stops = (POISON_STOP,) if rid == 3 else ()
    params = SamplingParams(max_new_tokens=5, temperature=temperature, stop_strings=stops)
    out.append(GenRequest(rid, prompt, params))
  return out


def _serve(loop: EngineLoop, requests) -> dict:
  """Submits every request at once; returns each one's final event (Done or Failed)."""
  events, lock, done = {}, threading.Lock(), threading.Event()

  def sink_for(rid):
    def sink(event):
      if isinstance(event, (Done, Failed)):
        with lock:
          events[rid] = event
          if len(events) == len(requests):
            done.set()

    return sink

  loop.submit(requests, [sink_for(r.request_id) for r in requests])
  if not done.wait(120):
    raise AssertionError(f"requests unfinished: {len(requests) - len(events)} of {len(requests)}")
  return events


class IsolationTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = LoopedLM(testing.TINY_MODEL)
    cls.params = testing.random_params(testing.TINY_MODEL)
    cls._references = {}

  def _reference(self, share_kv, requests):
    """Engine.generate's tokens for `requests`: those of one batch of every request but the
    poisoned one, generated once per layout (a request's tokens do not depend on its batch)."""
    if share_kv not in self._references:
      good = [r for r in _requests() if r.request_id != 3]
      gens = _engine(self.model, self.params, share_kv).generate(good)
      self._references[share_kv] = {r.request_id: g.tokens for r, g in zip(good, gens)}
    return {r.request_id: self._references[share_kv][r.request_id] for r in requests}

  def _loop(self, share_kv):
    loop = EngineLoop(
      _engine(self.model, self.params, share_kv), max_waiting=16, metrics=Metrics("tiny")
    )
    return loop.start()

  def _check_others(self, share_kv, events, requests, failed=(3,)):
    good = [r for r in requests if r.request_id not in failed]
    reference = self._reference(share_kv, good)
    for r in good:
      event = events[r.request_id]
      self.assertIsInstance(event, Done, f"request {r.request_id}: {event}")
      self.assertEqual(event.tokens, reference[r.request_id], f"request {r.request_id}")
    for rid in failed:
      self.assertIsInstance(events[rid], Failed)
      self.assertEqual(events[rid].status, 500)

  @parameterized.parameters(True, False)
  def test_a_row_that_fails_on_its_own_data_fails_alone(self, share_kv):
    original = sampling.check_stop

    def check_stop(generated, params, decode):
      if POISON_STOP in params.stop_strings:
        raise OverflowError("injected: this request's stop check fails")
      return original(generated, params, decode)

    requests = _requests()
    loop = self._loop(share_kv)
    try:
      with mock.patch.object(sampling, "check_stop", check_stop):
        events = _serve(loop, requests)
      self.assertEqual(loop.pages_in_use(), 0)
    finally:
      loop.stop(30)
    self.assertIn("injected", events[3].message)
    self._check_others(share_kv, events, requests)

  @parameterized.parameters(True, False)
  def test_a_step_that_fails_without_naming_a_request_finds_its_culprit(self, share_kv):
    loop = self._loop(share_kv)
    step = loop.engine.executor._call
    calls = {"failed": 0}

    def poisoned_step(params, pages, tokens_BxQ, *rest):
      if (tokens_BxQ == POISON).any():  # Before the device runs: the pages stay valid.
        calls["failed"] += 1
        raise ValueError("injected: the step fails whenever the poisoned prompt is in it")
      return step(params, pages, tokens_BxQ, *rest)

    loop.engine.executor._call = poisoned_step
    requests = _requests()
    try:
      events = _serve(loop, requests)
      self.assertEqual(loop.pages_in_use(), 0)
    finally:
      loop.stop(30)
    self.assertGreaterEqual(calls["failed"], 2)  # Once in the batch, once alone.
    self._check_others(share_kv, events, requests)

  def test_a_failure_on_the_device_fails_the_requests_in_flight_and_serves_the_next(self):
    loop = self._loop(True)
    step = loop.engine.executor._call
    armed = {"on": True}

    def device_failure(params, pages, *rest):
      out = step(params, pages, *rest)  # The pages are donated: gone once this returns.
      if armed["on"]:
        armed["on"] = False
        raise RuntimeError("injected: the device step failed")
      return out

    loop.engine.executor._call = device_failure
    requests = _requests()
    try:
      events = _serve(loop, requests[:3])
      self.assertTrue(all(isinstance(e, Failed) for e in events.values()), events)
      self.assertEqual(loop.pages_in_use(), 0)
      later = [r for r in requests[3:] if r.request_id != 3]
      events = _serve(loop, later)
      time.sleep(0.1)
      self.assertEqual(loop.pages_in_use(), 0)
    finally:
      loop.stop(30)
    self._check_others(True, events, later, failed=())


if __name__ == "__main__":
  absltest.main()
