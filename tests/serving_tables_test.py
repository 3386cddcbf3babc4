"""experiments/results_tables.py's live serving tables from hand-made runs: medians and ranges
over repeats, shared's change over unshared with the range that pairs the extreme runs, and
measured over simulated."""

import os
import sys
from unittest import mock

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "experiments"))

import results_tables  # noqa: E402


def _run(hit, tps, p50, p90, step_ms):
  return {
    "hit_rate": hit,
    "output_tokens_per_s": tps,
    "ttft_s": {"p50": p50, "p90": p90},
    "tpot_s": {"p50": 0.02},
    "preemptions": 0.0,
    "mean_step_s": step_ms / 1e3,
  }


def _configs(name="serve_sweep.json"):
  del name  # Every sweep file reads as these runs.
  unshared = {"budget": 3e6, "kv_format": "bf16", "layout": "unshared", "num_pages": 73}
  unshared["measured"] = [_run(0.2, 50.0, 4.0, 10.0, 20.0), _run(0.2, 60.0, 2.0, 8.0, 30.0)]
  unshared["measured"].append(_run(0.2, 40.0, 3.0, 12.0, 40.0))
  unshared["simulated"] = _run(0.2, 50.0, 2.0, 5.0, 25.0)
  unshared["simulated"].update(padded_token_ratio=2.0, padded_attention_ratio=3.5)
  shared = {"budget": 3e6, "kv_format": "bf16", "layout": "shared", "num_pages": 183}
  shared["measured"] = [_run(0.3, 70.0, 1.0, 2.0, 10.0)] * 2 + [_run(0.3, 66.0, 1.0, 4.0, 12.0)]
  shared["simulated"] = _run(0.3, 70.0, 0.5, 2.0, 10.0)
  shared["simulated"].update(padded_token_ratio=1.5, padded_attention_ratio=2.25)
  return [unshared, shared]


class ServingTablesTest(absltest.TestCase):
  def setUp(self):
    patch = mock.patch.object(results_tables, "_serving_configs", _configs)
    patch.start()
    self.addCleanup(patch.stop)

  def test_live(self):
    text = results_tables.serving_live()
    self.assertIn(
      "| 3 MB | 73 | bf16 | unshared | 3 | 0.200 | 50.0 [40.0-60.0] | 3.0 [2.0-4.0] | "
      "10.0 [8.0-12.0] | 20 | 0 | 30.0 [20.0-40.0] |",
      text,
    )
    self.assertIn("| 3 MB | 183 | bf16 | shared | 3 | 0.300 | 70.0 [66.0-70.0] | 1.0 |", text)

  def test_changes(self):
    text = results_tables.serving_live_changes()
    # Hit rate 0.2 -> 0.3: +50% in every pairing. Tok/s medians 50 -> 70 (+40%); worst shared
    # over best unshared 66 / 60 - 1 = +10%, best over worst 70 / 40 - 1 = +75%. TTFT p90 10 ->
    # 2 (-80%); 4 / 8 - 1 = -50%, 2 / 12 - 1 = -83%.
    self.assertIn(
      "| 3 MB | bf16 | 0.200 -> 0.300: **+50%** [+50%, +50%] | 50.0 -> 70.0: **+40%** "
      "[+10%, +75%] | 10.0 s -> 2.0 s: **-80%** [-83%, -50%] |",
      text,
    )
    self.assertIn("| the paper (simulated) | | +31.4% | +23.6% | -83.6% |", text)

  def test_earlier_sweeps_read_their_own_files(self):
    read = []
    with mock.patch.object(results_tables, "_serving_configs", lambda name: read.append(name)):
      tables = ("serving_live_changes_dense_write", "serving_live_sim_scaled")
      tables += ("serving_live_benice", "serving_live_changes_benice", "serving_live_sim_benice")
      for table in tables:
        with self.assertRaises(TypeError):  # None is no list of configurations.
          results_tables.TABLES[table]()
    want = ["serve_sweep_dense_write.json", "serve_sweep_scaled.json"]
    self.assertEqual(read, want + ["serve_sweep_benice.json"] * 3)

  def test_sim(self):
    text = results_tables.serving_live_sim()
    # Unshared: tok/s 50 / 50, TTFT p50 3 / 2, p90 10 / 5, mean step 30 / 25.
    self.assertIn(
      "| 3 MB | bf16 | unshared | 0.200 / 0.200 | 1.00 | 1.50 | 2.00 | 1.20 | 2.00 | 3.50 |", text
    )
    self.assertIn("| 3 MB | bf16 | shared | 0.300 / 0.300 | 1.00 | 2.00 | 1.00 | 1.00 |", text)


if __name__ == "__main__":
  absltest.main()
