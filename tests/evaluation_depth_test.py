"""The evaluation at test-time depth: `eval.recurrences` runs every metric at R' (the model
looping R' times), and an exit criterion adds metrics['depth']: exact decode with exits on the
decode subset, shared and unshared, its perplexity against the same layout's full depth and its
mean recurrences per token, each with a 95% interval; the eval section's depth fields are
checked naming the field."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from configs import benice as benice_config
from looped import config_checks as cc
from looped.benice import evaluation, pipeline
from looped.losses import token_cross_entropy
from looped.model import adaptive
from looped.model.looped_lm import LoopedLM, init_params
from looped.model.sharing import decode_forward

CFG = dataclasses.replace(testing.TINY_MODEL, num_recurrences=4)


def _batches(rows=4, length=8, count=2):
  tokens = jax.random.randint(jax.random.PRNGKey(3), (count, rows, length + 1), 0, CFG.vocab_size)
  tokens = np.asarray(tokens, np.int32)
  return [{"inputs": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


class EvaluationDepthTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.params = init_params(LoopedLM(CFG), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    cls.batches = _batches()

  def _evaluate(self, cfg, settings=None):
    depth = None if settings is None else evaluation.make_depth_fn(cfg, settings)
    return evaluation.evaluate(
      evaluation.make_stats_fns(cfg),
      cfg,
      self.params,
      self.batches,
      (1,),
      drift=False,
      depth=depth,
    )

  def test_exits_are_measured_against_full_depth(self):
    never = adaptive.DepthSettings(exit_criterion="kl", exit_threshold=0.0)  # KL < 0: no exit.
    metrics = self._evaluate(CFG, never)["depth"]
    for layout in ("shared", "unshared"):
      self.assertAlmostEqual(metrics[layout]["gap_vs_full_depth"], 0.0, places=5)
      self.assertEqual(metrics[layout]["mean_recurrences"], 4.0)
      self.assertEqual(metrics[layout]["mean_recurrences_ci95"], [4.0, 4.0])
    exits = adaptive.DepthSettings(exit_criterion="entropy-diff", exit_threshold=0.01)
    metrics = self._evaluate(CFG, exits)
    inputs = np.concatenate([b["inputs"] for b in self.batches])
    targets = np.concatenate([b["targets"] for b in self.batches])
    for layout, share_kv in (("shared", True), ("unshared", False)):
      logits, cache = decode_forward(
        LoopedLM(CFG), self.params, inputs, share_kv=share_kv, depth=exits
      )
      ce = float(jnp.mean(token_cross_entropy(logits, targets)))
      got = metrics["depth"][layout]
      self.assertLess(abs(got["ppl_exact_subset"] / np.exp(ce) - 1), 1e-5)
      self.assertAlmostEqual(got["mean_recurrences"], float(cache.depth_BxS.mean()), places=5)
      self.assertLess(got["mean_recurrences"], 4.0)
      lo, hi = got["mean_recurrences_ci95"]
      self.assertLessEqual(lo, got["mean_recurrences"])
      self.assertLessEqual(got["mean_recurrences"], hi)
      full = metrics["ppl_shared_exact_subset" if share_kv else "ppl_unshared_subset"]
      self.assertAlmostEqual(got["gap_vs_full_depth"], got["ppl_exact_subset"] / full - 1, 6)

  def test_eval_recurrences_runs_the_model_at_that_depth(self):
    config = benice_config.get_config()
    config.eval.recurrences = 2
    cfg = evaluation.depth_model(CFG, config.eval)
    self.assertEqual(cfg.num_recurrences, 2)
    self.assertIsNone(evaluation.depth_fn(cfg, config.eval))
    metrics = self._evaluate(cfg)
    logits, _ = LoopedLM(cfg).apply(
      self.params, np.concatenate([b["inputs"] for b in self.batches])
    )
    targets = np.concatenate([b["targets"] for b in self.batches])
    ce = float(jnp.mean(token_cross_entropy(logits, targets)))
    self.assertLess(abs(metrics["ppl_unshared_eval"] / np.exp(ce) - 1), 1e-5)
    self.assertLen(metrics["residual_norms"], 2)

  def test_bad_depth_settings_name_the_field(self):
    for field, value, extra in (
      ("exit_threshold", 1.5, {"exit_criterion": "argmax-stability"}),
      ("exit_criterion", "gate", {}),  # The default model has no exit gate.
      ("min_recurrences", 99, {}),
    ):
      config = benice_config.get_config()
      for key, v in {**extra, field: value}.items():
        testing.set_field(config, f"eval.{key}", v)
      with self.assertRaisesRegex(cc.ConfigError, f"config.eval.{field}"):
        pipeline._check_eval_depth(config)


if __name__ == "__main__":
  absltest.main()
