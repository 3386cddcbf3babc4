"""Maps `config.program` to the library function that runs it.

Each program module exposes `validate(config)` (raises ConfigError before any compute) and
`run(config, workdir)`. Modules are imported lazily so that, e.g., the serving simulator does not
pay for importing the trainer.
"""

import importlib

from absl import logging

from looped import config_checks

PROGRAMS = {
  "train": "looped.train.trainer",
  "serve_sim": "looped.serving.simulate",
  "benice": "looped.benice.pipeline",
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
  module = validate(config, workdir)
  logging.info("Config (validated):\n%s", config)
  return module.run(config, workdir)
