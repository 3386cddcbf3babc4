"""The engine on a device mesh: on 8 fake CPU devices (a subprocess, tests/engine_mesh_worker.py)
the tensor-parallel engines generate the 1-device engine's tokens, with its logits to 1e-5, for
concurrent requests with chunked prefill and prefix hits in both cache layouts; their params and
page pools are split as the rules say (not silently replicated); and bad meshes are refused
before compute, naming the field.

The 8-device runs happen in a subprocess: the device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import engine_mesh_worker as worker
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from configs import pretrain
from looped import config_checks
from looped.engine.engine import Engine, EngineConfig
from looped.engine.mesh import EngineMesh
from looped.model.looped_lm import LoopedLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Param paths split over 'tensor' (dimension) and those split only when the KV heads divide.
_SPLIT = {"query": 1, "out": 0, "up": 1, "gate": 1, "down": 0, "embedding": 0}
_KV = {"key": 1, "value": 1}


def _kind(path: str) -> str:
  """'query' for "['params'][...]['query']['kernel']", 'embedding', 'scale', ..."""
  names = re.findall(r"\['([^']+)'\]", path)
  return names[-2] if names[-1] == "kernel" else names[-1]


class EngineMeshTest(testing.TempDirTestCase):
  """One method: the worker's engines are shared by every check (one subprocess, one compile
  of each engine)."""

  def test_mesh_engines_equal_one_device_and_are_split(self):
    out = os.path.join(self.tmp, "mesh.json")
    env = testing.fake_cpu_devices_env(8)
    paths = [REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    run = lambda: subprocess.run(
      [sys.executable, os.path.join(REPO, "tests", "engine_mesh_worker.py"), out],
      cwd=REPO,
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
    )
    proc = run()
    if proc.returncode and testing.XLA_CPU_COLLECTIVE_TIMEOUT in proc.stderr:
      print("engine_mesh_worker: XLA:CPU collective deadlock; running it again")
      proc = run()
    if proc.returncode:
      raise AssertionError(f"engine_mesh_worker failed:\n{proc.stderr[-4000:]}")
    with open(out) as f:
      self.result = json.load(f)
    self.check_the_requests_exercise_chunks_hits_and_concurrency()
    self.check_tokens_and_logits_equal_the_one_device_engine()
    self.check_params_are_split_by_the_rules()
    self.check_pools_are_split_over_kv_heads_where_they_divide()

  def check_the_requests_exercise_chunks_hits_and_concurrency(self):
    prompts = [r.prompt_len for r in worker.requests(worker.CFG.vocab_size)]
    self.assertGreater(max(prompts), 8)  # Longer than a step: prefilled in chunks.
    for name, run in self.result.items():
      self.assertGreater(run["hit_rate"], 0, name)
      self.assertEqual(run["most_rows"], 3, name)  # Three requests in one step.
      self.assertEqual(run["most_tokens"], 8, name)

  def check_tokens_and_logits_equal_the_one_device_engine(self):
    compared = 0
    for model, share_kv, meshes in worker.CASES:
      prefix = f"{model}/{'shared' if share_kv else 'unshared'}"
      ref = self.result[f"{prefix}/one"]
      self.assertEqual(ref["devices"], 1)
      for mesh in meshes[1:]:
        got = self.result[f"{prefix}/{mesh}"]
        self.assertEqual(got["devices"], 8)
        self.assertEqual(got["tokens"], ref["tokens"], f"{prefix}/{mesh}")
        for i, (g, r) in enumerate(zip(got["logits"], ref["logits"], strict=True)):
          self.assertEqual(sorted(g), sorted(r), f"{prefix}/{mesh} request {i}")
          for p in r:
            np.testing.assert_allclose(
              g[p], r[p], atol=1e-5, rtol=0, err_msg=f"{prefix}/{mesh} request {i} position {p}"
            )
            compared += 1
    self.assertGreater(compared, 150)

  def _tensor(self, name: str) -> int:
    return worker.MESHES[name.split("/")[-1]][2]

  def check_params_are_split_by_the_rules(self):
    for name, run in self.result.items():
      tensor = self._tensor(name)
      cfg = worker.MODELS[name.split("/")[0]]
      kv_split = cfg.num_kv_heads % tensor == 0
      checked = 0
      for path, leaf in run["params"].items():
        kind = _kind(path)
        dim = _SPLIT.get(kind, _KV.get(kind) if kv_split else None)
        shards = tensor if dim is not None else 1
        self.assertEqual(leaf["fractions"], [1 / shards] * run["devices"], f"{name} {path}")
        if dim is not None and tensor > 1:
          self.assertEqual(leaf["spec"][dim], "tensor", f"{name} {path}")
          checked += 1
      if tensor > 1:  # Every projection and the embedding.
        self.assertGreaterEqual(checked, 4 * 7 - (0 if kv_split else 4 * 2) + 1, name)

  def check_pools_are_split_over_kv_heads_where_they_divide(self):
    for name, run in self.result.items():
      tensor = self._tensor(name)
      model, layout = name.split("/")[:2]
      shards = tensor if worker.MODELS[model].num_kv_heads % tensor == 0 else 1
      self.assertLen(run["pages"], 8, name)  # K and V of 4 layers.
      for path, leaf in run["pages"].items():
        self.assertEqual(leaf["fractions"], [1 / shards] * run["devices"], f"{name} {path}")
        # [(R,) pages, page_size, KV heads, head_dim]: the core's R axis when unshared.
        heads = 3 if (layout == "unshared" and path.startswith("['core']")) else 2
        want = ["tensor" if shards > 1 and d == heads else None for d in range(len(leaf["spec"]))]
        self.assertEqual(leaf["spec"], want, f"{name} {path}")


class EngineMeshValidationTest(absltest.TestCase):
  """Bad meshes fail before anything is placed, naming the field (1 device here)."""

  def test_shards_that_do_not_divide_the_heads_are_refused(self):
    with self.assertRaisesRegex(
      config_checks.ConfigError, r"^mesh_shape.tensor = 3 does not divide the model's num_heads"
    ):
      EngineMesh.create(worker.CFG, (1, 1, 3), pretrain.mesh_rules())

  def test_too_few_devices_are_refused(self):
    with self.assertRaisesRegex(ValueError, r"mesh_shape = \(1, 1, 2\) needs 2 devices"):
      EngineMesh.create(worker.CFG, (1, 1, 2), pretrain.mesh_rules())

  def test_a_mesh_without_rules_is_refused(self):
    config = EngineConfig(share_kv=True, num_pages=4, page_size=4, mesh_shape=(1, 1, 2))
    with self.assertRaisesRegex(ValueError, "needs mesh_rules"):
      Engine(LoopedLM(worker.CFG), None, config)


if __name__ == "__main__":
  absltest.main()
