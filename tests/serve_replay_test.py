"""benchmarks/serve_replay.py's logic without a server: flags and the checkpoint's model, the
session stream and its synthesised prompts, one run's figures from client times and /metrics
counters, and the sweep's tables."""

import dataclasses
import os
import sys
import tempfile
from unittest import mock

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import serve_replay  # noqa: E402
from configs import pretrain  # noqa: E402
from looped.checkpoints import model_record  # noqa: E402
from looped.engine.padding import Padding  # noqa: E402
from looped.model.cache_layout import KVLayout  # noqa: E402
from looped.scheduler import scheduler  # noqa: E402
from looped.sim import engine_cost, hardware, shape  # noqa: E402


def _checkpoint(max_seq_len: int | None) -> str:
  """A directory holding a model record (max_seq_len given) or nothing (None)."""
  path = tempfile.mkdtemp()
  if max_seq_len is not None:
    c = pretrain.get_config()
    c.model.max_seq_len = max_seq_len
    model_record.write(path, model_record.make(c.model, c.data))
  return path


class ServeReplayTest(absltest.TestCase):
  def test_flags_and_the_checkpoints_model(self):
    recorded = _checkpoint(1024)
    args = serve_replay.parse_args([f"--checkpoint={recorded}"])
    self.assertEqual(args.max_model_len, 1024)  # From the record.
    config, model = serve_replay.model_config(args)
    self.assertEqual((config, model.max_seq_len, model.d_model), ("configs/serve.py", 1024, 128))
    bare = serve_replay.parse_args([f"--checkpoint={_checkpoint(None)}"])
    self.assertEqual(bare.max_model_len, 256)  # A workdir without a record: the smoke model.
    self.assertEqual(serve_replay.model_config(bare)[0], "configs/serve.py:smoke")
    for bad, says in (
      ([f"--checkpoint={recorded}", "--max_model_len=512"], "max_seq_len = 1024"),
      ([f"--checkpoint={recorded}", "--kv_formats", "fp9"], "--kv_formats: unknown"),
      ([f"--checkpoint={recorded}", "--repeats=0"], "--repeats"),
      (["--checkpoint=/nonexistent/dir"], "no such directory"),
    ):
      with self.assertRaises(SystemExit), _Stderr() as e:
        serve_replay.parse_args(bad)
      self.assertIn(says, e.text)

  def test_session_stream_and_prompts(self):
    args = serve_replay.parse_args([f"--checkpoint={_checkpoint(1024)}", "--trace=sessions"])
    requests = serve_replay.scaled_requests(args)
    self.assertEqual(
      [(r.arrival_s, r.prompt_len) for r in requests],
      [(r.arrival_s, r.prompt_len) for r in serve_replay.scaled_requests(args)],
    )  # Seeded.
    self.assertGreater(len(requests), 40)
    for r in requests:
      self.assertLessEqual(r.prompt_len + r.output_len, 1024)
      self.assertEqual(r.block_size, 16)
    # Prompts share exactly the tokens of their common leading blocks.
    a, b = (
      requests[0],
      next(r for r in requests[1:] if r.block_hashes[:1] == requests[0].block_hashes[:1]),
    )
    common = 0
    while common < min(len(a.block_hashes), len(b.block_hashes)) and (
      a.block_hashes[common] == b.block_hashes[common]
    ):
      common += 1
    pa, pb = serve_replay.prompt_tokens(a, 2), serve_replay.prompt_tokens(b, 2)
    self.assertEqual((len(pa), len(pb)), (a.prompt_len, b.prompt_len))
    self.assertEqual(pa[: 16 * common], pb[: 16 * common])
    self.assertNotEqual(pa[16 * common : 16 * common + 16], pb[16 * common : 16 * common + 16])
    self.assertNotEqual(serve_replay.prompt_tokens(a, 1)[:16], pa[:16])  # Another salt.
    # A history beyond the model's context is refused before any server starts.
    tight = serve_replay.parse_args(
      [
        f"--checkpoint={_checkpoint(1024)}",
        "--trace=sessions",
        '--sessions={"max_prompt_tokens": 4096, "min_turns": 6, "min_input_tokens": 96}',
      ]
    )
    with self.assertRaises(SystemExit) as e:
      serve_replay.scaled_requests(tight)
    self.assertIn("beyond the model's 1024", str(e.exception))
    with self.assertRaises(SystemExit) as e:
      serve_replay.session_config(
        serve_replay.parse_args([f"--checkpoint={_checkpoint(1024)}", '--sessions={"turns": 3}'])
      )
    self.assertIn("unknown fields ['turns']", str(e.exception))

  def test_measured_summary(self):
    results = [
      {"arrival": 0.0, "sent": 0.0, "tokens": [1.0, 1.5, 2.0], "output_len": 3},
      {"arrival": 1.0, "sent": 1.5, "tokens": [3.0, 5.0], "output_len": 2},
    ]
    before = {"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0}
    after = {
      "vllm:prefix_cache_queries_total": 300.0,
      "vllm:prefix_cache_hits_total": 110.0,
      "vllm:num_preemptions_total": 4.0,
      "looped:engine_steps": 8.0,
      "looped:engine_busy_seconds": 2.5,
      "looped:kv_pages_total": 80.0,
    }
    s = serve_replay.measured_summary(results, before, after)
    self.assertAlmostEqual(s["hit_rate"], 0.5)
    self.assertAlmostEqual(s["makespan_s"], 5.0)  # First arrival to last token.
    self.assertAlmostEqual(s["output_tokens_per_s"], 1.0)
    self.assertAlmostEqual(s["ttft_s"]["p50"], 1.5)  # TTFTs 1.0 and 2.0, from the arrival.
    self.assertAlmostEqual(s["tpot_s"]["p90"], 1.85)  # TPOTs 0.5 and 2.0: 0.5 + 0.9 * 1.5.
    self.assertEqual(set(s["ttft_s"]), {"p50", "p90", "p99"})
    self.assertAlmostEqual(s["mean_step_s"], 2.5 / 8)
    short = [dict(results[0], tokens=[1.0, 2.0])]
    with self.assertRaisesRegex(RuntimeError, "streamed 2 of 3"):
      serve_replay.measured_summary(short, before, after)

  def test_sweep_tables(self):
    def figures(hit, tps, p50, p90):
      return {
        "hit_rate": hit,
        "requests_per_s": tps / 10,
        "output_tokens_per_s": tps,
        "ttft_s": {"p50": p50, "p90": p90, "p99": p90},
        "tpot_s": {"p50": 0.1, "p90": 0.2},
        "preemptions": 3.0,
        "mean_step_s": 0.4 / tps,
      }

    def config(layout, pages, measured, simulated):
      return {"budget": 3e6, "kv_format": "bf16", "layout": layout, "num_pages": pages} | {
        "measured": [figures(*m) for m in measured],
        "simulated": figures(*simulated),
      }

    unshared = [(0.4, 20.0, 2.0, 4.0), (0.4, 30.0, 6.0, 9.0), (0.4, 22.0, 1.0, 5.0)]
    configs = [
      config("unshared", 73, unshared, (0.4, 20.0, 2.0, 4.0)),
      config("shared", 183, [(0.6, 33.0, 1.0, 2.0)] * 3, (0.6, 30.0, 1.0, 2.5)),
    ]
    text = serve_replay.sweep_table(configs)
    # Median [min-max] over the runs; one value when they agree; measured / simulated medians.
    self.assertIn(
      "| 3 | bf16 | unshared | 73 | 3 | 0.400 | 2.20 [2.00-3.00] | 22.0 [20.0-30.0] | "
      "2.00 [1.00-6.00] | 5.00 [4.00-9.00] | 5.00 [4.00-9.00] | 0.100 | 0.200 | 3 | "
      "18.2 [13.3-20.0] | 20.0 | 2.00 | 4.00 | 20.0 | 1.10 | 1.00 | 1.25 | 0.91 |",
      text,
    )  # Mean step 400 / tok/s ms: 20.0, 13.3, 18.2 -> median 18.2; 18.2 / 20.0 = 0.91.
    self.assertIn("| 3 | bf16 | shared | 183 | 3 | 0.600 | 3.30 | 33.0 | 1.00 | 2.00 |", text)
    errors = serve_replay.prediction_errors(configs)
    # Ratios over the 6 runs: tok/s 1.0, 1.5, 1.1, 1.1 x 3 -> median 1.1, |error| 0.1 (5 of 6
    # within 15%); TTFT p90: 1.0, 2.25, 1.25, 0.8 x 3 -> median 0.9, |error| 0.2, 1 of 6.
    self.assertAlmostEqual(errors["output tok/s"]["median_ratio"], 1.1)
    self.assertAlmostEqual(errors["output tok/s"]["median_abs_error"], 0.1)
    self.assertAlmostEqual(errors["output tok/s"]["within_15pct"], 5 / 6)
    self.assertAlmostEqual(errors["TTFT p90 (s)"]["median_ratio"], 0.9)
    self.assertAlmostEqual(errors["TTFT p90 (s)"]["median_abs_error"], 0.2)
    self.assertAlmostEqual(errors["TTFT p90 (s)"]["within_15pct"], 1 / 6)
    # Mean step ratios are simulated / measured tok/s here: 1.0, 0.667, 0.909, 0.909 x 3.
    self.assertAlmostEqual(errors["mean step (ms)"]["median_ratio"], 20 / 22)
    versus = serve_replay.shared_vs_unshared(configs)
    self.assertIn("| 3 | bf16 | 0.400 -> 0.600 | +50.0% | +50.0% | -60.0% |", versus)


class PaddingTallyTest(absltest.TestCase):
  def test_computed_over_needed_by_hand(self):
    class Inner:
      padding = Padding.create(4, (2, 8), (1, 4), (2, 4), max_model_len=16)

      def execute(self, batch):
        return 0.5

    tally = serve_replay._PaddingTally(Inner())
    batch = scheduler.StepBatch([None] * 3, [3, 1, 1], [5, 0, 9], num_sampled=2)
    self.assertEqual(tally.execute(batch), 0.5)
    # One-token rows 1, 2: 2 rows x 1 token over 4 columns of 4 (reach 9 + 1 = 10 slots, 3
    # pages, bucket 4); row 0: 2 rows (bucket) x 4 tokens (bucket of 3), reach 5 + 4 = 9 -> 4
    # columns. Tokens 2 + 8 = 10 of 5; query x slot pairs 2 x 16 + 8 x 16 = 160 of
    # 3 x 8 + 1 x 1 + 1 x 10 = 35.
    self.assertEqual(
      tally.ratios(), {"padded_token_ratio": 10 / 5, "padded_attention_ratio": 160 / 35}
    )


class PricedStepsTest(absltest.TestCase):
  def test_a_logged_step_is_priced_as_the_simulator_priced_its_batch(self):
    """Steps logged as their padded calls, each measured at twice its price: priced again from
    the log alone, every ratio is 2, whatever the batch behind the calls was."""
    c = pretrain.get_config()
    c.model.max_seq_len = 64
    model_shape = shape.ModelShape.from_config(c.model)
    hw = hardware.load("cpu_2core")
    hw = dataclasses.replace(hw, call_overhead_s=1e-3, dequant_s_per_value={"nvfp4": 2e-9})
    padding = Padding.create(4, (2, 8), (1, 4, 8), (2, 4, 16), max_model_len=64)
    pricer = engine_cost.EngineCostExecutor(
      model_shape, hw, padding, KVLayout(True, "nvfp4"), weight_format="fp32"
    )
    batches = [([1, 1, 1], [5, 0, 30]), ([3, 1], [5, 9]), ([7, 2, 6], [40, 1, 20]), ([8], [0])]
    log, prices = [], []
    for new, context in batches:
      batch = scheduler.StepBatch([None] * len(new), new, context, len(new))
      price = pricer.execute(batch)
      calls = [(k.rows, k.tokens, k.columns) for k in padding.shape(new, context).calls]
      log.append({"calls": calls, "s": 2 * price})
      prices.append(price)
    out = serve_replay.priced_steps(pricer, log)
    self.assertAlmostEqual(out["step_over_priced_median"], 2.0)
    self.assertAlmostEqual(out["step_over_priced_total"], 2.0)
    self.assertAlmostEqual(out["priced_step_s"], sum(prices) / len(prices))
    with self.assertRaisesRegex(ValueError, "do not pad to themselves"):
      serve_replay.priced_steps(pricer, [{"calls": [(3, 1, 2)], "s": 1.0}])  # 3 rows: no bucket.


class JournalTest(absltest.TestCase):
  def test_resumes_and_refuses_other_flags(self):
    out = os.path.join(tempfile.mkdtemp(), "sweep.json")
    checkpoint = _checkpoint(1024)
    args = serve_replay.parse_args([f"--checkpoint={checkpoint}", f"--out={out}"])
    journal = serve_replay.Journal(args.out, args)
    self.assertEqual(journal.done, {})
    journal.record((0, 3e6, "bf16", "shared"), {"measured": {"hit_rate": 0.5}})
    # The same flags, more repeats and budgets: resumes with the finished run.
    more = serve_replay.parse_args(
      [
        f"--checkpoint={checkpoint}",
        f"--out={out}",
        "--repeats=3",
        "--kv_budget_bytes",
        "3e6",
        "5e6",
      ]
    )
    resumed = serve_replay.Journal(more.out, more)
    self.assertEqual(resumed.done, {(0, 3e6, "bf16", "shared"): {"measured": {"hit_rate": 0.5}}})
    # Another stream is not mixed in.
    other = serve_replay.parse_args([f"--checkpoint={checkpoint}", f"--out={out}", "--clients=8"])
    with self.assertRaises(SystemExit) as e:
      serve_replay.Journal(other.out, other)
    self.assertIn("--clients=32", str(e.exception))
    # Nor runs of another engine: the served code's hash is part of the journal's flags.
    with mock.patch.object(serve_replay, "code_hash", lambda: "0" * 16):
      with self.assertRaises(SystemExit) as e:
        serve_replay.Journal(more.out, more)
    self.assertIn("another version of looped/ and configs/", str(e.exception))
    self.assertLen(serve_replay.code_hash(), 16)


class _Stderr:
  """Captures what argparse writes to stderr before it exits."""

  def __enter__(self):
    import io

    self._old, sys.stderr = sys.stderr, io.StringIO()
    return self

  def __exit__(self, *exc):
    self.text = sys.stderr.getvalue()
    sys.stderr = self._old
    return False


if __name__ == "__main__":
  absltest.main()
