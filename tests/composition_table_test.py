"""experiments/composition_table.py: rows, seed means and ratios on hand-written reports."""

import importlib.util
import os

from absl.testing import absltest

import looped_testing as testing

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "experiments", "composition_table.py")
_spec = importlib.util.spec_from_file_location("composition_table", _SCRIPT)
composition_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(composition_table)


def _cell(ppl, gap):
  return {"ppl_unshared_eval": ppl, "gap_exact": gap, "gap_exact_ci95": [gap - 0.01, gap + 0.01]}


def _model(ppl, gap, nvfp4_ppl, nvfp4_gap):
  return {
    **_cell(ppl, gap),
    "gap_jacobi_eval": {"4": gap + 0.02},
    "gap_jacobi_eval_ci95": {"4": [gap, gap + 0.04]},
    "kv_formats": {
      "bf16": _cell(ppl, gap),
      "fp8": _cell(ppl, gap + 0.001),
      "nvfp4": _cell(nvfp4_ppl, nvfp4_gap),
    },
  }


class CompositionTableTest(testing.TempDirTestCase):
  def test_rows_and_seed_statistics(self):
    paths = [
      self.write_report(
        "kda_fixed_s0",
        {"finetune": _model(5.0, 0.30, 5.1, 0.32), "benice": _model(5.5, 0.10, 5.5, 0.12)},
      ),
      self.write_report(
        "kda_fixed_s1",
        {"finetune": _model(4.0, 0.20, 4.2, 0.22), "benice": _model(4.4, 0.06, 4.51, 0.06)},
      ),
      self.write_report("gqa_poisson_s0", {"finetune": _model(3.0, 0.0, 3.03, 0.01)}),
    ]
    text = composition_table.table(composition_table.load_runs(paths))
    # finetune: ppl mean 4.5 (spread 1.0); gap 25% (10 points), half-width 1 point; J4 27%;
    # nvfp4 gaps 32/22%; nvfp4 cost 5.1/5 - 1 = 2%, 4.2/4 - 1 = 5%: 3.5% (3.0).
    self.assertIn(
      "| fixed | kda | finetune | 2 | 4.500 (1.000) | +25.0% (10.0%) ±1.0 | +27.0% (10.0%) ±2.0 "
      "| +25.0% (10.0%) ±1.0 | +25.1% (10.0%) ±1.0 | +27.0% (10.0%) ±1.0 | +3.5% (3.0%) | - |",
      text,
    )
    # benice vs finetune: 5.5/5 - 1 = 10%, 4.4/4 - 1 = 10%; nvfp4 cost 0% and 2.5%.
    self.assertIn(
      "| fixed | kda | benice | 2 | 4.950 (1.100) | +8.0% (4.0%) ±1.0 | +10.0% (4.0%) ±2.0 "
      "| +8.0% (4.0%) ±1.0 | +8.1% (4.0%) ±1.0 | +9.0% (6.0%) ±1.0 | +1.2% (2.5%) "
      "| +10.0% (0.0%) |",
      text,
    )
    # One seed: the gap with its 95% interval.
    self.assertIn("| poisson | gqa | finetune | 1 | 3.000 | +0.0% [-1.0, +1.0] |", text)
    # Fixed arm before the Poisson arm.
    self.assertLess(text.index("| fixed |"), text.index("| poisson |"))

  def test_per_seed_table(self):
    paths = [
      # Seed 10 sorts after seed 2 (numerically, not as text).
      self.write_report(
        "gqa_fixed_s10",
        {"finetune": _model(4.0, 0.25, 4.0, 0.25), "benice": _model(4.2, 0.05, 4.2, 0.05)},
      ),
      self.write_report(
        "gqa_fixed_s2",
        {"finetune": _model(5.0, 0.30, 5.0, 0.30), "benice": _model(5.5, 0.10, 5.5, 0.10)},
      ),
      self.write_report("mla_fixed_s2", {"finetune": _model(6.0, 0.40, 6.0, 0.40)}),
      self.write_report("mla_poisson_s3", {"finetune": _model(6.0, 0.0, 6.0, 0.0)}),
    ]
    runs = composition_table.load_runs(paths)
    self.assertEqual([r["seed"] for r in runs[("fixed", "gqa")]], [2, 10])
    text = composition_table.per_seed_table(runs)
    # Seeds of the fixed arm only; BeNice! vs finetune: 5.5/5 - 1 = 10%, 4.2/4 - 1 = 5%.
    self.assertIn("| mixer (fixed; seed 2 / 10) |", text)
    self.assertIn("| gqa | - / -% | +30.0 / +25.0% | +10.0 / +5.0% | +10.0 / +5.0% |", text)
    # Missing models and seeds are "-".
    self.assertIn("| mla | - / -% | +40.0 / -% | - / -% | - / -% |", text)
    self.assertNotIn("| kda |", text)

  def test_rejects_unknown_run_names(self):
    path = self.write_report("fixed_s0", {"finetune": _model(5.0, 0.3, 5.1, 0.32)})
    with self.assertRaisesRegex(SystemExit, "fixed_s0: expected a <mixer>_<arm>_s<seed>"):
      composition_table.load_runs([path])


if __name__ == "__main__":
  absltest.main()
