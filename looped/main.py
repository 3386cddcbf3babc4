r"""Command-line entry point: parses flags and hands the config to the library.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/run \
      --config.train.num_steps=200
"""

import logging as std_logging

from absl import app, flags, logging
from ml_collections import config_flags

from looped import programs

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config(arg)).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and reports.")
_DISTRIBUTED = flags.DEFINE_bool(
  "jax_distributed", False, "Call jax.distributed.initialize() (multi-host TPU/GPU runs)."
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
  if _DISTRIBUTED.value:
    import jax

    jax.distributed.initialize()
  logging.info("Config:\n%s", _CONFIG.value)
  programs.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
