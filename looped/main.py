r"""Command-line entry point: parses flags and hands the config to the library.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/run \
      --config.train.num_steps=200

`python -m looped.main` alone lists the config files and their variants.
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
  try:
    with cli.quiet_logs():  # A bad config prints one line, not backend chatter before it.
      programs.validate(_CONFIG.value, _WORKDIR.value)
    programs.run(_CONFIG.value, _WORKDIR.value)
  except config_checks.ConfigError as e:
    cli.fail(str(e))


if __name__ == "__main__":
  sys.modules["__main__"].__doc__ = cli.usage()  # What --help prints.
  app.run(main, flags_parser=cli.parse_flags)
