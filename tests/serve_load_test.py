"""benchmarks/serve_load.py's logic without a server: arguments, the request stream, one run's
figures from client times and /metrics counters, the median/min-max table and the verdict."""

import os
import sys

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import serve_load  # noqa: E402


class ServeLoadTest(absltest.TestCase):
  def test_args(self):
    args = serve_load.parse_args(["--checkpoint=/x"])
    self.assertEqual((args.num_requests, args.clients, args.repeats), (300, 48, 3))
    quick = serve_load.parse_args(["--checkpoint=/x", "--quick"])
    self.assertEqual((quick.num_requests, quick.clients, quick.repeats), (24, 8, 1))

  def test_workload(self):
    args = serve_load.parse_args(["--checkpoint=/x", "--num_requests=400"])
    requests = serve_load.workload(args, 0, 400)
    self.assertEqual(requests, serve_load.workload(args, 0, 400))  # Deterministic.
    prefixed = [r for r in requests if r["prefix"] is not None]
    self.assertBetween(len(prefixed) / len(requests), 0.6, 0.8)
    heads = {}
    for r in prefixed:
      heads.setdefault(r["prefix"], []).append(r["prompt"])
    lengths = set()
    for prompts in heads.values():
      head = os.path.commonprefix(prompts)
      lengths.add(len(head))
      for p in prompts:
        self.assertBetween(len(p) - len(head), 8, 64)
    self.assertEqual(lengths, {300, 375, 450, 525, 600})
    for r in requests:
      self.assertTrue(r["prompt"].isascii())
      self.assertBetween(r["max_tokens"], 8, 32)
      self.assertEqual(r["arrival"], 0.0)
      if r["prefix"] is None:
        self.assertBetween(len(r["prompt"]), 32, 256)
    rated = serve_load.workload(serve_load.parse_args(["--checkpoint=/x", "--rate=4"]), 0, 8)
    self.assertEqual([r["arrival"] for r in rated], [i / 4 for i in range(8)])

  def test_summarize(self):
    results = [
      {"sent": 0.0, "tokens": [1.0, 1.5, 2.0], "completion_tokens": 3, "arrival": 0.0},
      {"sent": 0.5, "tokens": [3.0, 4.0], "completion_tokens": 2, "arrival": 0.0},
    ]
    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0}
    after = {
      "vllm:prefix_cache_queries_total": 300.0,
      "vllm:prefix_cache_hits_total": 110.0,
      "vllm:num_preemptions_total": 4.0,
      "looped:engine_steps": 8.0,
      "looped:engine_busy_seconds": 2.0,
      "looped:kv_pages_total": 80.0,
    }
    s = serve_load.summarize(results, before, after)
    self.assertAlmostEqual(s["makespan_s"], 4.0)
    self.assertAlmostEqual(s["output_tokens_per_s"], 5 / 4.0)
    self.assertAlmostEqual(s["hit_rate"], 0.5)
    self.assertEqual(s["preemptions"], 4.0)
    self.assertAlmostEqual(s["mean_step_s"], 0.25)
    self.assertAlmostEqual(s["ttft_s"]["p50"], 1.75)  # TTFTs 1.0 and 2.5 (from the send).
    self.assertEqual(s["num_pages"], 80.0)

  def test_table_and_verdict(self):
    def run(layout, tps, p50, p90):
      figures = {
        "layout": layout,
        "output_tokens_per_s": tps,
        "ttft_s": {"p50": p50, "p90": p90},
        "tpot_s": {"p50": 0.1, "p90": 0.2},
      }
      for row in serve_load.ROWS:
        if isinstance(row[1], str):
          figures.setdefault(row[1], 1.0)
      return figures

    runs = [
      run("unshared", 20.0, 10.0, 20.0),
      run("shared", 30.0, 5.0, 9.0),
      run("unshared", 22.0, 11.0, 21.0),
      run("shared", 26.0, 6.0, 12.0),
      run("unshared", 21.0, 12.0, 19.0),
      run("shared", 28.0, 4.0, 10.0),
    ]
    summary = serve_load.aggregate(runs)
    self.assertEqual(summary["shared"]["output_tokens_per_s"]["median"], 28.0)
    self.assertEqual(summary["unshared"]["ttft_s.p90"]["min"], 19.0)
    text = serve_load.table(summary)
    self.assertIn("| output tokens/s | 21.0 [20.0-22.0] | 28.0 [26.0-30.0] |", text)
    self.assertIn("| preemptions | 1 | 1 |", text)  # No spread: one number.
    verdict = serve_load.verdict(summary)
    self.assertIn("shared output tokens/s >= unshared: True (28.0 vs 21.0)", verdict)
    self.assertIn("TTFT p90 <=: True (10.0 vs 20.0 s)", verdict)
    worse = serve_load.aggregate([run("unshared", 30.0, 1.0, 2.0), run("shared", 20.0, 3.0, 4.0)])
    self.assertIn("unshared: False", serve_load.verdict(worse))


if __name__ == "__main__":
  absltest.main()
