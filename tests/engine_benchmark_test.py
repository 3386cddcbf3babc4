"""benchmarks/engine.py: the before/after table from hand-made throughput rows, and the cost-model
fit recovering a known profile from step times it generates."""

import argparse
import dataclasses
import io
import os
import sys
from contextlib import redirect_stdout

import numpy as np
from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import engine as engine_bench  # noqa: E402
from configs import pretrain  # noqa: E402
from looped.engine import padding  # noqa: E402
from looped.model import config as model_lib  # noqa: E402
from looped.model.cache_layout import KVLayout  # noqa: E402
from looped.scheduler import scheduler  # noqa: E402
from looped.sim import engine_cost, hardware, shape  # noqa: E402


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


class FitTest(absltest.TestCase):
  """Step times priced by a known profile, at the grid's padded shapes (powers of two, written
  out here), must give that profile back: each format's dequantizing cost in its own term."""

  def test_recovers_a_known_profile(self):
    config = pretrain.get_config()
    config.model.max_seq_len = 256
    model_shape = shape.ModelShape.from_config(
      dataclasses.asdict(model_lib.from_config(config.model))
    )
    args = argparse.Namespace(
      grid_layouts=["unshared", "shared_fp8", "unshared_nvfp4", "shared_nvfp4"],
      max_num_seqs=8,
      max_num_batched_tokens=64,
      max_model_len=256,
    )
    truth = hardware.Hardware(
      "truth", 5e10, 8e9, 1.0, 7e-4, "", combine="sum", pricing="engine", call_overhead_s=4e-4,
      dequant_s_per_value={"fp8": 2e-10, "nvfp4": 3e-9},
    )  # fmt: skip
    pad = padding.Padding.create(16, (1, 2, 4, 8), (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8, 16), 256)
    rows = []
    for layout in args.grid_layouts:
      share, fmt = engine_bench.LAYOUTS[layout]
      ex = engine_cost.EngineCostExecutor(model_shape, truth, pad, KVLayout(share, fmt))
      # (chunk rows, their tokens, context, one-token rows beside them: a second call).
      shapes = ((1, 1, 0, 0), (3, 1, 150, 0), (5, 24, 40, 0), (8, 64, 150, 0), (3, 6, 200, 3))
      for j, (b, q, c, d) in enumerate(shapes + ((2, 1, 90, 0), (4, 16, 60, 4))):
        batch = scheduler.StepBatch([None] * (b + d), [q] * b + [1] * d, [c] * (b + d), b + d)
        self.assertEqual(
          len(pad.shape(batch.num_new_tokens, batch.num_context_tokens).calls), 1 + (d > 0)
        )
        row = {"layout": layout, "rows": b, "new_tokens": q, "context": c, "held_out": j % 3 == 1}
        row.update({"decode_rows": d} if d else {})
        rows.append({**row, "s": ex.execute(batch)})
    with redirect_stdout(io.StringIO()):
      fits = engine_bench.fit(model_shape, rows, args)
    got = fits["engine/sum"]
    for key in ("peak_flops", "mem_bandwidth", "step_overhead_s", "call_overhead_s"):
      self.assertAlmostEqual(got[key] / getattr(truth, key), 1.0, places=6, msg=key)
    self.assertEqual(set(got["dequant_s_per_value"]), {"fp8", "nvfp4"})
    for fmt, s in truth.dequant_s_per_value.items():
      self.assertAlmostEqual(got["dequant_s_per_value"][fmt] / s, 1.0, places=6, msg=fmt)
    self.assertLess(got["held_out"]["max"], 1e-6)
    profile = engine_bench.fitted_profile(got)
    self.assertEqual(profile.dequant_s_per_value, got["dequant_s_per_value"])
    # Without the dequantizing terms the same steps cannot be fitted.
    x = engine_bench.features(model_shape, rows, "engine", args)
    self.assertEqual(x.shape[1], 6)  # 1, calls, FLOPs, bytes, fp8 values, nvfp4 values.
    x, y = x[:, :4], np.asarray([r["s"] for r in rows])
    pred = engine_bench.predict(x, engine_bench.fit_form(x, y, "sum"), "sum")
    self.assertGreater(np.median(np.abs(pred - y) / y), 0.05)


if __name__ == "__main__":
  absltest.main()
