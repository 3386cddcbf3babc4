"""benchmarks/engine.py's before/after table from hand-made throughput rows."""

import io
import os
import sys
from contextlib import redirect_stdout

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import engine as engine_bench  # noqa: E402


def _row(layout, seqs, tps, steps, run=None, workload="mixed"):
  row = {"workload": workload, "layout": layout, "max_num_seqs": seqs, "tokens_per_s": tps}
  row.update(steps=steps, padding_waste=1.0)
  if run is not None:
    row["run"] = run
  return row


class BeforeAfterTest(absltest.TestCase):
  def test_ratios_against_the_median_before_run(self):
    before = [
      _row("unshared", 8, 200.0, 146, 0),
      _row("shared", 8, 100.0, 59, 0),
      _row("unshared", 8, 300.0, 140, 1),
      _row("shared", 8, 60.0, 60, 1),
      _row("shared", 8, 80.0, 61, 2),
      _row("unshared", 8, 250.0, 150, 2),
    ]
    after = [
      _row("unshared", 8, 500.0, 148),
      _row("shared", 8, 640.0, 74),
      _row("shared", 8, 1.0, 1, workload="prefill_heavy"),  # Not the mixed workload: ignored.
    ]
    with redirect_stdout(io.StringIO()) as out:
      table = engine_bench.report_before_after(before, after)
    by = {r["layout"]: r for r in table}
    self.assertEqual(set(by), {"unshared", "shared"})
    self.assertEqual(by["shared"]["before_tokens_per_s"], [100.0, 60.0, 80.0])  # In run order.
    self.assertAlmostEqual(by["shared"]["ratio_to_before_median"], 640.0 / 80.0)
    self.assertAlmostEqual(by["unshared"]["ratio_to_before_median"], 500.0 / 250.0)
    text = out.getvalue()
    self.assertIn(
      "| shared | 8 | 100.0 | 60.0 | 80.0 | 640.0 | 8.00x | 59/60/61 | 74 | 1.00 |", text
    )
    self.assertIn("shared batched / unshared batched now: 1.28x", text)


if __name__ == "__main__":
  absltest.main()
