"""experiments/depth_table.py's selection rule and tables on hand-written reports, and
experiments/test_time_depth.py: its one compiled decode (R' and exits as traced data of a model
looping up to 2R) equals the evaluation's decode at each R' and exit; its plan and portable
paths."""

import dataclasses
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped.benice import evaluation
from looped.model import adaptive
from looped.model.looped_lm import LoopedLM, init_params


def _load(name: str):
  path = os.path.join(os.path.dirname(__file__), "..", "experiments", f"{name}.py")
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # Its dataclasses look their module up there.
  spec.loader.exec_module(module)
  return module


depth_table = _load("depth_table")
test_time_depth = _load("test_time_depth")


def _point(gap, hi, recurrences, ppl=5.0):
  return {
    "ppl": ppl,
    "gap_vs_full_depth": gap,
    "gap_vs_full_depth_ci95": [gap - 0.001, hi],
    "mean_recurrences": recurrences,
    "mean_recurrences_ci95": [recurrences - 0.05, recurrences + 0.05],
  }


def _report(shared_exits: dict, fixed: dict) -> dict:
  return {
    "setup": {"num_recurrences": 4, "checkpoint": "RUNS/x/pretrain", "step": 1, "rows": 2},
    "fixed": {"shared": fixed, "unshared": {}},
    "exits": {"shared": shared_exits, "unshared": {}},
  }


class SelectTest(absltest.TestCase):
  def test_fewest_recurrences_within_the_limit(self):
    points = {
      "kl@0.1": _point(0.02, 0.03, 1.5),  # Saves most, but its CI reaches +3%: out.
      "kl@0.01": _point(0.005, 0.0099, 2.5),  # Within +1%.
      "kl@0.001": _point(0.0, 0.001, 3.5),
    }
    self.assertEqual(depth_table.select(points)[0], "kl@0.01")
    # The limit is the CI's upper end, not the gap: a tighter limit excludes kl@0.01.
    self.assertEqual(depth_table.select(points, limit=0.005)[0], "kl@0.001")
    self.assertIsNone(depth_table.select(points, limit=-0.01))

  def test_ties_go_to_the_smaller_gap_then_the_smaller_value(self):
    points = {"c@0.3": _point(0.004, 0.008, 2.0), "c@0.2": _point(0.001, 0.008, 2.0)}
    self.assertEqual(depth_table.select(points)[0], "c@0.2")
    points = {"c@0.3": _point(0.001, 0.008, 2.0), "c@0.2": _point(0.001, 0.008, 2.0)}
    self.assertEqual(depth_table.select(points)[0], "c@0.2")


class TablesTest(testing.TempDirTestCase):
  def _write(self, name: str, report: dict) -> None:
    os.makedirs(os.path.join(self.tmp, name))
    with open(os.path.join(self.tmp, name, depth_table.REPORT), "w") as f:
      json.dump(report, f)

  def test_tables(self):
    exits = {"kl@0.01": _point(0.002, 0.004, 2.5), "kl@0.1": _point(0.05, 0.06, 1.2)}
    exits["cosine@1"] = _point(0.05, 0.06, 1.0)
    fixed = {str(r): _point(0.01 * (4 - r), 0.01 * (4 - r) + 0.002, float(r)) for r in (1, 2, 3)}
    fixed |= {"4": _point(0.0, 0.0, 4.0), "5": _point(-0.001, 0.0, 5.0)}
    self._write("fixed_pretrain", _report(exits, fixed))
    self._write("default_pretrain", _report({}, {"4": _point(0.0, 0.0, 4.0)}))
    reports = depth_table.load(self.tmp)
    self.assertEqual(list(reports), ["default_pretrain", "fixed_pretrain"])  # MODELS' order.
    text = depth_table.exits_table(reports)
    name = depth_table.MODELS["fixed_pretrain"]
    # R' <= R only: R' = 3's CI reaches +1.2%, so the trained R = 4 is the fewest within +1%.
    self.assertIn(f"| {name} | shared | fixed R' (no exit) | 4 | 4.00 [3.95, 4.05] | 0% |", text)
    self.assertIn(
      f"| {name} | shared | kl | 0.01 | 2.50 [2.45, 2.55] | 38% | 5.000 | +0.20% [+0.10, +0.40] |",
      text,
    )
    self.assertIn(f"| {name} | shared | cosine | none of 1 within +1% |", text)
    curve = depth_table.fixed_table(reports)
    self.assertIn(f"| {name} | 4 (trained) | 5.000 | +0.00% [-0.10, +0.00] | missing |", curve)
    self.assertIn(f"| {name} | 5 | 5.000 | -0.10% [-0.20, +0.00] | missing |", curve)


class SweepTest(absltest.TestCase):
  def test_plan_and_grids(self):
    grids = test_time_depth.grid_of(["kl=0.1,0.01", "cosine="])
    self.assertEqual(grids["kl"], (0.1, 0.01))
    self.assertNotIn("cosine", grids)
    points = test_time_depth.plan(2, 2, {"kl": (0.1,)})
    self.assertEqual([p[2] for p in points[::2]], ["1", "2", "3", "4", "kl@0.1"])
    self.assertEqual(points[-1], ("exits", "unshared", "kl@0.1", 2, "kl", 0.1))
    with self.assertRaises(ValueError):
      test_time_depth.grid_of(["no-such=1"])

  def test_portable_paths(self):
    self.assertEqual(
      test_time_depth.portable("/elsewhere/runs/a_s0/pretrain"), "RUNS/a_s0/pretrain"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    inside = os.path.join(repo, "experiments", "results", "x")
    self.assertEqual(test_time_depth.portable(inside), "experiments/results/x")

  def test_one_compilation_equals_the_evaluation_at_each_point(self):
    cfg = testing.TINY_MODEL  # R = 3; the sweep's loop runs up to 6.
    params = init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (3, 9), 0, cfg.vocab_size))
    inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
    big = dataclasses.replace(cfg, num_recurrences=6)
    fn = test_time_depth.make_sweep_fn(big, adaptive.DEFAULT_LOOKUP)
    args = test_time_depth.parse(["--config=c", "--checkpoint=c", "--out=o"])
    # Thresholds at which these rows exit at different recurrences (a probe of this model).
    points = [(1, "none", 0.0), (5, "none", 0.0), (3, "entropy-diff", 0.03), (3, "kl", 0.01)]
    points += [(3, "latent-diff", 1.0), (3, "cosine", 0.01)]
    for recurrences, criterion, threshold in points:
      settings = adaptive.DepthSettings(exit_criterion=criterion, exit_threshold=threshold)
      want_fn = evaluation.make_depth_fn(
        dataclasses.replace(cfg, num_recurrences=recurrences), settings
      )
      values = test_time_depth.point_values(recurrences, criterion, threshold, args)
      for share_kv in (True, False):
        with self.subTest(point=(recurrences, criterion, threshold), share_kv=share_kv):
          got = fn(params, inputs, targets, None, values, share_kv)
          want = want_fn(params, inputs, targets, None, share_kv)
          np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
          np.testing.assert_array_equal(got[1], want[1])


if __name__ == "__main__":
  absltest.main()
