r"""Command-line entry point: parses flags and hands the config to the library.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/run \
      --config.train.num_steps=200

`python -m looped.main` alone lists the config files and their variants.

Multi-host runs start one such process per host (or per GPU). `--jax_distributed` alone lets
jax.distributed.initialize() auto-detect the cluster (Cloud TPU slices, SLURM, Open MPI);
`--coordinator_address`, `--num_processes` and `--process_id` set it explicitly (and imply
--jax_distributed; all three turn detection off, so each process uses all its local devices
unless JAX_LOCAL_DEVICE_IDS says otherwise), as launch/local.py and launch/slurm.sbatch do.
CPU processes exchange collectives over gloo (jax's default CPU collectives).
"""

import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from looped import cli, config_checks, programs

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and reports.")
_DISTRIBUTED = flags.DEFINE_bool(
  "jax_distributed", False, "Call jax.distributed.initialize() (multi-host TPU/GPU runs)."
)
_COORDINATOR = flags.DEFINE_string(
  "coordinator_address",
  None,
  "host:port of process 0's coordinator (default: auto-detected). Given with --num_processes "
  "and --process_id, no cluster detection runs.",
)
_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes", None, "Processes in the run (default: auto-detected).", lower_bound=1
)
_PROCESS_ID = flags.DEFINE_integer(
  "process_id", None, "This process's index in [0, num_processes).", lower_bound=0
)
flags.mark_flags_as_required(["config", "workdir"])


def _quiet_library_info_logs():
  """Orbax logs several INFO lines per checkpoint; keep its warnings, drop the chatter."""
  handler = logging.get_absl_handler()
  handler.addFilter(
    lambda record: record.levelno > std_logging.INFO or "/orbax/" not in record.pathname
  )


def _initialize_distributed() -> bool:
  """jax.distributed.initialize() when asked (returns whether); explicit flags override
  auto-detection."""
  explicit = {
    "coordinator_address": _COORDINATOR.value,
    "num_processes": _NUM_PROCESSES.value,
    "process_id": _PROCESS_ID.value,
  }
  explicit = {k: v for k, v in explicit.items() if v is not None}
  if not (_DISTRIBUTED.value or explicit):
    return False
  if len(explicit) == 3:
    # Fully specified: detect nothing. (Under SLURM jax would otherwise keep one GPU per
    # process, device SLURM_LOCALID, even for one process per node.)
    explicit["cluster_detection_method"] = "deactivate"
  import jax

  jax.distributed.initialize(**explicit)
  logging.info(
    "jax.distributed: process index %d, process count %d, %d local of %d devices",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  return True


def _fail_now(message: str) -> None:
  """cli.fail for a multi-process run, skipping jax.distributed's exit handler: it waits for
  every process to shut down, so a process failing alone (e.g. process 0 finding the workdir
  busy) would hang there, unseen by its launcher, while the others wait for it."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(cli.EXIT_USAGE)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  _quiet_library_info_logs()
  distributed = _initialize_distributed()
  try:
    with cli.quiet_logs():  # A bad config prints one line, not backend chatter before it.
      programs.validate(_CONFIG.value, _WORKDIR.value)
    programs.run(_CONFIG.value, _WORKDIR.value)
  except config_checks.ConfigError as e:
    if distributed:
      _fail_now(str(e))
    cli.fail(str(e))


if __name__ == "__main__":
  sys.modules["__main__"].__doc__ = cli.usage()  # What --help prints.
  app.run(main, flags_parser=cli.parse_flags)
