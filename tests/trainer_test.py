"""Trainer: falling loss, metrics, exact resume after a killed process, NaN stop."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import chex
import jax
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped.checkpoints import checkpointing
from looped.train import trainer
from looped.train.metrics_writer import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {
  "train.num_steps": 40,
  "train.checkpoint_every": 4,
  "train.log_every": 2,
  "train.eval_every": 20,
  "train.warmup_steps": 4,
}


def _config(**extra):
  return testing.smoke_config({**OVERRIDES, **extra})


def _cli(workdir, **extra):
  # One CPU device, as in this process: the bitwise comparisons hold on one device count.
  overrides = {**testing.TINY_RUN_OVERRIDES, **OVERRIDES, "mesh.cpu_devices": 1, **extra}
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  return [
    sys.executable,
    "-m",
    "looped.main",
    f"--config={os.path.join(REPO, 'configs', 'pretrain.py')}:smoke",
    f"--workdir={workdir}",
    *flags,
  ]


class TrainerTest(testing.TempDirTestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # One uninterrupted 40-step run: the loss and metrics test reads it, the resume test
    # compares against its final state, the init-params test starts from its params.
    cls._run_dir = tempfile.TemporaryDirectory()
    cls.addClassCleanup(cls._run_dir.cleanup)
    cls.run_workdir = os.path.join(cls._run_dir.name, "run")
    cls.result = trainer.run(_config(), cls.run_workdir)

  def test_loss_falls_and_metrics_are_written(self):
    workdir, result = self.run_workdir, self.result
    records = read_metrics(workdir)
    self.assertEqual([r["step"] for r in records], list(range(2, 41, 2)))
    losses = [r["loss"] for r in records]
    self.assertLess(np.mean(losses[-3:]), np.mean(losses[:3]) - 0.5)
    self.assertIn("val_bpb", records[-1])
    self.assertLen(records[-1]["relative_residual_R"], 4)
    self.assertEqual(int(result.state.step), 40)
    self.assertTrue(os.listdir(os.path.join(workdir, "tensorboard")))

  def test_killed_run_resumes_bitwise_exactly(self):
    reference = self.result.state  # The same config, uninterrupted.

    workdir = os.path.join(self.tmp, "killed")
    ckpt_dir = checkpointing.checkpoint_dir(workdir)
    proc = subprocess.Popen(
      _cli(workdir), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
      deadline = time.time() + 300
      while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(ckpt_dir) and any(d.isdigit() for d in os.listdir(ckpt_dir)):
          break
        time.sleep(0.01)
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.wait()
    self.assertEqual(proc.returncode, -signal.SIGKILL, "run finished before it was killed")
    saved = [int(d) for d in os.listdir(ckpt_dir) if d.isdigit()]
    self.assertLess(max(saved), 40)

    with self.assertLogs(level="INFO") as logs:
      resumed = trainer.run(_config(), workdir)
    self.assertTrue(any("Resuming from checkpoint at step" in m for m in logs.output))
    self.assertGreater(resumed.resumed_from, 0)
    chex.assert_trees_all_equal(
      jax.device_get(resumed.state.params), jax.device_get(reference.params)
    )
    chex.assert_trees_all_equal(
      jax.device_get(resumed.state.opt_state), jax.device_get(reference.opt_state)
    )
    # metrics.jsonl holds each step once: records of the lost steps were dropped on resume.
    steps = [r["step"] for r in read_metrics(workdir)]
    self.assertEqual(steps, sorted(set(steps)))

  def test_cli_rerun_with_more_steps_resumes(self):
    workdir = os.path.join(self.tmp, "cli")
    first = subprocess.run(
      _cli(workdir, **{"train.num_steps": 8}), cwd=REPO, capture_output=True, text=True
    )
    self.assertEqual(first.returncode, 0, first.stderr[-2000:])
    second = subprocess.run(
      _cli(workdir, **{"train.num_steps": 12}), cwd=REPO, capture_output=True, text=True
    )
    self.assertEqual(second.returncode, 0, second.stderr[-2000:])
    self.assertIn("Resuming from checkpoint at step 8", second.stderr)
    self.assertIn("step 12/12", second.stderr)
    self.assertNotIn("step 2/12", second.stderr)
    self.assertEqual(read_metrics(workdir)[-1]["step"], 12)

  def test_init_params_stay_valid_after_training(self):
    config = _config(**{"train.num_steps": 3})
    init = jax.tree.map(np.asarray, jax.device_get(self.result.state.params))  # Trained params.
    on_device = jax.device_put(init)
    model = trainer.LoopedLM(trainer.model_lib.from_config(config.model))
    objective = trainer.objectives.language_modeling(model, config.depth)
    trainer.train(config, os.path.join(self.tmp, "b"), model, objective, init_params=on_device)
    # The caller's arrays were not donated away, and still hold the values passed in.
    chex.assert_trees_all_equal(jax.device_get(on_device), init)

  def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(self):
    workdir = os.path.join(self.tmp, "nan")
    config = _config(**{"train.learning_rate": 1e30, "train.checkpoint_every": 1})
    # Either the step's own loss or the check before saving its state stops the run.
    with self.assertRaisesRegex(FloatingPointError, "Non-finite training loss|is not finite"):
      trainer.run(config, workdir)
    ckpt = checkpointing.Checkpointer(workdir, keep=2)
    step = ckpt.latest_step()
    ckpt.close()
    self.assertIsNotNone(step)
    # The kept checkpoint restores and its params are finite.
    state = trainer.run(_config(**{"train.num_steps": step}), workdir).state
    self.assertTrue(all(np.isfinite(x).all() for x in jax.tree.leaves(state.params)))


if __name__ == "__main__":
  absltest.main()
