"""Warm-up compiles every step shape a server can meet, so no request waits for a compile.

`Padding.reachable` is checked against brute force (every batch the scheduler's limits allow,
padded by `Padding.shape`), and an engine that warmed up serves a mixed load without compiling
again (the jitted step's cache does not grow).
"""

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.engine import executor as executor_lib
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


class WarmupTest(absltest.TestCase):
  def test_no_compile_after_warmup(self):
    # A model of its own, so the shared compiled step starts with no shape of other tests.
    cfg = dataclasses.replace(testing.TINY_MODEL, mlp_dim=40)
    model = LoopedLM(cfg)
    params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=True,
        num_pages=16,
        page_size=4,
        max_num_batched_tokens=6,
        max_num_seqs=3,
        row_buckets=(3,),  # Few shapes: each compile takes seconds on a CPU.
        prefill_block=4,
        token_buckets=(2, 4),
        column_buckets=(2,),
      ),
    )
    shapes = engine.warmup()
    step = executor_lib.compiled_call(cfg, True, None, False, 0)
    self.assertIs(engine.executor._call, step)
    compiled = step._cache_size()
    self.assertEqual(compiled, shapes)  # One compilation per reachable shape, none twice.
    requests = [
      GenRequest(i, tuple(range(1, 2 + (5 * i) % 11)), SamplingParams(max_new_tokens=1 + i % 4))
      for i in range(9)
    ]
    engine.generate(requests)
    self.assertGreater(len(engine.executor.step_log), 5)
    seen = {tuple(c) for s in engine.executor.step_log for c in s["calls"]}
    self.assertGreater(len(seen), 1)
    self.assertEqual(step._cache_size(), compiled)
    # The log keeps the last steps only (a server runs for days): at most 2x its bound.
    with mock.patch.object(executor_lib, "STEP_LOG_KEPT", 2):
      log = engine.executor.step_log
      engine.generate([GenRequest(99, (1, 2, 3), SamplingParams(max_new_tokens=6))])
      self.assertBetween(len(log), 2, 4)


if __name__ == "__main__":
  absltest.main()
