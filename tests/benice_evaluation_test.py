"""Shareability evaluation: exact decode vs Jacobi at T passes, hand-computed bytes and ratios."""

import math

import jax
import numpy as np
from absl.testing import absltest

from looped import testing
from looped.benice import evaluation
from looped.model import LoopedLM

TINY = testing.TINY_MODEL


class EvaluateTest(absltest.TestCase):
  def test_exact_shared_decode_equals_jacobi_at_t_passes(self):
    t = 8
    model = LoopedLM(TINY)
    rows = jax.random.randint(jax.random.PRNGKey(1), (3, 2, t + 1), 0, TINY.vocab_size)
    batches = [{"inputs": np.asarray(r[:, :-1]), "targets": np.asarray(r[:, 1:])} for r in rows]
    params = {"params": model.init(jax.random.PRNGKey(0), batches[0]["inputs"])["params"]}
    fns = evaluation.make_stats_fns(TINY)
    m = evaluation.evaluate(fns, TINY, params, batches, (1, t), decode_batches=2)

    sub = m["decode_subset"]
    self.assertEqual((sub["rows"], sub["tokens"], m["eval_tokens"]), (4, 4 * t, 6 * t))
    # T passes (T - 1 suffice) make the Jacobi scheme exact: same tokens, same perplexity.
    np.testing.assert_allclose(sub["ppl_shared_jacobi"][str(t)], m["ppl_shared"], rtol=1e-5)
    # One pass is not exact on this model, and sharing changes its perplexity.
    self.assertGreater(abs(sub["ppl_shared_jacobi"]["1"] - m["ppl_shared"]), 1e-3)
    self.assertGreater(abs(m["gap"]), 1e-4)  # Near-uniform random model: a small gap.
    np.testing.assert_allclose(m["gap"], m["ppl_shared"] / sub["ppl_unshared"] - 1, rtol=1e-6)
    for n in ("1", str(t)):
      np.testing.assert_allclose(
        m["gap_jacobi"][n], m["ppl_shared_jacobi"][n] / m["ppl_unshared"] - 1, rtol=1e-6
      )

    # Unshared perplexity of the whole set from a plain forward, batch by batch.
    ce = [
      -jax.nn.log_softmax(model.apply(params, b["inputs"])[0])[
        np.arange(2)[:, None], np.arange(t)[None, :], b["targets"]
      ].sum()
      for b in batches
    ]
    np.testing.assert_allclose(m["ppl_unshared"], math.exp(sum(ce) / (6 * t)), rtol=1e-5)
    self.assertLen(m["residual_norms"], TINY.num_recurrences)
    self.assertLen(m["contraction_ratios"], TINY.num_recurrences - 1)

  def test_kv_format_exact_decode_equals_jacobi_at_t_passes(self):
    t = 6
    model = LoopedLM(TINY)
    rows = jax.random.randint(jax.random.PRNGKey(2), (1, 2, t + 1), 0, TINY.vocab_size)
    batches = [{"inputs": np.asarray(r[:, :-1]), "targets": np.asarray(r[:, 1:])} for r in rows]
    params = {"params": model.init(jax.random.PRNGKey(0), batches[0]["inputs"])["params"]}
    exact = evaluation.evaluate(
      evaluation.make_stats_fns(TINY), TINY, params, batches, (t,), decode_batches=1
    )
    fp8 = evaluation.evaluate(
      evaluation.make_stats_fns(TINY, "fp8"), TINY, params, batches, (t,), 1, kv_format="fp8"
    )
    # The quantized cache in exact decode and the quantized Jacobi reads agree ...
    np.testing.assert_allclose(fp8["ppl_shared_jacobi"][str(t)], fp8["ppl_shared"], rtol=1e-5)
    # ... and differ from float32 K/V; fp8 stores 1 byte per value + a 4-byte scale per head.
    self.assertGreater(abs(fp8["ppl_unshared"] - exact["ppl_unshared"]), 1e-6)
    self.assertEqual(
      fp8["kv_bytes_per_token"],
      {"shared": (1 + 1 + 2) * 2 * 2 * (8 + 4), "unshared": (1 + 1 + 2 * 3) * 2 * 2 * (8 + 4)},
    )

  def test_kv_bytes_per_token(self):
    # Shared: prelude 1 + coda 1 + core 2 layers; unshared: core 2 x R=3. K and V, 2 KV heads
    # of 8 values, 2 bytes each (bf16).
    self.assertEqual(
      evaluation.kv_bytes_per_token(TINY),
      {"shared": (1 + 1 + 2) * 2 * 2 * 8 * 2, "unshared": (1 + 1 + 2 * 3) * 2 * 2 * 8 * 2},
    )

  def test_contraction_ratios(self):
    np.testing.assert_allclose(evaluation.contraction_ratios([2.0, 1.0, 0.25]), [0.5, 0.25])


if __name__ == "__main__":
  absltest.main()
