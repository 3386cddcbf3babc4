"""Runs in a subprocess with 8 fake CPU devices for tests/sharding_test.py (not a test itself).

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_worker.py train ROOT
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_worker.py benice ROOT

`train`: 20 steps of the smoke pretraining on each mesh of MESHES in ROOT/<mesh>; the fsdp=8
run's per-device shard sizes; its step-10 checkpoint (ROOT/fsdp8_at10, the step-20 one removed)
resumed on data=2 x fsdp=4 (ROOT/resume_d2f4) to step 20. `benice`: configs/benice.py:smoke on
data=2 x fsdp=4 in ROOT/benice. Writes ROOT/<mode>.json for the parent test to compare.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np

from configs import benice, pretrain
from looped import programs, sharding
from looped.model import LoopedLM, from_config
from looped.train import objectives, trainer

MESHES = {  # name: (data, fsdp, tensor)
  "data8": (8, 1, 1),
  "fsdp8": (1, 8, 1),
  "d2_f2_t2": (2, 2, 2),
}


def smoke_config(num_steps: int, mesh=(1, 1, 1), checkpoint_every: int = 20):
  """The smoke pretraining, shortened: losses at every step, one eval at the end."""
  c = pretrain.get_config("smoke")
  c.train.num_steps = num_steps
  c.train.log_every = 1
  c.train.eval_every = 20
  c.train.checkpoint_every = checkpoint_every
  c.data.num_eval_batches = 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def train(config, workdir: str):
  model = LoopedLM(from_config(config.model))
  trainer.validate(config)
  return trainer.train(config, workdir, model, objectives.language_modeling(model, config.depth))


def losses(workdir: str) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def shard_fractions(tree) -> dict[str, list[float]]:
  """{path: fraction of the array on each device} from the addressable shards."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    sizes = [s.data.size / leaf.size for s in leaf.addressable_shards]
    out[jax.tree_util.keystr(path)] = sizes
  return out


def run_train(root: str) -> dict:
  result = {"losses": {}}
  for name, mesh in MESHES.items():
    every = 10 if name == "fsdp8" else 20
    out = train(smoke_config(20, mesh, checkpoint_every=every), os.path.join(root, name))
    result["losses"][name] = losses(os.path.join(root, name))
    if name == "fsdp8":
      state = out.state
      result["fsdp8_params"] = shard_fractions(state.params)
      adam = state.opt_state[1][0]  # chain(clip, adamw): adamw = chain(scale_by_adam, ...).
      result["fsdp8_mu"] = shard_fractions(adam.mu)
      result["fsdp8_nu"] = shard_fractions(adam.nu)
      result["fsdp8_bytes_per_device"] = sharding.bytes_per_device((state.params, state.opt_state))
  at10 = os.path.join(root, "fsdp8_at10")  # Kept for the parent to resume on 1 device.
  shutil.copytree(os.path.join(root, "fsdp8"), at10)
  shutil.rmtree(os.path.join(at10, "checkpoints", "20"))
  resumed = os.path.join(root, "resume_d2f4")
  shutil.copytree(at10, resumed)
  train(smoke_config(20, (2, 4, 1)), resumed)
  result["losses"]["resume_d2f4"] = losses(resumed)
  return result


def benice_config(mesh=(1, 1, 1)):
  """configs/benice.py:smoke without its KV-format and block-prefill columns (their model code
  is the exact decode's; the mesh adds nothing there that the compared columns do not run)."""
  c = benice.get_config("smoke")
  c.eval.kv_formats = ()
  c.eval.prefill_blocks = ()
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
  return c


def run_benice(root: str) -> dict:
  # data=2 x fsdp=4: on data=2 x fsdp=2 x tensor=2 XLA:CPU's fake devices deadlocked in this
  # program every time (5 of 8 in a collective permute, 3 in an all-reduce; jax 0.10.2, two
  # runs in a row); the tensor axis is trained in `train` (d2_f2_t2) and served in
  # engine_mesh_worker.py.
  c = benice_config((2, 4, 1))
  report = programs.run(c, os.path.join(root, "benice"))
  return {"device_count": jax.device_count(), "report": report}


if __name__ == "__main__":
  mode, root = sys.argv[1], sys.argv[2]
  assert jax.device_count() == 8, jax.devices()
  result = {"train": run_train, "benice": run_benice}[mode](root)
  with open(os.path.join(root, f"{mode}.json"), "w") as f:
    json.dump(result, f, default=lambda x: np.asarray(x).tolist())
