"""Sampling: top-k / top-p masks against a numpy derivation, seeds, greedy limit, logprobs and
stops, on the sampler alone and through the engine."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from looped.engine import sampling
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import init_params
from looped.model.looped_lm import LoopedLM
from looped_testing import TINY_MODEL

CFG = dataclasses.replace(TINY_MODEL, max_seq_len=40)


def _numpy_mask(logits, k, p):
  """Top-k then top-p, written out one token at a time."""
  v = len(logits)
  order = sorted(range(v), key=lambda i: (-logits[i], i))
  kept = order[: k if k > 0 else v]
  z = np.exp(np.array([logits[i] for i in kept], np.float64) - max(logits))
  probs = z / z.sum()
  mask = np.zeros(v, bool)
  mass = 0.0
  for rank, i in enumerate(kept):
    if rank == 0 or mass < p:
      mask[i] = True
    mass += probs[rank]
  return mask


def _sample(logits, temperature, top_k=0, top_p=1.0, seed=0, index=0):
  b = logits.shape[0]
  full = lambda x, dt: jnp.full((b,), x, dt)
  return sampling.sample(
    jnp.asarray(logits, jnp.float32),
    full(temperature, jnp.float32),
    full(top_k, jnp.int32),
    full(top_p, jnp.float32),
    full(seed, jnp.int32),
    jnp.asarray(index, jnp.int32) + jnp.zeros((b,), jnp.int32),
  )


class SamplerTest(absltest.TestCase):
  def test_filter_mask_matches_numpy(self):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 13)).astype(np.float32)
    logits[1, [2, 7, 9]] = logits[1].max() + 1.0  # A three-way tie at the top.
    for k, p in [(0, 1.0), (1, 1.0), (4, 1.0), (0, 0.5), (0, 0.9), (3, 0.6), (2, 0.01), (13, 0.99)]:
      got = sampling.filter_mask(
        jnp.asarray(logits), jnp.full((5,), k, jnp.int32), jnp.full((5,), p, jnp.float32)
      )
      want = np.stack([_numpy_mask(list(row), k, p) for row in logits])
      np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"top_k={k} top_p={p}")

  def test_sampled_tokens_stay_in_the_mask(self):
    rng = np.random.default_rng(1)
    logits = np.repeat(rng.normal(size=(1, 13)).astype(np.float32), 64, axis=0)
    allowed = _numpy_mask(list(logits[0]), 3, 0.8)
    tokens, _ = _sample(logits, 1.0, top_k=3, top_p=0.8, index=np.arange(64))
    self.assertTrue(allowed[np.asarray(tokens)].all())
    self.assertGreater(len(set(np.asarray(tokens).tolist())), 1)  # It does sample.

  def test_seed_reproducible_and_distinct(self):
    logits = np.random.default_rng(2).normal(size=(32, 50)).astype(np.float32)
    a, _ = _sample(logits, 1.0, seed=7, index=3)
    b, _ = _sample(logits, 1.0, seed=7, index=3)
    c, _ = _sample(logits, 1.0, seed=8, index=3)
    np.testing.assert_array_equal(a, b)
    self.assertGreater(int(jnp.sum(a != c)), 5)

  def test_temperature_to_zero_is_greedy(self):
    logits = np.random.default_rng(3).normal(size=(32, 50)).astype(np.float32)
    greedy = np.argmax(logits, axis=-1)
    for t in (0.0, 1e-4):
      tokens, _ = _sample(logits, t, seed=5)
      np.testing.assert_array_equal(np.asarray(tokens), greedy, err_msg=f"temperature {t}")

  def test_logprob_is_log_softmax_of_raw_logits(self):
    logits = np.random.default_rng(4).normal(size=(8, 20)).astype(np.float32)
    tokens, logprobs = _sample(logits, 0.7, top_k=5, seed=1)
    z = logits - logits.max(-1, keepdims=True)
    want = (z - np.log(np.exp(z).sum(-1, keepdims=True)))[np.arange(8), np.asarray(tokens)]
    np.testing.assert_allclose(np.asarray(logprobs), want, atol=1e-6)

  def test_check_stop(self):
    decode = lambda ids: "".join(chr(97 + t) for t in ids)
    sp = SamplingParams(stop_token_ids=(3,), stop_strings=("cd", "x"))
    self.assertEqual(sampling.check_stop([0, 1], sp, decode), (None, "ab"))
    self.assertEqual(sampling.check_stop([0, 3], sp, decode), ("stop_token", "a"))
    self.assertEqual(sampling.check_stop([0, 2, 4, 2], sp, decode), (None, "acec"))
    self.assertEqual(sampling.check_stop([0, 1, 2, 4], sp, decode), (None, "abce"))
    self.assertEqual(sampling.check_stop([1, 2, 2, 3], sp, decode), ("stop_token", "bcc"))
    sp_cd = SamplingParams(stop_strings=("cd",))
    self.assertEqual(sampling.check_stop([0, 2, 3, 4], sp_cd, decode), ("stop_string", "a"))
    self.assertEqual(sampling.check_stop([1, 23, 5], sp, decode), ("stop_string", "b"))

  def test_bad_params_name_the_field(self):
    for field, value in [("top_p", 0.0), ("top_k", -1), ("temperature", -1.0), ("seed", -3)]:
      with self.assertRaisesRegex(ValueError, field):
        dataclasses.replace(SamplingParams(), **{field: value}).check(61)
    with self.assertRaisesRegex(ValueError, "stop_token_ids"):
      SamplingParams(stop_token_ids=(61,)).check(61)


def _decode(ids):
  return "".join(chr(48 + t) for t in ids)  # 61 printable characters.


class EngineSamplingTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = LoopedLM(CFG)
    cls.params = init_params(cls.model, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))

  def _engine(self, **kw):
    return Engine(
      self.model,
      self.params,
      EngineConfig(
        share_kv=True,
        num_pages=16,
        page_size=4,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        row_buckets=(4,),
        token_buckets=(8,),
        column_buckets=(),  # One page-table width: fewer compilations.
        **kw,
      ),
      decode=_decode,
    )

  def test_logprobs_and_seeds_through_the_engine(self):
    rng = np.random.default_rng(5)
    sp = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, seed=11)
    prompt = tuple(int(t) for t in rng.integers(0, 61, 7))
    others = [
      GenRequest(i, tuple(int(t) for t in rng.integers(0, 61, 9)), dataclasses.replace(sp, seed=i))
      for i in range(1, 4)
    ]
    engine = self._engine(record_logits=True)
    alone = engine.generate([GenRequest(0, prompt, sp)])[0]
    state = engine.results[0]
    positions = range(len(prompt) - 1, len(prompt) - 1 + len(alone.tokens))
    logits = np.stack([state.logits[p] for p in positions])
    z = logits - logits.max(-1, keepdims=True)
    log_softmax = z - np.log(np.exp(z).sum(-1, keepdims=True))
    want = log_softmax[np.arange(len(alone.tokens)), alone.tokens]
    np.testing.assert_allclose(alone.logprobs, want, atol=1e-5)
    # Token n is drawn with key fold_in(PRNGKey(seed), n) among the top-p survivors.
    for n, row in enumerate(logits):
      mask = _numpy_mask(list(row), 0, 0.9)
      key = jax.random.fold_in(jax.random.PRNGKey(11), n)
      drawn = jax.random.categorical(key, jnp.where(jnp.asarray(mask), jnp.asarray(row), -jnp.inf))
      self.assertEqual(alone.tokens[n], int(drawn), f"token {n}")
    # The same request among others (different batch rows, chunking) draws the same tokens.
    crowded = engine.generate(others[:2] + [GenRequest(0, prompt, sp)] + others[2:])[2]
    self.assertEqual(crowded.tokens, alone.tokens)
    reseeded = engine.generate([GenRequest(0, prompt, dataclasses.replace(sp, seed=12))])[0]
    self.assertNotEqual(reseeded.tokens, alone.tokens)

  def test_stops_truncate(self):
    rng = np.random.default_rng(6)
    prompt = tuple(int(t) for t in rng.integers(0, 61, 6))
    engine = self._engine()
    full = engine.generate([GenRequest(0, prompt, SamplingParams(max_new_tokens=10))])[0]
    self.assertEqual(full.finish_reason, "length")
    self.assertEqual(full.text, _decode(full.tokens))
    stop_token = full.tokens[3]
    cut = full.tokens.index(stop_token)
    got = engine.generate(
      [GenRequest(0, prompt, SamplingParams(max_new_tokens=10, stop_token_ids=(stop_token,)))]
    )[0]
    self.assertEqual(got.tokens, full.tokens[: cut + 1])
    self.assertEqual(got.text, _decode(full.tokens[:cut]))
    self.assertEqual(got.finish_reason, "stop_token")
    self.assertEqual(engine.scheduler.pool.num_in_use, 0)

    stop = _decode(full.tokens[4:6])
    n = next(n for n in range(1, 11) if stop in _decode(full.tokens[:n]))
    got = engine.generate(
      [GenRequest(0, prompt, SamplingParams(max_new_tokens=10, stop_strings=(stop,)))]
    )[0]
    self.assertEqual(got.tokens, full.tokens[:n])
    self.assertEqual(got.text, full.text[: full.text.find(stop)])
    self.assertEqual(got.finish_reason, "stop_string")


if __name__ == "__main__":
  absltest.main()
