"""Self-speculative decoding in the engine (looped/engine/speculative.py, docs/engine.md):

- unshared, greedy: the same tokens and logits as plain decoding at R, for GQA, MLA and a
  KDA:MLA hybrid, raw and in a KV format, with prefix hits and preemptions in the run;
- shared: equal to plain shared decoding with k Jacobi verify passes, and not with the one
  block pass (so the passes are what makes it equal);
- sampling: the acceptance rule's emitted tokens are distributed as the verifier's (chi-square
  at 0.1% over draws of `accept`, red for a rule broken on purpose), and the engine's first
  speculative token's empirical distribution matches the model's exact marginal;
- pages: every page free after a run, and after an abort in the middle of one.
"""

import dataclasses

import engine_test
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from scipy import stats

import looped_testing as testing
from looped import config_checks
from looped.engine import checks, speculative
from looped.engine.config import GenConfig
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.engine.speculative import SpeculativeParams
from looped.model.looped_lm import LoopedLM, init_params

CFG = dataclasses.replace(testing.TINY_MODEL, max_seq_len=64)  # R = 3.
MLA = dataclasses.replace(engine_test.MLA, max_seq_len=64)  # engine_test's mixer models.
KDA_MLA = dataclasses.replace(engine_test.KDA_MLA, max_seq_len=64)
SPEC = SpeculativeParams(recurrences=1, tokens=4)
SIGNIFICANCE = 1e-3  # Chi-square tests reject at this p-value.


def _params(cfg):
  return init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))


def _requests(vocab: int, spec=None, n: int = 6, new: int = 14):
  """n prompts, most sharing an 8-token head (prefix hits), of 9-13 tokens."""
  rng = np.random.default_rng(1)
  head = [int(t) for t in rng.integers(0, vocab, 8)]
  out = []
  for i in range(n):
    own = [int(t) for t in rng.integers(0, vocab, 1 + i % 5)]
    prompt = tuple((head if i % 3 else []) + own + ([] if i % 3 else head))
    sp = SamplingParams(max_new_tokens=new - i % 3)
    out.append(GenRequest(i, prompt, sp, speculative=spec))
  return out


def _engine(cfg, share_kv=False, kv_format=None, num_pages=64, **kw):
  settings = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=16, prefill_block=8)
  settings.update(row_buckets=(4,), token_buckets=(8,), column_buckets=(8, 16))  # Few shapes.
  config = EngineConfig(
    share_kv=share_kv,
    kv_format=kv_format,
    num_pages=num_pages,
    record_logits=True,
    check_invariants=True,
    **{**settings, **kw},
  )
  return Engine(LoopedLM(cfg), _params(cfg), config)


def _max_logit_gap(plain, spec) -> float:
  return max(
    float(np.abs(p.logits[k] - s.logits[k]).max()) for p, s in zip(plain, spec) for k in s.logits
  )


class SpeculativeEngineTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("gqa", CFG, None),
    ("gqa_bf16", CFG, "bf16"),
    ("mla_nvfp4", MLA, "nvfp4"),
    ("kda_mla", KDA_MLA, None),
  )
  def test_unshared_greedy_equals_plain_decoding(self, cfg, kv_format):
    # 12 pages of 4 tokens for 4 running requests of up to 27 tokens: preemptions.
    engine = _engine(cfg, kv_format=kv_format, num_pages=12)
    plain = engine.generate(_requests(cfg.vocab_size))
    plain_summary = engine.summary(plain)
    spec = engine.generate(_requests(cfg.vocab_size, SPEC))
    summary = engine.summary(spec)
    self.assertEqual([g.tokens for g in spec], [g.tokens for g in plain])
    self.assertLess(_max_logit_gap(plain, spec), 2e-4)
    self.assertGreater(summary["speculative_rounds"], 0)
    self.assertGreater(summary["accepted_tokens"], 0)  # Some drafts were kept ...
    self.assertLess(summary["accepted_tokens"], summary["drafted_tokens"])  # ... some not.
    self.assertLess(summary["num_steps"], plain_summary["num_steps"])
    self.assertGreater(summary["preemptions"], 0)
    if cfg is not KDA_MLA:  # A recurrent state is not a page: no prefix hits there.
      self.assertGreater(summary["hit_rate"], 0)
    self.assertEqual(engine.pages_in_use(), 0)

  def test_shared_equals_plain_with_lookahead_jacobi_passes_only(self):
    requests = _requests(CFG.vocab_size)
    plain = _engine(CFG, share_kv=True).generate(requests)
    k = SPEC.tokens
    jacobi = _engine(CFG, share_kv=True, speculative_verify=k)
    exact = jacobi.generate(_requests(CFG.vocab_size, SPEC))
    self.assertEqual([g.tokens for g in exact], [g.tokens for g in plain])
    self.assertLess(_max_logit_gap(plain, exact), 2e-4)
    block = _engine(CFG, share_kv=True).generate(_requests(CFG.vocab_size, SPEC))
    self.assertGreater(_max_logit_gap(plain, block), 1e-2)  # Block reads differ.

  def test_abort_in_the_middle_frees_every_page(self):
    engine = _engine(CFG)
    for r in _requests(CFG.vocab_size, SPEC, n=4, new=20):
      engine.add_request(r)
    now, rounds = 0.0, 0
    while rounds < 3:
      out = engine.step(now)
      now = out.now
      rounds = sum(len(s.rounds) for s in engine.executor.states.values())
    self.assertGreater(engine.pages_in_use(), 0)
    for rid in range(4):
      engine.abort(rid)
    self.assertEqual(engine.pages_in_use(), 0)
    self.assertFalse(engine.has_unfinished())

  def test_warmup_compiles_the_default_speculative_calls(self):
    """A server speculating by default compiles its speculative calls in the warm-up, and its
    steps run in them (the smallest compiled shape that holds each call), compiling nothing."""
    engine = _engine(CFG, speculative=SPEC)
    engine.start_warmup()
    engine.compile_thread.join()
    compiled = set(engine.executor.spec_steps.shapes())
    self.assertTrue(set(engine.speculative_shapes()) <= compiled)
    out = engine.generate(_requests(CFG.vocab_size))  # The engine's default: speculation.
    self.assertGreater(engine.summary(out)["speculative_rounds"], 0)
    self.assertEqual(set(engine.executor.spec_steps.shapes()), compiled)

  def test_bad_settings_name_the_field(self):
    engine = _engine(CFG)
    bad = [
      (SpeculativeParams(recurrences=4), "speculative_recurrences = 4"),  # Above R = 3.
      (SpeculativeParams(recurrences=1, tokens=9), "speculative_tokens = 9"),
      (SpeculativeParams(recurrences=1, tokens=0), "speculative_tokens = 0"),
    ]
    for spec, message in bad:
      request = GenRequest(0, (1, 2, 3), speculative=spec)
      with self.assertRaisesRegex(ValueError, message):
        engine.add_request(request)
    with self.assertRaisesRegex(ValueError, "unshared cache verifies exactly in one pass"):
      _engine(CFG, speculative_verify=2)
    with self.assertRaisesRegex(ValueError, "expected 'block' or a number"):
      speculative.parse_verify("twice")
    # The programs' check, before anything is restored or compiled: one device only.
    config, model = GenConfig(speculative_recurrences=1), dataclasses.asdict(CFG)
    checks.check_section(config, "gen", model, (1, 1, 1))
    with self.assertRaisesRegex(
      config_checks.ConfigError,
      r"config.gen.speculative_recurrences = 1 is invalid: speculation runs on one device",
    ):
      checks.check_section(config, "gen", model, (2, 1, 1))


def _draws(p_KxV, q_KxV, n: int, temperature: float = 1.0):
  """n rounds of `accept` with drafts drawn from q: (emitted [n, K], m [n])."""
  k, v = p_KxV.shape
  seed_N = jnp.arange(n, dtype=jnp.int32)
  keys = jax.vmap(lambda s: jax.random.split(jax.random.PRNGKey(s + 10**6), k))(seed_N)
  draft_NxK = jax.vmap(jax.vmap(jax.random.categorical, (0, 0)), (0, None))(keys, jnp.log(q_KxV))
  bcast = lambda x: jnp.broadcast_to(x, (n, k, v))
  emitted, m, _ = jax.jit(speculative.accept)(
    draft_NxK.astype(jnp.int32),
    bcast(q_KxV),
    bcast(p_KxV),
    jnp.full((n,), k, jnp.int32),
    jnp.full((n,), temperature, jnp.float32),
    seed_N,
    jnp.zeros((n,), jnp.int32),
  )
  return np.asarray(emitted), np.asarray(m)


def _chi2_pvalue(tokens, probs) -> float:
  probs = np.asarray(probs, np.float64)
  counts = np.bincount(tokens, minlength=len(probs))
  return float(stats.chisquare(counts, len(tokens) * probs / probs.sum()).pvalue)


class AcceptanceRuleTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(0)
    self.p = jnp.asarray(rng.dirichlet(np.ones(5), size=3), jnp.float32)  # Verifier, 3 x 5.
    self.q = jnp.asarray(rng.dirichlet(np.ones(5), size=3), jnp.float32)  # Drafter.

  def test_emitted_tokens_follow_the_verifier(self):
    emitted, m = _draws(self.p, self.q, 40_000)
    self.assertGreater(_chi2_pvalue(emitted[:, 0], self.p[0]), SIGNIFICANCE)
    second = m >= 2  # Rounds whose first draft was kept: their second token.
    self.assertGreater(_chi2_pvalue(emitted[second, 1], self.p[1]), SIGNIFICANCE)
    # Acceptance is min(1, p/q) in expectation: sum_x min(p(x), q(x)).
    expected = float(jnp.minimum(self.p[0], self.q[0]).sum())
    self.assertAlmostEqual(float(np.mean(m >= 2)), expected, delta=0.01)

  def test_drafts_from_the_verifier_are_always_kept(self):
    _, m = _draws(self.p, self.p, 2_000)
    np.testing.assert_array_equal(m, 3)

  def test_greedy_keeps_the_prefix_that_matches_the_argmax(self):
    v = 5
    p = jax.nn.one_hot(jnp.asarray([2, 4, 1]), v)
    draft = jnp.asarray([[2, 4, 0], [2, 3, 1], [0, 4, 1], [2, 4, 1]], jnp.int32)
    q = jax.nn.one_hot(draft, v)
    emitted, m, a = speculative.accept(
      draft, q, jnp.broadcast_to(p, (4, 3, v)), jnp.full((4,), 3), jnp.zeros((4,)),
      jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32),
    )  # fmt: skip
    np.testing.assert_array_equal(a, [2, 1, 0, 3])
    np.testing.assert_array_equal(m, [3, 2, 1, 3])
    np.testing.assert_array_equal(emitted[0], [2, 4, 1])
    np.testing.assert_array_equal(emitted[1, :2], [2, 4])
    np.testing.assert_array_equal(emitted[2, :1], [2])
    np.testing.assert_array_equal(emitted[3], [2, 4, 1])


SMALL_VOCAB = dataclasses.replace(CFG, vocab_size=6)


class SpeculativeSamplingEngineTest(absltest.TestCase):
  def test_first_speculative_token_matches_the_exact_marginal(self):
    """Token 2 of each request is the first of a speculative round; over 800 seeds its
    distribution is the model's marginal sum_x1 p(x1 | prompt) p(x2 | prompt, x1)."""
    cfg = SMALL_VOCAB
    model, params = LoopedLM(cfg), _params(cfg)
    prompt = (1, 3, 0, 5, 2)
    n = 800
    sp = lambda seed: SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed)
    requests = [GenRequest(i, prompt, sp(i), speculative=SpeculativeParams(1, 2)) for i in range(n)]
    engine = _engine(
      cfg, num_pages=8 * 32, max_num_seqs=32, max_num_batched_tokens=64, row_buckets=(32,)
    )
    out = engine.generate(requests)
    self.assertGreater(engine.summary(out)["speculative_rounds"], 0)
    second = np.asarray([g.tokens[1] for g in out])
    # The exact marginal from the parallel forward (every recurrence, unshared).
    rows = jnp.asarray([list(prompt) + [x] for x in range(cfg.vocab_size)], jnp.int32)
    logits, _ = model.apply(params, rows)
    p1 = jax.nn.softmax(logits[0, len(prompt) - 1])
    p2 = jax.nn.softmax(logits[:, len(prompt)], axis=-1)
    marginal = np.asarray(p1 @ p2, np.float64)
    self.assertGreater(_chi2_pvalue(second, marginal), SIGNIFICANCE)


if __name__ == "__main__":
  absltest.main()
