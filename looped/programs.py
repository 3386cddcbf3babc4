"""Maps `config.program` to the library function that runs it.

Each program module exposes `validate(config)` (raises ConfigError before any compute) and
`run(config, workdir)`. Modules are imported lazily so that, e.g., the serving simulator does not
pay for importing the trainer.
"""

import importlib

import jax
from absl import logging

from looped import config_checks
from looped.train import workdir_lock

PROGRAMS = {
  "train": "looped.train.trainer",
  "serve_sim": "looped.serving.simulate",
  "benice": "looped.benice.pipeline",
  "generate": "looped.engine.generate",
}


def load(config):
  """Returns the program module named by config.program."""
  name = config_checks.choice(config, "program", PROGRAMS)
  return importlib.import_module(PROGRAMS[name])


def validate(config, workdir: str):
  """Checks the config and workdir before any compute; returns the program module."""
  if not workdir:
    raise config_checks.ConfigError("--workdir must be a non-empty path.")
  module = load(config)
  module.validate(config)
  return module


def run(config, workdir: str):
  """Validates, takes the workdir's lock (process 0 only) and runs the program."""
  module = validate(config, workdir)
  if jax.process_index() != 0:  # One lock per run, not per host of a multi-host run.
    logging.info("Config (validated):\n%s", config)
    return module.run(config, workdir)
  try:
    lock = workdir_lock.WorkdirLock(workdir).acquire()
  except workdir_lock.WorkdirBusyError as e:
    raise config_checks.ConfigError(str(e)) from None
  with lock:
    logging.info("Config (validated):\n%s", config)
    return module.run(config, workdir)
