"""Test-time depth against the public references: the converted tiny Huginn generates, greedy
at batch 1, the tokens and per-token recurrences of Huginn's own
`generate_with_adaptive_compute` for every criterion (tests/testdata/huginn_tiny/adaptive.json,
written by tests/make_adaptive_references.py from the public modeling code: zero initial state,
float32, its default cache, which our unshared 'skip' lookup reads as it does), through the
model's decode calls and through the engine, batched or alone; Ouro's gate exits where Ouro's
own forward does (tests/testdata/ouro_tiny/golden.npz, threshold 0.5)."""

import dataclasses
import json
import os
import tempfile

import convert_golden_test as golden_lib
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import DepthParams, GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import adaptive
from looped.model.kv_cache import init_cache
from looped.model.looped_lm import LoopedLM

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
MAX_RECURRENCES = 8  # The golden cases' largest num_steps (the tiny model's R is 4).


def depth_params(settings: dict) -> DepthParams:
  """Huginn's generate_with_adaptive_compute arguments as a request's depth settings."""
  criterion = settings.get("criterion", "none")
  return DepthParams(
    recurrences=settings["num_steps"],
    exit_criterion=criterion,
    exit_threshold=settings.get("exit_threshold"),
    min_recurrences=settings.get("min_steps", 0) + 1,  # Huginn's min_steps m: m + 1 (adaptive).
    exit_every=settings.get("check_criterion_every_n_steps", 1),
    init_scale=0.0,
    continuous_compute=settings.get("continuous_compute", False),
    exit_in_prefill=not settings.get("do_not_exit_in_prefill", False),
  )


def generate(
  model, params, prompt, depth: DepthParams, new_tokens: int, share_kv=False, block=None, **kw
):
  """Greedy tokens and each one's recurrences at batch 1 by the model's decode calls: the
  prompt in one call (as Huginn's first step; with `block`, in calls of that many tokens, as
  the engine's prefill blocks), then one call per token."""
  cfg = model.cfg
  cache = init_cache(cfg, 1, len(prompt) + new_tokens, share_kv, depths=not share_kv)
  step = jax.jit(lambda p, x, c, d: model.apply(p, x, cache=c, depth=d, **kw))
  block = block or len(prompt)
  calls = [(prompt[i : i + block], True) for i in range(0, len(prompt), block)]
  last_block = len(calls) - 1  # The prompt's last block samples the first token.
  calls += [(None, False)] * (new_tokens - 1)
  tokens, depths, state = [], [], None
  for i, (chunk, prefill) in enumerate(calls):
    x = jnp.asarray([chunk if prefill else [tokens[-1]]], jnp.int32)
    criterion = depth.exit_criterion if depth.exit_in_prefill or not prefill else "none"
    warm = depth.continuous_compute and not prefill
    inputs = adaptive.depth_inputs(
      1,
      cfg.d_model,
      depth.recurrences,
      criterion,
      depth.exit_threshold,
      depth.min_recurrences,
      depth.exit_every,
      depth.init_scale,
      warm,
      state,
    )
    logits, aux = step(params, x, cache, inputs)
    cache, state = aux["cache"], aux["state_BxD"]
    if i < last_block:
      continue
    tokens.append(int(jnp.argmax(logits[0, -1])))
    depths.append(int(aux["depth_B"][0]))
  return tokens, depths


class HuginnAdaptiveTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cfg, cls.params, _ = golden_lib.convert("huginn_tiny", os.path.join(cls._tmp.name, "w"))
    cls.cfg = cfg
    cls.model = LoopedLM(dataclasses.replace(cfg, num_recurrences=MAX_RECURRENCES))
    with open(os.path.join(_DATA, "huginn_tiny", "adaptive.json")) as f:
      cls.golden = json.load(f)

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def _check_case(self, name: str, model=None, params=None):
    case = self.golden["cases"][name]
    depth = depth_params(case["settings"])
    for prompt, tokens, steps in zip(self.golden["prompts"], case["tokens"], case["recurrences"]):
      got = generate(
        model or self.model,
        params or self.params,
        prompt,
        depth,
        len(tokens),
        exit_lookup="skip",
      )
      self.assertEqual(got, (tokens, steps), name)

  def test_every_case_matches_huginn(self):
    for name in self.golden["cases"]:
      with self.subTest(name):
        self._check_case(name)

  def test_engine_batched_and_alone_match_huginn(self):
    """The engine, unshared with the 'skip' lookup, each prompt's block one call: the
    reference's tokens and recurrences, both prompts together or each alone."""
    config = EngineConfig(
      share_kv=False,
      num_pages=16,
      page_size=8,
      max_num_seqs=4,
      max_num_batched_tokens=32,
      prefill_block=16,
      max_recurrences=MAX_RECURRENCES,
      exit_lookup="skip",
    )
    engine = Engine(LoopedLM(self.cfg), self.params, config)
    names = ("kl", "latent-diff_continuous", "entropy-diff_no_prefill_exit", "none_r3")
    requests, want = [], []
    for name in names:
      case = self.golden["cases"][name]
      depth = depth_params(case["settings"])
      for prompt, tokens, steps in zip(self.golden["prompts"], case["tokens"], case["recurrences"]):
        sampling = SamplingParams(max_new_tokens=len(tokens))
        requests.append(GenRequest(len(requests), tuple(prompt), sampling, depth=depth))
        want.append((tokens, steps))
    batched = engine.generate(requests)
    self.assertEqual([(g.tokens, g.recurrences) for g in batched], want)
    for request, expected in zip(requests[:3], want):
      (alone,) = engine.generate([request])
      self.assertEqual((alone.tokens, alone.recurrences), expected)
    self.assertEqual(engine.pages_in_use(), 0)


class OuroGateTest(absltest.TestCase):
  """Ouro's published rule on its own gate logits: the golden's exit steps and chosen logits
  (threshold 0.5, every step run, as its forward does)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.golden = dict(np.load(os.path.join(_DATA, "ouro_tiny", "golden.npz")))

  def test_gate_rule_reproduces_ouro(self):
    gates_RxN = self.golden["step_gate_r4"].reshape(4, -1)
    n = gates_RxN.shape[1]
    state = adaptive.init_state(jnp.zeros((n, 1, 1)), 2)
    exited = jnp.zeros((n,), bool)
    step_N = jnp.full((n,), 3)
    gate = jnp.full((n,), adaptive.criterion_index("gate"))
    for r in range(4):
      state = adaptive.gate_step(state, jnp.asarray(gates_RxN[r]), ~exited)
      checked = ~exited & adaptive.is_check(r + 1, jnp.zeros(n, int), jnp.ones(n, int), 4)
      exit_N, state = adaptive.check(
        state,
        gate,
        jnp.full((n,), 0.5),
        checked,
        jnp.ones((n, 1, 1)),
        jnp.zeros((n, 2)),
        jnp.ones((n, 1), bool),
      )
      step_N = jnp.where(exit_N & ~exited, r, step_N)
      exited = exited | exit_N
    logits = self.golden["step_logits_r4"].reshape(4, n, -1)[np.asarray(step_N), np.arange(n)]
    want = self.golden["logits_exit0.5_r4"].reshape(n, -1)
    np.testing.assert_allclose(logits, want, rtol=0, atol=0)
    self.assertGreater(len(set(np.asarray(step_N).tolist())), 2)  # Exits at several steps.

  def test_first_token_decode_exits_with_ouro(self):
    """Each row's first token (no past: its computation is Ouro's whatever the exits) decoded
    with the gate at 0.5 exits after Ouro's step and gives its logits."""
    with tempfile.TemporaryDirectory() as tmp:
      cfg, params, golden = golden_lib.convert("ouro_tiny", os.path.join(tmp, "w"))
    model = LoopedLM(cfg)
    ids = jnp.asarray(golden["input_ids"][:, :1])
    cache = init_cache(cfg, 2, 4, True)
    depth = adaptive.depth_inputs(2, cfg.d_model, cfg.num_recurrences, "gate", 0.5)
    logits, aux = model.apply(params, ids, cache=cache, depth=depth)
    self.assertEqual(aux["depth_B"].tolist(), [3, 4])  # Steps 2 and 3, 0-based.
    err = golden_lib.relative_error(logits[:, 0], golden["logits_exit0.5_r4"][:, 0])
    self.assertLess(err, golden_lib.TOLERANCE)


if __name__ == "__main__":
  absltest.main()
