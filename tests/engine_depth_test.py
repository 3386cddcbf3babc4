"""Test-time depth in the engine: requests with different recurrences, exit criteria, checks and
warm starts share steps, and each gets the tokens and per-token recurrences of its own decode
calls on a dense cache (the model alone, adaptive_exit_test.generate), batched or alone, with
prefix hits, and through preemption and recompute, in both layouts; every page is free after."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from adaptive_exit_test import generate

import looped_testing as testing
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import DepthParams, GenRequest
from looped.engine.sampling import SamplingParams
from looped.model.looped_lm import LoopedLM, init_params

CFG = dataclasses.replace(testing.TINY_MODEL, max_seq_len=48)  # R = 3.
TOP = 5  # The engine's max_recurrences: above the trained R.
NEW = 6
BLOCK = 16  # The engine's prefill block and token budget.
SETTINGS = (
  DepthParams(),
  DepthParams(recurrences=2),
  DepthParams(recurrences=TOP, exit_criterion="entropy-diff", exit_threshold=0.003),
  DepthParams(
    recurrences=TOP, exit_criterion="entropy-diff", exit_threshold=0.003, continuous_compute=True
  ),
  DepthParams(recurrences=TOP, exit_criterion="kl", exit_threshold=0.002, min_recurrences=2),
  DepthParams(recurrences=TOP, exit_criterion="latent-diff", exit_threshold=0.3, exit_every=2),
  DepthParams(
    recurrences=TOP, exit_criterion="minp-kl", exit_threshold=0.01, exit_in_prefill=False
  ),
)


def _requests():
  """Prompts of a shared 16-token prefix (a block of 4 pages: hits between equal settings) and
  2-4 tokens of their own (a second block)."""
  rng = np.random.default_rng(0)
  prefix = [int(t) for t in rng.integers(0, CFG.vocab_size, BLOCK)]
  out = []
  for i, depth in enumerate(SETTINGS + SETTINGS[2:4]):
    own = [int(t) for t in rng.integers(0, CFG.vocab_size, 2 + i % 3)]
    prompt = tuple(prefix + own)
    out.append(GenRequest(i, prompt, SamplingParams(max_new_tokens=NEW), depth=depth))
  return out


class EngineDepthTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = LoopedLM(CFG)
    cls.params = init_params(cls.model, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    cls.requests = _requests()

  def _engine(self, share_kv, num_pages, seqs=4):
    config = EngineConfig(
      share_kv=share_kv,
      num_pages=num_pages,
      page_size=4,
      max_num_seqs=seqs,
      max_num_batched_tokens=BLOCK,
      prefill_block=BLOCK,
      max_recurrences=TOP,
      check_invariants=True,
    )
    return Engine(self.model, self.params, config)

  def _reference(self, share_kv):
    """Each request alone on a dense cache: its prompt in blocks, then a call per token."""
    model = LoopedLM(dataclasses.replace(CFG, num_recurrences=TOP))
    out = []
    for r in self.requests:
      depth = dataclasses.replace(r.depth, recurrences=r.depth.recurrences or 3)
      prompt = list(r.prompt_tokens)
      out.append(generate(model, self.params, prompt, depth, NEW, share_kv, block=BLOCK))
    return out

  @parameterized.parameters(True, False)
  def test_each_request_is_its_own_decode(self, share_kv):
    want = self._reference(share_kv)
    self.assertGreater(len({d for _, ds in want for d in ds}), 2)  # Several depths.
    engine = self._engine(share_kv, num_pages=64)
    got = engine.generate(self.requests)
    self.assertEqual([(g.tokens, g.recurrences) for g in got], want)
    self.assertGreater(engine.hit_rate(), 0)  # Equal settings share their prefix pages.
    for request, expected in zip(self.requests[:4], want):
      (alone,) = engine.generate([request])
      self.assertEqual((alone.tokens, alone.recurrences), expected)
    tight = self._engine(share_kv, num_pages=8)  # Preempts and recomputes.
    got = tight.generate(self.requests)
    self.assertGreater(tight.stats.num_preemptions, 0)
    self.assertEqual([(g.tokens, g.recurrences) for g in got], want)
    self.assertEqual((engine.pages_in_use(), tight.pages_in_use()), (0, 0))

  def test_an_engine_without_depth_refuses_depth_settings(self):
    config = EngineConfig(share_kv=True, num_pages=16, page_size=4, adaptive_depth=False)
    engine = Engine(self.model, self.params, config)
    for depth in (DepthParams(recurrences=2), DepthParams(exit_criterion="kl")):
      with self.assertRaisesRegex(ValueError, "adaptive_depth"):
        engine.check_request(GenRequest(0, (1, 2), depth=depth))
    engine.check_request(self.requests[0])  # The model's own depth: served.
    with self.assertRaisesRegex(ValueError, "exit_criterion"):
      self._engine(True, 16).check_request(
        GenRequest(0, (1, 2), depth=DepthParams(exit_criterion="gate"))
      )


if __name__ == "__main__":
  absltest.main()
