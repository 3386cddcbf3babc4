"""Sharded training on a device mesh: config checks, and on 8 fake CPU devices the
same losses as one device for data / fsdp / tensor / mixed meshes, FSDP's 1/8 shards, a
checkpoint moving between meshes, and the BeNice! pipeline on a mesh.

The 8-device runs happen in subprocesses (tests/mesh_worker.py): the device count is fixed when
JAX starts, and this process keeps its single CPU device for the 1-device references.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from configs import benice, pretrain
from looped import config_checks, programs, sharding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
import mesh_worker  # noqa: E402


def _start_worker(mode: str, root: str) -> subprocess.Popen:
  """mesh_worker.py `mode` in a fresh ROOT/mesh."""
  work = os.path.join(root, "mesh")
  shutil.rmtree(work, ignore_errors=True)
  os.makedirs(work)
  env = testing.fake_cpu_devices_env(8)
  env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
  return subprocess.Popen(
    [sys.executable, os.path.join(REPO, "tests", "mesh_worker.py"), mode, work],
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )


def _finish(proc: subprocess.Popen, root: str, mode: str) -> dict:
  """The worker's result; once more from scratch if XLA:CPU ended it in a collective deadlock
  (looped_testing.fake_cpu_devices_env)."""
  out, _ = proc.communicate(timeout=1800)
  if proc.returncode and testing.XLA_CPU_COLLECTIVE_TIMEOUT in out:
    print(f"mesh_worker {mode}: XLA:CPU collective deadlock; running it again")
    out, _ = (proc := _start_worker(mode, root)).communicate(timeout=1800)
  if proc.returncode:
    raise AssertionError(f"mesh_worker {mode} failed ({proc.returncode}):\n{out[-4000:]}")
  with open(os.path.join(root, "mesh", f"{mode}.json")) as f:
    return json.load(f)


class ValidateTest(parameterized.TestCase):
  """Bad meshes fail before compute, with the numbers in the message."""

  def _config(self, data=-1, fsdp=1, tensor=1, **overrides):
    c = pretrain.get_config("smoke")
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    for key, value in overrides.items():
      testing.set_field(c, key, value)
    return c

  @parameterized.parameters(
    (dict(data=2, fsdp=2), "multiplies to 4 devices, but there are 8"),
    (dict(data=-1, fsdp=-1), "at most one axis may be -1"),
    (dict(data=-1, fsdp=3), "the fixed axes multiply to 3, which does not divide the 8"),
    (dict(data=0), "mesh.data = 0 is invalid"),
    (dict(data=1, fsdp=8, **{"data.batch_size": 4}), "data.batch_size = 4 is invalid"),
    (dict(data=8, **{"data.eval_batch_size": 12}), "mesh.data x mesh.fsdp = 8"),
    (dict(data=4, tensor=2, **{"model.num_heads": 3}), "num_heads = 3 is not divisible by the 2"),
    (dict(data=4, tensor=2, **{"model.mlp_dim": 129}), "mlp_dim = 129 is not divisible"),
    (dict(data=1, fsdp=8, **{"model.d_model": 60}), "d_model = 60 is not divisible by the 8"),
    (dict(data=8, **{"train.grad_accum_steps": 2}), "x train.grad_accum_steps = 8 x 2"),
    (dict(**{"mesh_rules": (("batch", "pipeline"),)}), "unknown mesh axes ['pipeline']"),
  )
  def test_bad_mesh_fails_naming_the_numbers(self, overrides, message):
    with self.assertRaisesRegex(config_checks.ConfigError, "config") as cm:
      sharding.validate(self._config(**overrides), num_devices=8)
    self.assertIn(message, str(cm.exception))

  def test_default_mesh_takes_every_device_on_data(self):
    self.assertEqual(
      sharding.validate(self._config(), num_devices=8), {"data": 8, "fsdp": 1, "tensor": 1}
    )

  def test_program_validation_checks_the_mesh_before_compute(self):
    c = self._config(data=2, fsdp=2)  # 4 != this process's 1 device.
    with self.assertRaisesRegex(config_checks.ConfigError, "there are 1"):
      programs.validate(c, "/nonexistent/workdir")
    b = benice.get_config("smoke")
    b.mesh.tensor = 2
    with self.assertRaisesRegex(config_checks.ConfigError, "does not divide the 1 devices"):
      programs.validate(b, "/nonexistent/workdir")

  def test_uneven_optional_axes_are_replicated(self):
    c = self._config(data=4, tensor=2)  # smoke: 1 KV head, vocabulary 257.
    shaped_like_a_mesh = type("Mesh", (), {"shape": {"data": 4, "fsdp": 1, "tensor": 2}})()
    rules = dict(sharding.rules(c, shaped_like_a_mesh))
    self.assertIsNone(rules["kv_heads"])
    self.assertIsNone(rules["vocab"])
    self.assertEqual(rules["heads"], "tensor")
    self.assertEqual(rules["batch"], ("data", "fsdp"))


class CpuDevicesTest(parameterized.TestCase):
  """mesh.cpu_devices: how many CPU devices the main command splits the host into."""

  @parameterized.parameters(
    (dict(), 2, 2),  # One per core.
    (dict(), 3, 2),  # Not 3: batches of 8 rows would not split evenly.
    (dict(), 8, 8),
    (dict(**{"data.eval_batch_size": 4}), 8, 4),  # Every batch size must split.
    (dict(), 1, 1),
    (dict(**{"mesh.tensor": 2}), 3, 2),  # The fixed tensor axis takes 2; data the rest (1).
    (dict(**{"mesh.data": 1}), 8, 1),  # A fixed mesh of one device.
    (dict(**{"mesh.data": 1, "mesh.tensor": 4}), 2, 4),  # A fixed mesh: its size (the engine's).
    (dict(**{"mesh.cpu_devices": 1}), 8, 1),  # Asked for: one device.
    (dict(**{"mesh.cpu_devices": 3}), 2, 3),  # Asked for: taken as given (validate judges it).
  )
  def test_count(self, overrides, cores, expected):
    c = pretrain.get_config("smoke")  # Batches of 8 rows.
    for key, value in overrides.items():
      testing.set_field(c, key, value)
    self.assertEqual(sharding.cpu_device_count(c, cores), expected)

  def test_negative_count_fails_naming_the_field(self):
    c = pretrain.get_config("smoke")
    c.mesh.cpu_devices = -1
    with self.assertRaisesRegex(config_checks.ConfigError, "mesh.cpu_devices = -1"):
      sharding.cpu_device_count(c, 2)

  def _devices_in_subprocess(self, cores: set[int], cpu_devices: int, xla_flags: str = "") -> int:
    """jax.device_count() after startup.use_cpu_devices in a fresh process on `cores`."""
    code = (
      "import jax; from configs import pretrain; from looped import startup; "
      "c = pretrain.get_config('smoke'); "
      f"c.mesh.cpu_devices = {cpu_devices}; "
      "startup.use_cpu_devices(c, distributed=False); print(jax.device_count())"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    out = subprocess.run(
      [sys.executable, "-c", code],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
      preexec_fn=lambda: os.sched_setaffinity(0, cores),
      check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])

  def test_the_backend_splits_before_it_starts(self):
    first = min(os.sched_getaffinity(0))
    self.assertEqual(self._devices_in_subprocess({first}, 0), 1)  # One core: one device.
    self.assertEqual(self._devices_in_subprocess({first}, 4), 4)  # Asked for, whatever the cores.
    # A host device count already set in XLA_FLAGS (launch/local.py, tests) is left alone.
    forced = "--xla_force_host_platform_device_count=2"
    self.assertEqual(self._devices_in_subprocess({first}, 4, forced), 2)


class MeshTrainingTest(testing.TempDirTestCase):
  """Acceptance 1 and 2: 8 fake devices (subprocess) against this process's one device.

  One test method: the runs are shared, and pytest-xdist would repeat a setUpClass in every
  worker that gets one of several methods.
  """

  def test_meshes_shards_and_checkpoints_across_meshes(self):
    proc = _start_worker("train", self.tmp)
    reference = os.path.join(self.tmp, "one_device")  # Trains while the worker runs.
    mesh_worker.train(mesh_worker.smoke_config(20), reference)
    self.result = _finish(proc, self.tmp, "train")
    self.ref_losses = mesh_worker.losses(reference)
    self.check_every_mesh_gives_the_one_device_losses()
    self.check_fsdp8_holds_one_eighth_of_every_matrix_and_its_adam_moments_per_device()
    self.check_fsdp8_checkpoint_resumes_on_another_mesh_with_the_uninterrupted_losses()
    self.check_fsdp8_checkpoint_resumes_on_one_device_with_the_uninterrupted_losses()

  def check_every_mesh_gives_the_one_device_losses(self):
    ref = np.array([self.ref_losses[s] for s in range(1, 21)])
    self.assertLess(ref[-1], ref[0] - 1.0)  # It trains.
    for name in mesh_worker.MESHES:
      got = self.result["losses"][name]
      losses = np.array([got[str(s)] for s in range(1, 21)])
      np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=name)

  def check_fsdp8_holds_one_eighth_of_every_matrix_and_its_adam_moments_per_device(self):
    for what in ("fsdp8_params", "fsdp8_mu", "fsdp8_nu"):
      fractions = self.result[what]
      matrices = [p for p in fractions if p.endswith("['kernel']") or "embedding" in p]
      self.assertGreaterEqual(len(matrices), 12, what)  # Every projection and the embedding.
      for path in matrices:
        self.assertEqual(fractions[path], [0.125] * 8, f"{what} {path}")
      for path, f in fractions.items():  # Norm scales, injection rates: replicated.
        if path not in matrices:
          self.assertEqual(f, [1.0] * 8, f"{what} {path}")
    per_device = self.result["fsdp8_bytes_per_device"]
    self.assertLen(per_device, 8)
    self.assertLen(set(per_device.values()), 1)

  def check_fsdp8_checkpoint_resumes_on_another_mesh_with_the_uninterrupted_losses(self):
    uninterrupted = self.result["losses"]["fsdp8"]
    resumed = self.result["losses"]["resume_d2f4"]  # data=2 x fsdp=4.
    for s in range(11, 21):
      np.testing.assert_allclose(resumed[str(s)], uninterrupted[str(s)], rtol=1e-6, err_msg=s)

  def check_fsdp8_checkpoint_resumes_on_one_device_with_the_uninterrupted_losses(self):
    workdir = os.path.join(self.tmp, "resume_one_device")
    shutil.copytree(os.path.join(self.tmp, "mesh", "fsdp8_at10"), workdir)
    mesh_worker.train(mesh_worker.smoke_config(20), workdir)
    resumed = mesh_worker.losses(workdir)
    uninterrupted = self.result["losses"]["fsdp8"]
    self.assertEqual(sorted(resumed), list(range(1, 21)))
    for s in range(11, 21):
      np.testing.assert_allclose(resumed[s], uninterrupted[str(s)], rtol=1e-6, err_msg=s)


class BeNiceOnMeshTest(absltest.TestCase):
  """configs/benice.py:smoke (without its KV-format and block columns) on data=2 x fsdp=4
  reports the 1-device perplexities to 1e-4 (tests/mesh_worker.py says why not tensor=2)."""

  def test_report_matches_the_one_device_report(self):
    with tempfile.TemporaryDirectory() as root:
      proc = _start_worker("benice", root)
      one = programs.run(mesh_worker.benice_config(), os.path.join(root, "one_device"))
      mesh = _finish(proc, root, "benice")
    self.assertEqual(mesh["device_count"], 8)
    ref = json.loads(json.dumps(one))
    got = mesh["report"]
    perplexities = list(_perplexities(ref))
    self.assertGreaterEqual(len(perplexities), 6)  # unshared + shared, for every model.
    for path, value in perplexities:
      np.testing.assert_allclose(_at(got, path), value, rtol=1e-4, err_msg=str(path))
    # The report's greedy samples run the engine on the mesh: the same tokens.
    for name, m in ref["models"].items():
      self.assertEqual(got["models"][name]["samples"], m["samples"], name)


def _perplexities(node, path=()):
  """(path, value) of every perplexity in a report."""
  if isinstance(node, dict):
    for key, value in node.items():
      if "ppl" in key and isinstance(value, (int, float)):
        yield path + (key,), value
      else:
        yield from _perplexities(value, path + (key,))
  elif isinstance(node, list):
    for i, value in enumerate(node):
      yield from _perplexities(value, path + (i,))


def _at(node, path):
  for key in path:
    node = node[key]
  return node


if __name__ == "__main__":
  absltest.main()
