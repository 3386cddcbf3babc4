"""Start-up work done once per process before a program runs: jax.distributed, the persistent
compilation cache, the CPU backend's device split, and the check that every process of a
multi-host run got the same config and workdir. Each must happen before any backend starts,
so programs.main calls them first."""

import hashlib
import json
import os

import jax
import numpy as np
from absl import logging

from looped import config_checks, sharding


def config_payload(config, workdir: str) -> bytes:
  """What the processes of one run must agree on: the config (sorted JSON) and the workdir."""
  return json.dumps(
    {"config": json.loads(config.to_json_best_effort(sort_keys=True)), "workdir": workdir},
    sort_keys=True,
  ).encode()


def _allgather_bytes(data: bytes, gather) -> list[bytes]:
  """Every process's `data`: lengths first, then the bytes padded to the longest."""
  lengths = np.asarray(gather(np.asarray([len(data)], np.int32))).reshape(-1)
  padded = np.zeros(int(lengths.max()), np.uint8)
  padded[: len(data)] = np.frombuffer(data, np.uint8)
  rows = np.asarray(gather(padded)).reshape(len(lengths), -1)
  return [bytes(row[:n]) for row, n in zip(rows, lengths)]


def _leaves(tree, prefix: str = "") -> dict:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for key, value in tree.items():
    out.update(_leaves(value, f"{prefix}.{key}" if prefix else key))
  return out


def _first_difference(reference: bytes, other: bytes) -> str:
  """'config.seed = 0 vs 1': the first field (sorted) whose value differs."""
  ref, oth = _leaves(json.loads(reference)), _leaves(json.loads(other))
  for key in sorted(ref.keys() | oth.keys()):
    if ref.get(key, "<absent>") != oth.get(key, "<absent>"):
      return f"{key} = {ref.get(key, '<absent>')!r} vs {oth.get(key, '<absent>')!r}"
  return "no field differs (the serialisations do)"


def check_processes_agree(config, workdir: str, gather_bytes=None) -> None:
  """Raises ConfigError if the processes of a multi-host run got different configs or workdirs.

  Each process parses its own flags; one stale flag on one host would otherwise train a
  different model per host (or hang in mismatched collectives). Compares sha256 digests, and
  only when they differ gathers the configs to name the first differing field.
  gather_bytes: bytes -> every process's bytes; process_allgather by default (tests fake it).
  """
  if gather_bytes is None:
    # Not jax.process_count() alone: it would start a backend for programs that need none.
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
      return
    from jax.experimental import multihost_utils

    def gather_bytes(data):
      return _allgather_bytes(data, multihost_utils.process_allgather)

  payload = config_payload(config, workdir)
  digests = gather_bytes(hashlib.sha256(payload).digest())
  differ = [i for i, d in enumerate(digests) if d != digests[0]]
  if not differ:
    return
  payloads = gather_bytes(payload)
  raise config_checks.ConfigError(
    f"processes disagree on the config or workdir: process(es) {differ} differ from process 0 "
    f"of {len(digests)} (first difference, process 0 vs {differ[0]}: "
    f"{_first_difference(payloads[0], payloads[differ[0]])}). Give every process the same "
    "flags."
  )


def initialize_distributed(
  enabled: bool = False,
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
) -> bool:
  """jax.distributed.initialize() when asked (returns whether it ran).

  `enabled` alone auto-detects the cluster (Cloud TPU slices, SLURM, Open MPI); any of the three
  explicit values implies it, and all three turn detection off, so each process uses all its
  local devices unless JAX_LOCAL_DEVICE_IDS says otherwise (as launch/local.py and
  launch/slurm.sbatch start processes). CPU processes exchange collectives over gloo.
  """
  explicit = {
    "coordinator_address": coordinator_address,
    "num_processes": num_processes,
    "process_id": process_id,
  }
  explicit = {k: v for k, v in explicit.items() if v is not None}
  if not (enabled or explicit):
    return False
  if len(explicit) == 3:
    # Fully specified: detect nothing. (Under SLURM jax would otherwise keep one GPU per
    # process, device SLURM_LOCALID, even for one process per node.)
    explicit["cluster_detection_method"] = "deactivate"
  jax.distributed.initialize(**explicit)
  logging.info(
    "jax.distributed: process index %d, process count %d, %d local of %d devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  return True


def enable_compilation_cache(path: str) -> str | None:
  """Points jax's persistent compilation cache at `path` (user dirs expanded) unless the
  environment already chose one (JAX_COMPILATION_CACHE_DIR) or `path` is ''. Returns the
  directory in use, or None when the cache is off."""
  chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if chosen:
    return chosen
  if not path:
    return None
  path = os.path.expanduser(path)
  jax.config.update("jax_compilation_cache_dir", path)
  return path


def use_cpu_devices(config, distributed: bool) -> int | None:
  """Splits jax's CPU backend into sharding.cpu_device_count(config, cores) devices, before any
  backend starts, so that the mesh's data axis runs one batch shard per core: a training step of
  the default model is ~1.2x faster over two CPU devices than on one two-threaded device
  (benchmarks/pipeline.py --cpu_devices). Returns the count, or None where it does not apply:
  configs without mesh.cpu_devices, multi-process runs and an XLA_FLAGS that already sets
  the host device count. Accelerator backends are untouched (only the CPU backend splits)."""
  mesh = config.get("mesh")
  if mesh is None or "cpu_devices" not in mesh or distributed:
    return None
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return None
  count = sharding.cpu_device_count(config, len(os.sched_getaffinity(0)))
  jax.config.update("jax_num_cpu_devices", count)
  return count
