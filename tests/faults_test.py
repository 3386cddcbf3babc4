"""Faults lose nothing: concurrent runs, divergence, corrupt checkpoints, torn metrics lines."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

import chex
import jax
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped import data as data_lib
from looped import programs
from looped.checkpoints import checkpointing, workdir_lock
from looped.config_checks import ConfigError
from looped.train import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERRIDES = {
  "train.num_steps": 12,
  "train.checkpoint_every": 4,
  "train.keep_checkpoints": 3,
  "train.log_every": 2,
  "train.eval_every": 100,
  "train.warmup_steps": 2,
}


def _config(**extra):
  return testing.smoke_config({**OVERRIDES, **extra})


def _params_of(workdir, step=None):
  return testing.saved_params(_config().model, workdir, step)


class WorkdirLockTest(testing.TempDirTestCase):
  def test_second_run_fails_at_once_naming_the_holder_and_a_dead_holder_is_taken_over(self):
    workdir = os.path.join(self.tmp, "run")
    overrides = {**testing.TINY_RUN_OVERRIDES, **OVERRIDES, "train.num_steps": 100000}
    flags = [f"--config.{k}={v}" for k, v in overrides.items()]
    cmd = [sys.executable, "-m", "looped.main", "--config=configs/pretrain.py:smoke"]
    first = subprocess.Popen(
      [*cmd, f"--workdir={workdir}", *flags],
      cwd=REPO,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL,
    )
    lock_path = os.path.join(workdir, workdir_lock.LOCK_NAME)
    try:
      deadline = time.time() + 120
      while time.time() < deadline and not (
        os.path.exists(lock_path) and os.path.getsize(lock_path)
      ):
        time.sleep(0.05)
      second = subprocess.run(
        [*cmd, f"--workdir={workdir}", *flags], cwd=REPO, capture_output=True, text=True
      )
      self.assertEqual(second.returncode, 2, second.stderr[-2000:])
      self.assertIn("is in use by another run", second.stderr)
      self.assertIn(f"pid {first.pid}", second.stderr)
      self.assertLen(second.stderr.strip().splitlines(), 1, second.stderr)
    finally:
      first.send_signal(signal.SIGKILL)
      first.wait()
    # The dead run's lock file is still there; the next run takes it over with a warning.
    self.assertIn(str(first.pid), open(lock_path).read())
    with self.assertLogs(level="WARNING") as logs:
      programs.run(_config(**{"train.num_steps": 2}), workdir)
    self.assertTrue(any("stale lock" in m and str(first.pid) in m for m in logs.output))

  def test_lock_is_exclusive_within_a_process_too(self):
    workdir = os.path.join(self.tmp, "held")
    with workdir_lock.WorkdirLock(workdir):
      with self.assertRaisesRegex(ConfigError, f"pid {os.getpid()}"):
        programs.run(_config(), workdir)


class GoodCheckpointTest(testing.TempDirTestCase):
  def test_diverging_run_never_saves_a_state_that_fails_the_check(self):
    workdir = os.path.join(self.tmp, "diverge")
    config = _config(**{"train.learning_rate": 1e30, "train.checkpoint_every": 1})
    with self.assertRaises(FloatingPointError) as ctx:
      trainer.run(config, workdir)
    steps = sorted(int(d) for d in os.listdir(checkpointing.checkpoint_dir(workdir)) if d.isdigit())
    # Every kept checkpoint holds finite params whose loss is finite: the run can go on from it.
    model = trainer.LoopedLM(trainer.model_lib.from_config(config.model))
    batch = data_lib.make_eval_batches(config, process_index=0, process_count=1)[0]
    eval_fn = trainer.make_eval_fn(model)
    for step in steps:
      params = _params_of(workdir, step)
      self.assertTrue(all(np.isfinite(x).all() for x in jax.tree.leaves(params)))
      loss_sum, _ = eval_fn(params, batch)
      self.assertTrue(np.isfinite(float(loss_sum)), f"checkpoint {step} has loss {loss_sum}")
    if steps:
      self.assertIn(f"last good checkpoint is step {steps[-1]}", str(ctx.exception))


class CorruptCheckpointTest(testing.TempDirTestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._trained = tempfile.TemporaryDirectory()
    cls.trained = os.path.join(cls._trained.name, "run")
    # Checkpoints at steps 4, 8, 12 (schedule of 12 steps).
    cls.trained_12 = jax.device_get(trainer.run(_config(), cls.trained).state)
    # Reference: the same run resumed to 16 from its step-8 checkpoint, with step 12 absent.
    ref = os.path.join(cls._trained.name, "ref")
    shutil.copytree(cls.trained, ref)
    shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(ref), "12"))
    cls.reference_16 = jax.device_get(trainer.run(_config(**{"train.num_steps": 16}), ref).state)

  @classmethod
  def tearDownClass(cls):
    cls._trained.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.workdir = os.path.join(self.tmp, "run")
    shutil.copytree(self.trained, self.workdir)
    self.ckpt_dir = checkpointing.checkpoint_dir(self.workdir)

  def _resume_to_16(self):
    with self.assertLogs(level="WARNING") as logs:
      result = trainer.run(_config(**{"train.num_steps": 16}), self.workdir)
    return result, "\n".join(logs.output)

  def _assert_fell_back_to_8(self, result, logs):
    self.assertEqual(result.resumed_from, 8)
    self.assertIn("Checkpoint step 12 is corrupt", logs)
    kept = os.listdir(checkpointing.corrupt_dir(self.ckpt_dir))
    self.assertLen(kept, 1)
    self.assertTrue(kept[0].startswith("12."))  # Renamed, not deleted.
    # Resuming from 8 redoes steps 9-16 exactly as a clean resume from 8 does.
    chex.assert_trees_all_equal(jax.device_get(result.state.params), self.reference_16.params)
    chex.assert_trees_all_equal(jax.device_get(result.state.opt_state), self.reference_16.opt_state)

  def test_truncated_checkpoint_is_moved_aside_and_the_previous_one_used(self):
    files = [
      os.path.join(d, f) for d, _, fs in os.walk(os.path.join(self.ckpt_dir, "12")) for f in fs
    ]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
      f.truncate(os.path.getsize(biggest) // 2)
    self._assert_fell_back_to_8(*self._resume_to_16())

  def test_same_size_overwrite_of_params_is_detected_by_checksum(self):
    params_12 = os.path.join(self.ckpt_dir, "12", "params")
    shutil.rmtree(params_12)
    shutil.copytree(os.path.join(self.ckpt_dir, "8", "params"), params_12)  # Valid, wrong.
    with self.assertRaisesRegex(checkpointing.CorruptCheckpointError, "checksums"):
      _params_of(self.workdir)  # restore_params never falls back silently.
    self._assert_fell_back_to_8(*self._resume_to_16())

  def test_all_checkpoints_corrupt_starts_afresh_from_the_first_batch(self):
    # Every step fails verification (each restore attempt may move the data iterator): the
    # run starts from step 0 on the iterator it built, reset to its start, and retraces the
    # original run exactly.
    for step in ("4", "8", "12"):
      files = [
        os.path.join(d, f) for d, _, fs in os.walk(os.path.join(self.ckpt_dir, step)) for f in fs
      ]
      biggest = max(files, key=os.path.getsize)
      with open(biggest, "r+b") as f:
        f.truncate(os.path.getsize(biggest) // 2)
    built = mock.Mock(wraps=data_lib.make_train_iterator)
    with mock.patch.object(trainer.data_lib, "make_train_iterator", built):
      with self.assertLogs(level="WARNING"):
        result = trainer.run(_config(), self.workdir)
    self.assertIsNone(result.resumed_from)
    self.assertEqual(built.call_count, 1)
    self.assertLen(os.listdir(checkpointing.corrupt_dir(self.ckpt_dir)), 3)
    chex.assert_trees_all_equal(jax.device_get(result.state.params), self.trained_12.params)

  def test_torn_last_metrics_line_does_not_block_resume(self):
    path = os.path.join(self.workdir, "metrics.jsonl")
    with open(path, "a") as f:
      f.write('{"step": 13, "loss": 1.2')  # A crash mid-write.
    result = trainer.run(_config(**{"train.num_steps": 16}), self.workdir)
    self.assertEqual(result.resumed_from, 12)
    with open(path) as f:
      records = [json.loads(line) for line in f]  # Every line parses again.
    self.assertEqual([r["step"] for r in records], list(range(2, 17, 2)))


if __name__ == "__main__":
  absltest.main()
