"""experiments/recipe_table.py on hand-made reports: targets, ratios and the change column."""

import importlib.util
import json
import os

from absl.testing import absltest

import looped_testing as testing

_SPEC = importlib.util.spec_from_file_location(
  "recipe_table",
  os.path.join(os.path.dirname(__file__), os.pardir, "experiments", "recipe_table.py"),
)
recipe_table = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(recipe_table)

SETTINGS = {
  "benice": {"kv_passes": 3, "distill_weight": 0.0},
  "post_depth": {"sampler": "fixed"},
  "post_train": {"num_steps": 200, "learning_rate": 1e-3, "eval_every": 100},
}


def _model(ppl, gap, ci):
  # Exact decode here covers the whole eval set, so shared ppl = ppl * (1 + gap).
  return {
    "ppl_unshared_eval": ppl,
    "ppl_shared_exact_subset": ppl * (1 + gap),
    "gap_exact": gap,
    "gap_exact_ci95": ci,
  }


class RecipeTableTest(testing.TempDirTestCase):
  def _write(self, run, models, **changed):
    settings = json.loads(json.dumps(SETTINGS))
    for dotted, value in changed.items():
      section, field = dotted.split("__")
      settings[section][field] = value
    os.makedirs(os.path.join(self.tmp, run, "report"))
    with open(os.path.join(self.tmp, run, "report", "shareability.json"), "w") as f:
      json.dump({"models": models, "settings": settings}, f)

  def test_targets_and_changes(self):
    # Zero-shot gap 30%: a fifth is 6%, a quarter 7.5%. Finetune: gap 40%, ppl 6.0.
    base = {
      "zero_shot": _model(7.0, 0.30, [0.27, 0.33]),
      "finetune": _model(6.0, 0.40, [0.36, 0.44]),
    }
    self._write("base_s0", base)
    # Meets all three: 5% <= 6%, CI top 7% < 7.5%, ppl 6.05 <= 6.06.
    self._write("good_s0", {"benice": _model(6.05, 0.05, [0.03, 0.07])}, benice__distill_weight=1.0)
    # Gap 5.5% but CI top 8% >= 7.5%; ppl 6.1 is 1.67% above.
    self._write("wide_s0", {"benice": _model(6.1, 0.055, [0.03, 0.08])}, post_train__eval_every=7)
    # A steps point carries its own finetune (gap 4%: BeNice!'s 5% is not below it).
    self._write(
      "steps500_s0",
      {"finetune": _model(5.0, 0.04, [0.03, 0.05]), "benice": _model(5.0, 0.05, [0.04, 0.06])},
      post_train__num_steps=500,
    )
    # BeNice! at 1000 steps with no finetune of its own: base's 200-step one is no baseline.
    self._write("lone_s0", {"benice": _model(5.0, 0.05, [0.04, 0.06])}, post_train__num_steps=1000)
    rows = {r["point"]: r for r in recipe_table.rows(recipe_table.load_runs(self.tmp))}
    self.assertEqual(sorted(rows), ["good", "steps500", "wide"])
    good, wide, steps = (
      rows["good"]["seeds"][0],
      rows["wide"]["seeds"][0],
      rows["steps500"]["seeds"][0],
    )
    self.assertEqual((good["fifth"], good["below_finetune"], good["ppl_1pct"]), (True, True, True))
    self.assertEqual(
      (wide["fifth"], wide["below_finetune"], wide["ppl_1pct"]), (False, True, False)
    )
    self.assertEqual((steps["fifth"], steps["below_finetune"]), (True, False))
    self.assertAlmostEqual(good["ratio"], 0.05 / 0.30)
    self.assertAlmostEqual(wide["ppl_vs_finetune"], 6.1 / 6.0 - 1)
    self.assertAlmostEqual(steps["ppl_vs_finetune"], 0.0)
    self.assertEqual(rows["good"]["change"], "benice.distill_weight=1.0")
    self.assertEqual(rows["wide"]["change"], "(the configured recipe)")  # Cadence only.
    self.assertEqual(rows["steps500"]["change"], "post_train.num_steps=500")
    text = recipe_table.markdown(list(rows.values()))
    self.assertIn(
      "| good | benice.distill_weight=1.0 | 1 | s0 +5.0% [+3.0, +7.0] | +5.0% | 0.17 |", text
    )
    self.assertIn("s0 nyn |", text)

  def test_seeds_give_mean_and_spread(self):
    for seed, gap in ((0, 0.04), (1, 0.08)):
      base = {"zero_shot": _model(7.0, 0.30, [0.2, 0.4]), "finetune": _model(6.0, 0.4, [0.3, 0.5])}
      self._write(f"base_s{seed}", base)
      self._write(f"default_s{seed}", {"benice": _model(6.0, gap, [gap - 0.01, gap + 0.01])})
    text = recipe_table.markdown(recipe_table.rows(recipe_table.load_runs(self.tmp)))
    self.assertIn("| +6.0% (4.0%) | 0.20 (0.13) |", text)


if __name__ == "__main__":
  absltest.main()
