"""Learning curves (looped.benice.curves) against the pipeline's own evaluation, and the BeNice!
recipe schedules as the trainer drives them (the optimizer step reaches the objective)."""

import contextlib
import io
import json
import os
from unittest import mock

import numpy as np
from absl.testing import absltest

import looped_testing as testing
from configs import benice as benice_config
from looped.benice import curves, evaluation, pipeline


class CurvesTest(testing.TempDirTestCase):
  def test_curve_points_match_pipeline_evaluation_and_are_cached(self):
    config = benice_config.get_config("smoke")
    config.pipeline.models = ("zero_shot", "benice")
    config.eval.kv_formats = ()
    config.eval.samples = 0
    config.post.train.checkpoint_every = 2
    config.train.keep_checkpoints = 5
    b = config.benice
    b.kv_passes, b.kv_passes_ramp_steps, b.shared_ramp_steps, b.distill_weight = 2, 4, 4, 0.5
    workdir = os.path.join(self.tmp, "run")
    pipeline.validate(config)
    with contextlib.redirect_stdout(io.StringIO()):
      report = pipeline.run(config, workdir)

    # The schedules follow the optimizer step: the record logged after step k comes from the
    # update at step index k - 1. Ramps over 4 steps: scale (k - 1) / 4 capped at 1; passes
    # floor(3 (k - 1) / 4) capped at 2 (derived by hand).
    with open(os.path.join(workdir, "benice", "metrics.jsonl")) as f:
      records = {r["step"]: r for r in map(json.loads, f)}
    for step, scale, passes in ((2, 0.25, 0), (4, 0.75, 2), (6, 1.0, 2)):
      self.assertAlmostEqual(records[step]["shared_scale"], scale, places=6)
      self.assertEqual(records[step]["kv_passes"], passes)
      self.assertIn("distill", records[step])

    stage_dir = os.path.join(workdir, "benice")
    self.assertEqual(curves.checkpoint_steps(stage_dir), [2, 4, 6])
    points = curves.evaluate_stage(stage_dir, config.eval.decode_batches, 2)
    self.assertEqual(sorted(points), [2, 4, 6])
    final, ref = points[6], report["models"]["benice"]
    for key in ("ppl_unshared_eval", "ppl_shared_exact_subset", "gap_exact"):
      np.testing.assert_allclose(final[key], ref[key], rtol=1e-6)
    np.testing.assert_allclose(final["gap_exact_ci95"], ref["gap_exact_ci95"], rtol=1e-6)
    self.assertNotAlmostEqual(points[2]["ppl_unshared_eval"], final["ppl_unshared_eval"], 4)

    # Rerun: everything cached, a torn line (a killed writer) is skipped; a missing point
    # alone is recomputed, to the same numbers.
    path = os.path.join(stage_dir, curves.CURVE_FILE)
    with open(path, "a") as f:
      f.write('{"step": 8, "key": ')
    with mock.patch.object(evaluation, "evaluate", side_effect=AssertionError("evaluated")):
      self.assertEqual(curves.evaluate_stage(stage_dir, config.eval.decode_batches, 2), points)
    with open(path) as f:
      kept = [line for line in f if '"step": 4,' not in line]
    with open(path, "w") as f:
      f.writelines(kept)
    with mock.patch.object(evaluation, "evaluate", wraps=evaluation.evaluate) as spy:
      again = curves.evaluate_stage(stage_dir, config.eval.decode_batches, 2)
    self.assertEqual(spy.call_count, 1)
    self.assertEqual(again[4]["gap_exact"], points[4]["gap_exact"])
    # Other settings are other points: nothing cached is reused for them.
    with mock.patch.object(evaluation, "evaluate", wraps=evaluation.evaluate) as spy:
      curves.evaluate_stage(stage_dir, 0, 2)
    self.assertEqual(spy.call_count, 3)

    rows = curves.curve_rows({"run/benice": points}, 2)
    table = curves.markdown(rows, 2)
    self.assertIn(f"| run/benice | 6 | {ref['ppl_unshared_eval']:.3f} |", table)
    png = os.path.join(self.tmp, "curves.png")
    curves.plot(png, rows, {"benice": 2.5})
    self.assertGreater(os.path.getsize(png), 1000)


if __name__ == "__main__":
  absltest.main()
