"""Shareability evaluation: exact decode vs Jacobi at T passes, hand-computed bytes and ratios."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped.benice import evaluation, report
from looped.model import LoopedLM, init_params
from looped.model.kv_cache import init_cache
from looped.model.sharing import jacobi_forward

TINY = testing.TINY_MODEL


class EvaluateTest(absltest.TestCase):
  def test_exact_shared_decode_equals_jacobi_at_t_passes(self):
    t = 8
    model = LoopedLM(TINY)
    rows = jax.random.randint(jax.random.PRNGKey(1), (3, 2, t + 1), 0, TINY.vocab_size)
    batches = [{"inputs": np.asarray(r[:, :-1]), "targets": np.asarray(r[:, 1:])} for r in rows]
    params = init_params(model, jax.random.PRNGKey(0), batches[0]["inputs"])
    fns = evaluation.make_stats_fns(TINY)
    m = evaluation.evaluate(fns, TINY, params, batches, (1, t), decode_batches=2)

    sub = m["decode_subset"]
    self.assertEqual((sub["rows"], sub["tokens"], m["eval_tokens"]), (4, 4 * t, 6 * t))
    exact = m["ppl_shared_exact_subset"]
    # T passes (T - 1 suffice) make the Jacobi scheme exact: same tokens, same perplexity.
    np.testing.assert_allclose(m["ppl_shared_jacobi_subset"][str(t)], exact, rtol=1e-5)
    # One pass is not exact on this model, and sharing changes its perplexity.
    self.assertGreater(abs(m["ppl_shared_jacobi_subset"]["1"] - exact), 1e-3)
    self.assertGreater(abs(m["gap_exact"]), 1e-4)  # Near-uniform random model: a small gap.
    np.testing.assert_allclose(m["gap_exact"], exact / m["ppl_unshared_subset"] - 1, rtol=1e-6)
    lo, hi = m["gap_exact_ci95"]
    self.assertLessEqual(lo, m["gap_exact"])
    self.assertLessEqual(m["gap_exact"], hi)
    for n in ("1", str(t)):
      np.testing.assert_allclose(
        m["gap_jacobi_eval"][n],
        m["ppl_shared_jacobi_eval"][n] / m["ppl_unshared_eval"] - 1,
        rtol=1e-6,
      )
    # Decoding the subset one batch (2 rows) at a time instead of in one call changes nothing.
    split = evaluation.evaluate(fns, TINY, params, batches, (1,), decode_batches=2, decode_rows=2)
    np.testing.assert_allclose(split["ppl_shared_exact_subset"], exact, rtol=1e-6)
    # Defaults: the decode subset is the whole eval set, still exact against T Jacobi passes.
    whole = evaluation.evaluate(fns, TINY, params, batches, (t,))
    self.assertEqual(whole["decode_subset"]["rows"], 6)
    np.testing.assert_allclose(whole["ppl_unshared_subset"], whole["ppl_unshared_eval"], rtol=1e-9)
    np.testing.assert_allclose(
      whole["ppl_shared_exact_subset"], whole["ppl_shared_jacobi_eval"][str(t)], rtol=1e-5
    )
    # K/V drift: the final recurrence is at distance 0 from itself; earlier ones are not.
    for kind in ("k", "v"):
      drift = np.asarray(m["kv_drift"][kind])
      self.assertEqual(drift.shape, (TINY.num_core_layers, TINY.num_recurrences))
      np.testing.assert_allclose(drift[:, -1], 0.0, atol=1e-7)
      self.assertTrue((drift[:, :-1] > 1e-3).all())

    # Unshared perplexity of the whole set from a plain forward, batch by batch.
    ce = [
      -jax.nn.log_softmax(model.apply(params, b["inputs"])[0])[
        np.arange(2)[:, None], np.arange(t)[None, :], b["targets"]
      ].sum()
      for b in batches
    ]
    np.testing.assert_allclose(m["ppl_unshared_eval"], math.exp(sum(ce) / (6 * t)), rtol=1e-5)
    np.testing.assert_allclose(m["ppl_unshared_subset"], math.exp(sum(ce[:2]) / (4 * t)), rtol=1e-5)
    # One Jacobi pass, from its own forward (the evaluation takes it along one chain of passes).
    ce1 = [
      -jax.nn.log_softmax(jacobi_forward(model, params, b["inputs"], 1)[0])[
        np.arange(2)[:, None], np.arange(t)[None, :], b["targets"]
      ].sum()
      for b in batches
    ]
    np.testing.assert_allclose(
      m["ppl_shared_jacobi_eval"]["1"], math.exp(sum(ce1) / (6 * t)), rtol=1e-5
    )
    self.assertLen(m["residual_norms"], TINY.num_recurrences)
    self.assertLen(m["contraction_ratios"], TINY.num_recurrences - 1)

  def test_block_prefill_gaps(self):
    """Block prefill on the decode subset: C = 1 is exact shared decode, C >= T the unshared
    forward, and C = 3 (blocks 0-2, 3-5, 6-7) equals its Jacobi form after 2 passes."""
    t = 8
    model = LoopedLM(TINY)
    rows = jax.random.randint(jax.random.PRNGKey(4), (3, 2, t + 1), 0, TINY.vocab_size)
    batches = [{"inputs": np.asarray(r[:, :-1]), "targets": np.asarray(r[:, 1:])} for r in rows]
    params = init_params(model, jax.random.PRNGKey(0), batches[0]["inputs"])
    fns = evaluation.make_stats_fns(TINY)
    blocks = (1, 3, t, 2 * t)
    m = evaluation.evaluate(
      fns, TINY, params, batches, (1,), decode_batches=2, prefill_blocks=blocks
    )
    ppl, gap, ci = m["ppl_shared_block_subset"], m["gap_block"], m["gap_block_ci95"]
    self.assertEqual([list(ppl), list(gap), list(ci)], [["1", "3", "8", "16"]] * 3)
    exact, unshared = m["ppl_shared_exact_subset"], m["ppl_unshared_subset"]
    np.testing.assert_allclose(ppl["1"], exact, rtol=1e-5)
    np.testing.assert_allclose(ci["1"], m["gap_exact_ci95"], atol=1e-5)
    for c in (str(t), str(2 * t)):  # One block covers the row: the unshared forward.
      np.testing.assert_allclose(ppl[c], unshared, rtol=1e-5)
      np.testing.assert_allclose(ci[c], [0.0, 0.0], atol=1e-5)
    for c in ppl:
      np.testing.assert_allclose(gap[c], ppl[c] / unshared - 1, rtol=1e-6)
      self.assertLessEqual(ci[c][0], gap[c] + 1e-12)
      self.assertLessEqual(gap[c], ci[c][1] + 1e-12)
    # C = 3 is neither exact decode nor the unshared forward on this model ...
    self.assertGreater(abs(ppl["3"] - exact), 1e-4)
    self.assertGreater(abs(ppl["3"] - unshared), 1e-4)
    # ... and equals an independent form: Jacobi passes reading as block prefill does, after
    # (number of blocks - 1) = 2 passes, from its own parallel forwards.
    ce = [
      -jax.nn.log_softmax(jacobi_forward(model, params, b["inputs"], 2, prefill_block=3)[0])[
        np.arange(2)[:, None], np.arange(t)[None, :], b["targets"]
      ].sum()
      for b in batches[:2]
    ]
    np.testing.assert_allclose(ppl["3"], math.exp(sum(ce) / (4 * t)), rtol=1e-5)
    # Decoding the subset one batch at a time changes nothing; no block sizes: empty dicts.
    split = evaluation.evaluate(
      fns, TINY, params, batches, (1,), decode_batches=2, decode_rows=2, prefill_blocks=(3,)
    )
    np.testing.assert_allclose(split["ppl_shared_block_subset"]["3"], ppl["3"], rtol=1e-6)
    none = evaluation.evaluate(fns, TINY, params, batches, (1,), decode_batches=2, drift=False)
    self.assertEqual(
      (none["ppl_shared_block_subset"], none["gap_block"], none["gap_block_ci95"]), ({}, {}, {})
    )

  def test_kv_drift_of_mla_and_kda_layers(self):
    """Drift reads each mixer's two cache entries: MLA latent / RoPE key, KDA state / conv tail."""
    cfg = dataclasses.replace(
      TINY, core_mixers=("kda", "mla"), mla_kv_rank=16, mla_rope_dim=4, kda_chunk_size=4
    )
    model = LoopedLM(cfg)
    inputs_BxT = jax.random.randint(jax.random.PRNGKey(3), (2, 7), 0, cfg.vocab_size)
    params = init_params(model, jax.random.PRNGKey(0), inputs_BxT)
    dk, dv, k, v = evaluation.make_stats_fns(cfg).drift(params, inputs_BxT, None)
    # Independently: an unshared decode of all 7 tokens leaves each recurrence's entries.
    cache = init_cache(cfg, 2, 7, share_kv=False)
    _, aux = model.apply(params, inputs_BxT, cache=cache)
    kda_state, mla = aux["cache"].layers["core"]
    expected = [(kda_state.state_BxNxHxE, kda_state.conv_BxWxM), mla]
    for layer, (first, second) in enumerate(expected):
      for d, n, x in ((dk, k, first), (dv, v, second)):
        x_RxN = np.asarray(x, np.float64).reshape(cfg.num_recurrences, -1)
        np.testing.assert_allclose(d[layer], ((x_RxN - x_RxN[-1]) ** 2).sum(-1), rtol=1e-4)
        np.testing.assert_allclose(n[layer], (x_RxN[-1] ** 2).sum(), rtol=1e-5)
        self.assertGreater(float(d[layer][0]), 1e-6 * float(n[layer]))
    # The whole evaluation runs on this hybrid, and T - 1 Jacobi passes equal exact decode.
    targets_BxT = jnp.roll(inputs_BxT, -1, axis=1)
    batches = [{"inputs": np.asarray(inputs_BxT), "targets": np.asarray(targets_BxT)}]
    m = evaluation.evaluate(evaluation.make_stats_fns(cfg), cfg, params, batches, (6,))
    np.testing.assert_allclose(
      m["ppl_shared_jacobi_eval"]["6"], m["ppl_shared_exact_subset"], rtol=1e-5
    )
    np.testing.assert_allclose(m["kv_drift"]["k"][0], np.sqrt(dk[0] / k[0]), rtol=1e-5)

  def test_kv_format_exact_decode_equals_jacobi_at_t_passes(self):
    t = 6
    model = LoopedLM(TINY)
    rows = jax.random.randint(jax.random.PRNGKey(2), (1, 2, t + 1), 0, TINY.vocab_size)
    batches = [{"inputs": np.asarray(r[:, :-1]), "targets": np.asarray(r[:, 1:])} for r in rows]
    params = init_params(model, jax.random.PRNGKey(0), batches[0]["inputs"])
    exact = evaluation.evaluate(
      evaluation.make_stats_fns(TINY), TINY, params, batches, (t,), decode_batches=1
    )
    fp8 = evaluation.evaluate(
      evaluation.make_stats_fns(TINY, "fp8"), TINY, params, batches, (t,), 1, kv_format="fp8"
    )
    # The quantized cache in exact decode and the quantized Jacobi reads agree ...
    np.testing.assert_allclose(
      fp8["ppl_shared_jacobi_subset"][str(t)], fp8["ppl_shared_exact_subset"], rtol=1e-5
    )
    # A format's own evaluation (no Jacobi passes, no drift) gives the same perplexities.
    fast = evaluation.evaluate(
      evaluation.make_stats_fns(TINY, "fp8"),
      TINY,
      params,
      batches,
      (),
      1,
      kv_format="fp8",
      drift=False,
    )
    for key in ("ppl_unshared_eval", "ppl_shared_exact_subset", "gap_exact"):
      np.testing.assert_allclose(fast[key], fp8[key], rtol=1e-6)
    self.assertEqual((fast["ppl_shared_jacobi_eval"], "kv_drift" in fast), ({}, False))
    # ... and differ from float32 K/V; fp8 stores 1 byte per value + a 4-byte scale per head.
    self.assertGreater(abs(fp8["ppl_unshared_eval"] - exact["ppl_unshared_eval"]), 1e-6)
    self.assertEqual(
      fp8["kv_bytes_per_token"],
      {"shared": (1 + 1 + 2) * 2 * 2 * (8 + 4), "unshared": (1 + 1 + 2 * 3) * 2 * 2 * (8 + 4)},
    )

  def test_kv_policy_gaps(self):
    # Each extra policy's exact-decode perplexity against T - 1 Jacobi passes under the same
    # policy (tests/kv_policy_test.py: equal to exact decode), its gap against the unshared
    # forward, and its bytes counted by hand.
    t = 6
    model = LoopedLM(TINY)
    rows = jax.random.randint(jax.random.PRNGKey(2), (1, 2, t + 1), 0, TINY.vocab_size)
    batches = [{"inputs": np.asarray(r[:, :-1]), "targets": np.asarray(r[:, 1:])} for r in rows]
    params = init_params(model, jax.random.PRNGKey(0), batches[0]["inputs"])
    fns = evaluation.make_stats_fns(TINY, None, "first")
    policies = ("stride2", "first")
    m = evaluation.evaluate(
      fns, TINY, params, batches, (1,), drift=False, kv_policy="first", kv_policies=policies
    )
    inputs, targets = batches[0]["inputs"], batches[0]["targets"]
    ce = lambda logits: (
      -jax.nn.log_softmax(logits)[np.arange(2)[:, None], np.arange(t)[None, :], targets].sum()
    )
    ppl_un = math.exp(ce(model.apply(params, inputs)[0]) / (2 * t))
    layer = 2 * 2 * 8 * 2  # One GQA layer copy: K and V, 2 KV heads of 8 values, bf16.
    copies = {"stride2": 2, "first": 1}  # R = 3: stride2 reads 2 2 3, first 1 1 1.
    self.assertEqual(list(m["kv_policies"]), list(policies))
    for name in policies:
      f = m["kv_policies"][name]
      logits = jacobi_forward(model, params, inputs, t - 1, kv_policy=name)[0]
      want = math.exp(ce(logits) / (2 * t))
      np.testing.assert_allclose(f["ppl_shared_exact_subset"], want, rtol=1e-5)
      np.testing.assert_allclose(f["gap_exact"], want / ppl_un - 1, rtol=1e-4, atol=1e-6)
      lo, hi = f["gap_exact_ci95"]
      self.assertLessEqual(lo, f["gap_exact"])
      self.assertLessEqual(f["gap_exact"], hi)
      self.assertEqual(f["kv_bytes_per_token"], (1 + 1 + 2 * copies[name]) * layer)
      self.assertEqual(len(f["reads"]), TINY.num_recurrences)
    # The main shared metrics read under eval.kv_policy: the same decode as its entry.
    self.assertEqual(m["kv_policy"], "first")
    self.assertEqual(
      m["ppl_shared_exact_subset"], m["kv_policies"]["first"]["ppl_shared_exact_subset"]
    )
    self.assertEqual(m["kv_bytes_per_token"]["shared"], (1 + 1 + 2) * layer)
    self.assertGreater(abs(m["kv_policies"]["stride2"]["gap_exact"] - m["gap_exact"]), 1e-5)

  def test_report_lists_each_policy(self):
    entry = lambda gap: {
      "reads": [2, 2, 3],
      "cached": [2, 3],
      "kv_bytes_per_token": 384.0,
      "ppl_shared_exact_subset": 10.5,
      "gap_exact": gap,
      "gap_exact_ci95": [gap - 0.01, gap + 0.02],
    }
    models = {"benice": {"kv_policies": {"stride2": entry(0.05), "first": entry(-0.002)}}}
    table = report.kv_policies_markdown(models).splitlines()
    self.assertEqual(
      table[2], "| benice | stride2 | 2 2 3 | 2 3 | 384 | 10.500 | +5.0% [+4.0, +7.0] |"
    )
    self.assertEqual(
      table[3], "| benice | first | 2 2 3 | 2 3 | 384 | 10.500 | -0.2% [-1.2, +1.8] |"
    )
    self.assertEqual(report.policy_note({}), "")
    self.assertIn("first", report.policy_note({"kv_policy": "first"}))

  def test_kv_bytes_per_token(self):
    # Shared: prelude 1 + coda 1 + core 2 layers; unshared: core 2 x R=3. K and V, 2 KV heads
    # of 8 values, 2 bytes each (bf16).
    self.assertEqual(
      evaluation.kv_bytes_per_token(TINY),
      {"shared": (1 + 1 + 2) * 2 * 2 * 8 * 2, "unshared": (1 + 1 + 2 * 3) * 2 * 2 * 8 * 2},
    )

  def test_gap_ci95_hand_derived_cases(self):
    rng = np.random.default_rng(0)
    unshared = rng.normal(100.0, 10.0, size=64)
    # Every row pays exactly 0.5 nats more over 10 tokens: the gap is exp(0.05) - 1 on every
    # resample, so the interval collapses onto it.
    np.testing.assert_allclose(
      evaluation.gap_ci95(unshared + 0.5, unshared, 10), [math.expm1(0.05)] * 2, rtol=1e-12
    )
    # Noisy differences: the interval holds the point estimate, and 16x the rows (same
    # distribution) narrow it about 4x.
    diff = rng.normal(0.3, 2.0, size=64)
    lo, hi = evaluation.gap_ci95(unshared + diff, unshared, 10)
    point = math.expm1(diff.mean() / 10)
    self.assertLess(lo, point)
    self.assertLess(point, hi)
    lo16, hi16 = evaluation.gap_ci95(np.tile(unshared + diff, 16), np.tile(unshared, 16), 10)
    self.assertBetween((hi - lo) / (hi16 - lo16), 3.0, 5.0)
    # Normal theory: half-width ~ 1.96 sd(diff) / sqrt(n) / T on the CE scale.
    half = 1.96 * diff.std() / math.sqrt(64) / 10
    self.assertBetween((hi - lo) / 2 / half, 0.85, 1.15)

  def test_contraction_ratios(self):
    np.testing.assert_allclose(evaluation.contraction_ratios([2.0, 1.0, 0.25]), [0.5, 0.25])


if __name__ == "__main__":
  absltest.main()
