r"""Command-line entry point: parses flags and hands them to `looped.programs.main`.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/run \
      --config.train.num_steps=200

`python -m looped.main` alone lists the config files and their variants;
`--config=FILE --help` lists that config's fields with their defaults.

Multi-host runs start one such process per host (or per GPU). `--jax_distributed` alone lets
jax.distributed.initialize() auto-detect the cluster (Cloud TPU slices, SLURM, Open MPI);
`--coordinator_address`, `--num_processes` and `--process_id` set it explicitly (and imply
--jax_distributed), as launch/local.py and launch/slurm.sbatch do
(`looped.startup.initialize_distributed`).
"""

import logging as std_logging
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
_CACHE = flags.DEFINE_string(
  "compilation_cache",
  "~/.cache/looped/xla",
  "Persistent XLA compilation cache, so a rerun or a similar config skips compiling what it "
  "compiled before ('' = off; JAX_COMPILATION_CACHE_DIR, when set, wins).",
)
flags.mark_flags_as_required(["config", "workdir"])


def _quiet_library_info_logs():
  """Orbax logs several INFO lines per checkpoint; keep its warnings, drop the chatter."""
  handler = logging.get_absl_handler()
  handler.addFilter(
    lambda record: record.levelno > std_logging.INFO or "/orbax/" not in record.pathname
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  _quiet_library_info_logs()
  distributed = dict(
    enabled=_DISTRIBUTED.value,
    coordinator_address=_COORDINATOR.value,
    num_processes=_NUM_PROCESSES.value,
    process_id=_PROCESS_ID.value,
  )
  try:
    overrides = tuple(config_flags.get_override_values(flags.FLAGS["config"]))
    programs.main(
      _CONFIG.value, _WORKDIR.value, overrides, compilation_cache=_CACHE.value, **distributed
    )
  except config_checks.ConfigError as e:
    import jax

    cli.fail(str(e), distributed=jax.distributed.is_initialized())


if __name__ == "__main__":
  sys.modules["__main__"].__doc__ = cli.usage()  # What --help prints.
  app.run(main, flags_parser=cli.parse_flags)
