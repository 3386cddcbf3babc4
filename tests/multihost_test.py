"""A multi-host run on one machine (issue 11, acceptance 3): two processes joined by
jax.distributed (launch/local.py) train the smoke config, are SIGKILLed after a checkpoint,
resume, and end with the params of a single-process run on the same global batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from absl.testing import absltest

from looped import testing
from looped.model import LoopedLM, from_config
from looped.train import objectives, trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40
OVERRIDES = {  # Checkpoints often, so the kill lands between two of them.
  "train.num_steps": STEPS,
  "train.checkpoint_every": 4,
  "train.keep_checkpoints": 20,
  "train.eval_every": STEPS,
  "train.log_every": 4,
  "data.num_eval_batches": 1,
}


def _config():
  from configs import pretrain

  c = pretrain.get_config("smoke")
  for key, value in OVERRIDES.items():
    testing.set_field(c, key, value)
  return c


def _launch(workdir: str) -> subprocess.Popen:
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  cmd = [sys.executable, os.path.join(REPO, "launch", "local.py"), "--num_processes=2", "--"]
  cmd += ["--config=configs/pretrain.py:smoke", f"--workdir={workdir}", *flags]
  return subprocess.Popen(
    cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )


def _params(workdir: str, step: int):
  return testing.saved_params(_config().model, workdir, step)


class MultiHostTest(testing.TempDirTestCase):
  def test_two_processes_killed_and_resumed_end_with_the_single_process_params(self):
    workdir = os.path.join(self.tmp, "two_hosts")
    first = _launch(workdir)
    checkpoints = os.path.join(workdir, "checkpoints")
    try:  # SIGKILL local.py once the first checkpoint is final (its children die with it).
      deadline = time.time() + 600
      while time.time() < deadline and first.poll() is None:
        if os.path.isdir(checkpoints) and any(d.isdigit() for d in os.listdir(checkpoints)):
          break
        time.sleep(0.02)
      self.assertIsNone(first.poll(), "the run ended before it could be killed")
      first.send_signal(signal.SIGKILL)
    finally:
      out_first, _ = first.communicate(timeout=120)
    killed_at = max(int(d) for d in os.listdir(checkpoints) if d.isdigit())
    self.assertLess(killed_at, STEPS, out_first[-3000:])

    # Single-process reference on the same global batches (the data order does not depend on
    # the process count), while nothing else trains.
    reference = os.path.join(self.tmp, "one_host")
    config = _config()
    model = LoopedLM(from_config(config.model))
    trainer.train(config, reference, model, objectives.language_modeling(model, config.depth))

    second = _launch(workdir)
    out, _ = second.communicate(timeout=900)
    self.assertEqual(second.returncode, 0, out[-4000:])
    for p in (0, 1):  # One mesh over both processes' devices.
      self.assertRegex(out, rf"\[p{p}\].*Mesh .* over 2 devices")
    self.assertRegex(out, r"\[p0\].*Resuming from checkpoint at step \d+")
    self.assertRegex(out, r"\[p1\].*Resuming from checkpoint at step \d+")

    got, want = _params(workdir, STEPS), _params(reference, STEPS)
    changed = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), want, _params(reference, 4))
    self.assertGreater(max(jax.tree.leaves(changed)), 1e-3)  # Training moved the params.
    # Equal to 1e-6 absolute (params are O(0.01-1)): the 2-process gradient is a cross-process
    # sum of two partial sums, so float32 rounding differs (measured: at most ~2e-7 after 40 steps).
    for path, a in jax.tree_util.tree_leaves_with_path(got):
      b = _at(want, path)
      np.testing.assert_allclose(a, b, rtol=0, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


if __name__ == "__main__":
  absltest.main()
