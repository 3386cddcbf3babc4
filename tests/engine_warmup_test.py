"""Warm-up compiles every step shape a server can meet, so no request waits for a compile.

`Padding.reachable` is checked against brute force (every batch the scheduler's limits allow,
padded by `Padding.shape`); an engine that warmed up serves a mixed load without compiling
again; one that compiled only the largest shapes serves it in them, compiling nothing, with the
same tokens; and the compiled steps a process keeps are bounded (looped/engine/step_table.py).
"""

import collections
import dataclasses
import os
import subprocess
import sys
import threading
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.engine import engine as engine_lib
from looped.engine import executor as executor_lib
from looped.engine import step_table
from looped.engine.engine import Engine, EngineConfig
from looped.engine.padding import Padding
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import init_params
from looped.model.looped_lm import LoopedLM


def _brute_force(padding: Padding, max_seqs: int, budget: int, max_len: int, max_chunk: int):
  """Call shapes of every batch: n rows, each (context, new) with context + new <= max_len - 1,
  new <= max_chunk, the new tokens within the budget. Rows beyond the longest and furthest add
  nothing, so two kinds of row suffice per call: the longest chunk (at any context) and the
  furthest context (at the fewest tokens: 1 in the one-token call, 2 in the other)."""
  shapes = set()
  for n in range(1, max_seqs + 1):
    for ctx_far in range(0, max_len - 1):  # One-token rows.
      if n <= budget:
        shapes.update(padding.shape([1] * n, [ctx_far] + [0] * (n - 1)).calls)
    for longest in range(2, min(max_chunk, budget - 2 * (n - 1)) + 1):
      for ctx_long in range(0, max_len - longest):
        for ctx_far in range(0, max_len - 2):
          if n == 1:
            new, ctx = [longest], [ctx_long]
          else:
            new, ctx = [longest] + [2] * (n - 1), [ctx_long, ctx_far] + [0] * (n - 2)
          shapes.update(padding.shape(new, ctx).calls)
  return {(c.rows, c.tokens, c.columns) for c in shapes}


class ReachableTest(parameterized.TestCase):
  @parameterized.parameters(
    (4, 8, 4, 16, 8, (1, 2, 4), (2, 4, 8), (1, 2, 4)),
    (3, 5, 2, 11, 4, (1, 2, 3), (3, 4), (2, 5)),
    (2, 16, 8, 24, 16, (2,), (4, 16), ()),
    (5, 12, 4, 20, 8, (1, 2, 3, 4, 5), (2, 3, 4, 6, 8), (1, 2, 4)),
  )
  def test_equals_brute_force(self, seqs, budget, page, max_len, chunk, rows, tokens, columns):
    padding = Padding.create(page, rows, tokens, columns, max_len)
    got = padding.reachable(seqs, budget, max_len, chunk)
    self.assertLen(set(got), len(got))
    self.assertEqual(set(got), _brute_force(padding, seqs, budget, max_len, chunk))


def _engine(cfg, **overrides):
  model = LoopedLM(cfg)
  params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  config = dict(
    share_kv=True,
    num_pages=16,
    page_size=4,
    max_num_batched_tokens=6,
    max_num_seqs=3,
    row_buckets=(1, 3),  # Few shapes: each compile takes seconds on a CPU.
    prefill_block=4,
    token_buckets=(2, 4),
    column_buckets=(2,),
  )
  return Engine(model, params, EngineConfig(**{**config, **overrides}))


def _requests():
  return [
    GenRequest(i, tuple(range(1, 2 + (5 * i) % 11)), SamplingParams(max_new_tokens=1 + i % 4))
    for i in range(9)
  ]


class WarmupTest(absltest.TestCase):
  def test_no_compile_after_warmup(self):
    # A model of its own, so the process's compiled steps start with no shape of other tests.
    engine = _engine(dataclasses.replace(testing.TINY_MODEL, mlp_dim=40))
    shapes = engine.warmup()
    steps = engine.executor.steps
    self.assertEqual(steps.num_compiles, shapes)  # One compilation per reachable shape.
    self.assertEqual(steps.shapes(), set(engine.step_shapes()))
    engine.generate(_requests())
    self.assertGreater(len(engine.executor.step_log), 5)
    seen = {tuple(c) for s in engine.executor.step_log for c in s["calls"]}
    self.assertGreater(len(seen), 1)
    self.assertEqual(steps.num_compiles, shapes)  # None compiled again.
    # The log keeps the last steps only (a server runs for days): at most 2x its bound.
    with mock.patch.object(executor_lib, "STEP_LOG_KEPT", 2):
      log = engine.executor.step_log
      engine.generate([GenRequest(99, (1, 2, 3), SamplingParams(max_new_tokens=6))])
      self.assertBetween(len(log), 2, 4)

  def test_serves_from_the_cover_shapes_without_compiling(self):
    """start_warmup compiles only the largest shapes before it returns; with the background
    compiles held back, a mixed load runs in them (strict steps), compiles nothing and gives
    the tokens and logits of an engine that compiles every natural shape."""
    cfg = dataclasses.replace(testing.TINY_MODEL, mlp_dim=44)
    reference = _engine(cfg, record_logits=True).generate(_requests())
    engine = _engine(cfg, record_logits=True)
    engine.executor.steps.clear()  # The reference's shapes (the same table) freed.
    gate = threading.Event()
    warmup = engine.executor.warmup

    def gated(shapes, on_shape=None):  # The background compiles (those that report) wait.
      if on_shape is not None:
        gate.wait()
      warmup(shapes, on_shape)

    engine.executor.warmup = gated
    now, total = engine.start_warmup(on_shape=lambda done, total: None)
    cover = engine_lib.cover_shapes(engine.step_shapes())
    self.assertEqual(engine.executor.steps.shapes(), set(cover))
    self.assertEqual((now, total), (len(cover), len(engine.step_shapes())))
    self.assertLess(now, total)
    compiles = engine.executor.steps.num_compiles
    gens = engine.generate(_requests())
    self.assertEqual(engine.executor.steps.num_compiles, compiles)  # No step compiled.
    ran = {tuple(c) for s in engine.executor.step_log for c in s["calls"]}
    self.assertLessEqual(ran, set(cover))
    self.assertEqual([g.tokens for g in gens], [g.tokens for g in reference])
    for got, want in zip(gens, reference):
      self.assertEqual(sorted(got.logits), sorted(want.logits))
      for p in want.logits:
        np.testing.assert_allclose(got.logits[p], want.logits[p], atol=1e-5)
    gate.set()  # The background compiles now finish; steps use them from then on.
    engine.compile_thread.join(120)
    self.assertEqual(engine.executor.steps.shapes(), set(engine.step_shapes()))

  def test_stop_compiling_ends_the_background_compiles(self):
    engine = _engine(dataclasses.replace(testing.TINY_MODEL, mlp_dim=64))
    engine.executor.steps.clear()
    started = threading.Event()
    compile_ = engine.executor.warmup

    def slow(shapes, on_shape=None):  # The first background compile waits to be stopped.
      if not started.is_set() and engine.compile_thread is threading.current_thread():
        started.set()
        engine._stop_compiling.wait(60)
      compile_(shapes, on_shape)

    engine.executor.warmup = slow
    now, total = engine.start_warmup()
    started.wait(60)
    engine.stop_compiling(60)
    self.assertFalse(engine.compile_thread.is_alive())
    self.assertLen(engine.executor.steps.shapes(), now + 1)  # The one in flight, no more.
    self.assertLess(now + 1, total)

  def test_a_process_exits_cleanly_while_compiling_in_the_background(self):
    """A daemon thread still inside XLA when the interpreter finalizes aborted the process
    (exit -6, 'FATAL: exception not rethrown'); the engine ends its compiles at exit."""
    code = (
      "import dataclasses, jax, jax.numpy as jnp, looped_testing as t\n"
      "from looped.engine.engine import Engine, EngineConfig\n"
      "from looped.model import init_params\n"
      "from looped.model.looped_lm import LoopedLM\n"
      "cfg = dataclasses.replace(t.TINY_MODEL, mlp_dim=68)\n"
      "m = LoopedLM(cfg)\n"
      "p = init_params(m, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))\n"
      "e = Engine(m, p, EngineConfig(share_kv=True, num_pages=16, page_size=4))\n"
      "now, total = e.start_warmup()\n"
      "assert now < total, (now, total)\n"
      "print('exiting', now, total, flush=True)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    self.assertEqual(out.returncode, 0, out.stderr[-2000:])
    self.assertIn("exiting", out.stdout)

  def test_cover_shapes_hold_every_shape(self):
    shapes = [(1, 1, 2), (3, 1, 2), (1, 1, 4), (3, 2, 2), (1, 4, 4), (3, 4, 2)]
    cover = engine_lib.cover_shapes(shapes)
    self.assertEqual(cover, [(1, 1, 4), (1, 4, 4), (3, 1, 2), (3, 4, 2)])


class BoundTest(absltest.TestCase):
  def test_too_many_shapes_refused_before_compiling(self):
    cfg = dataclasses.replace(testing.TINY_MODEL, mlp_dim=48)
    with mock.patch.object(step_table, "MAX_LIVE_STEPS", 4):
      with mock.patch.object(step_table.StepTable, "compile") as compile_:
        with self.assertRaisesRegex(ValueError, r"reach \d+ step shapes, over the 4 compiled"):
          _engine(cfg)
        compile_.assert_not_called()

  def test_live_steps_bounded_over_engines(self):
    """Two engines' shapes through a bound of 3: the least recently used of the other engine's
    are freed (its next call compiles again); an engine never evicts its own."""
    a = _engine(dataclasses.replace(testing.TINY_MODEL, mlp_dim=52), row_buckets=(3,))
    b = _engine(dataclasses.replace(testing.TINY_MODEL, mlp_dim=56), row_buckets=(3,))
    with mock.patch.object(step_table, "MAX_LIVE_STEPS", 3):
      a.executor.warmup(a.step_shapes()[:3])
      self.assertLen(a.executor.steps.shapes(), 3)
      b.executor.warmup(b.step_shapes()[:2])
      self.assertLen(b.executor.steps.shapes(), 2)
      self.assertLen(a.executor.steps.shapes(), 1)  # Its two least recently used went.
      self.assertEqual(a.executor.steps.shapes(), {a.step_shapes()[2]})
      self.assertLessEqual(
        sum(k[0] in (id(a.executor.steps), id(b.executor.steps)) for k in step_table.LIVE.order),
        3,
      )
      before = a.executor.steps.num_compiles
      a.executor.warmup(a.step_shapes()[:1])  # Freed: compiled again.
      self.assertEqual(a.executor.steps.num_compiles, before + 1)

  def test_compile_near_the_map_limit_fails_clearly(self):
    engine = _engine(dataclasses.replace(testing.TINY_MODEL, mlp_dim=60), row_buckets=(3,))
    full = mock.patch.object(step_table, "_mappings", return_value=65_000)
    limit = mock.patch.object(step_table, "_max_map_count", return_value=65_530)
    alone = mock.patch.object(step_table.LIVE, "order", collections.OrderedDict())
    with full, limit, alone:
      with self.assertRaisesRegex(MemoryError, "vm.max_map_count = 65530"):
        engine.executor.warmup(engine.step_shapes()[:1])
    self.assertEqual(engine.executor.steps.shapes(), set())


if __name__ == "__main__":
  absltest.main()
