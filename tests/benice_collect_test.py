"""looped.benice.collect: the many-run table, on hand-written reports with hand-derived means."""

import os

from absl.testing import absltest

import looped_testing as testing
from looped.benice import collect, report


def _model(ppl_unshared, ppl_shared, gap, gap_j1, gap_j4):
  return {
    "ppl_unshared_eval": ppl_unshared + 1.0,
    "ppl_unshared_subset": ppl_unshared,
    "ppl_shared_exact_subset": ppl_shared,
    "gap_exact": gap,
    "gap_exact_ci95": [gap - 0.01, gap + 0.02],
    "gap_jacobi_eval": {"1": gap_j1, "4": gap_j4},
    "gap_jacobi_eval_ci95": {"1": [gap_j1 - 0.01, gap_j1 + 0.01], "4": [gap_j4 - 0.03, gap_j4]},
    "contraction_ratios": [0.5, 0.25],
    "kv_drift": {"k": [[0.3, 0.1, 0.0]], "v": [[0.2, 0.1, 0.0]]},
  }


class CollectTest(testing.TempDirTestCase):
  def test_groups_seeds_with_mean_and_spread(self):
    runs = [
      self.write_report("arm_s0", {"zero_shot": _model(4.0, 4.4, 0.10, 0.02, 0.08)}),
      self.write_report("arm_s1", {"zero_shot": _model(5.0, 5.2, 0.04, 0.00, 0.06)}),
      self.write_report("other_s0", {"zero_shot": _model(3.0, 3.0, 0.0, 0.0, 0.0)}),
    ]
    text = collect.table(runs)
    self.assertIn(
      "| arm_s1 | zero_shot | 6.000 | 5.000 | 5.200 | +4.0% [+3.0, +6.0] | +0.0% [-1.0, +1.0] "
      "| +6.0% [+3.0, +6.0] | 0.50 0.25 | 0.30 |",
      text,
    )
    # Means (4.5, 4.8, 7%, 1%, 7%), spreads (1.0, 0.8, 6, 2, 2 points); widest 95% half-widths
    # 1.5, 1.0 and 1.5 points (every seed's interval has the same width here).
    self.assertIn(
      "| arm | zero_shot | 2 | 5.500 (1.000) | 4.500 (1.000) | 4.800 (0.800) | +7.0% (6.0%) ±1.5 "
      "| +1.0% (2.0%) ±1.0 "
      "| +7.0% (2.0%) ±1.5 |",
      text,
    )
    self.assertIn(
      "| other | zero_shot | 1 | 4.000 | 3.000 | 3.000 | +0.0% [-1.0, +2.0] | +0.0% [-1.0, +1.0] "
      "| +0.0% [-3.0, +0.0] |",
      text,
    )

  def test_block_prefill_gaps_and_reports_without_them(self):
    """A report evaluated before block prefill was shows 'missing', never a zero gap."""
    new = _model(4.0, 4.4, 0.10, 0.02, 0.08)
    new.update(
      gap_block={"16": 0.05, "64": 0.02},
      gap_block_ci95={"16": [0.04, 0.07], "64": [0.01, 0.03]},
    )
    old = _model(5.0, 5.2, 0.04, 0.00, 0.06)
    runs = [self.write_report("arm_s0", {"zero_shot": new})]
    runs.append(self.write_report("arm_s1", {"zero_shot": old}))
    text = collect.table(runs)
    self.assertIn(
      "| gap exact [95% CI] | gap block C=16 [95% CI] | gap block C=64 [95% CI] |", text
    )
    self.assertIn("| +10.0% [+9.0, +12.0] | +5.0% [+4.0, +7.0] | +2.0% [+1.0, +3.0] | +2.0%", text)
    self.assertIn("| +4.0% [+3.0, +6.0] | missing | missing | +0.0%", text)
    # The group's mean would mix seeds with and without the gap: missing, not a one-seed mean.
    self.assertIn("| +7.0% (6.0%) ±1.5 | missing | missing | +1.0% (2.0%) ±1.0 |", text)
    # Old reports alone: no block columns at all, the table as before.
    self.assertNotIn("gap block", collect.table(runs[1:]))
    self.assertEqual(report.block_gap(new, 16), "+5.0% [+4.0, +7.0]")
    self.assertEqual(report.block_gap(new, 256), "missing")
    self.assertEqual(report.block_gap(old, 16), "missing")
    self.assertEqual(report.block_sizes([old, new]), [16, 64])

  def test_models_filter_and_missing_report(self):
    run = self.write_report(
      "abl_s0",
      {"finetune": _model(4.0, 4.0, 0.0, 0.0, 0.0), "benice": _model(4.1, 4.1, 0.0, 0.0, 0.0)},
    )
    text = collect.table([run], models=("benice",))
    self.assertIn("| abl_s0 | benice |", text)
    self.assertNotIn("finetune", text)
    with self.assertRaisesRegex(SystemExit, "no report at .*missing"):
      collect.table([os.path.join(self.tmp, "missing")])
    log = os.path.join(self.tmp, "abl_s0.log")
    with open(log, "w") as f:
      f.write("I1130 training log\n")
    with self.assertRaisesRegex(SystemExit, "abl_s0.log is not a shareability report"):
      collect.table([log])


if __name__ == "__main__":
  absltest.main()
