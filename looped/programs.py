"""Maps `config.program` to the module that runs it, validates once, takes the workdir's lock.

Each program module exposes `validate(config)` (raises ConfigError before any compute) and
`run(config, workdir)`; one that reads a checkpoint's recorded model also exposes
`model_source(config)` (the directory), so that a command-line override disagreeing with that
record fails here (looped.checkpoints.model_record); such a module's validate and run also take
`chosen`, the record's fields the command line chose (the loop count). Each program's import
sits in its own loader below, so that the serving simulator, say, does not pay for importing
the trainer, while readers and tools still see every program's module.
"""

import os

import jax
from absl import logging

from looped import cli, config_checks, startup
from looped.checkpoints import model_record, workdir_lock


def _train():
  from looped.train import trainer

  return trainer


def _serve_sim():
  from looped.sim import simulate

  return simulate


def _benice():
  from looped.benice import pipeline

  return pipeline


def _generate():
  from looped.engine import generate

  return generate


def _server():
  from looped.server import program

  return program


def _convert():
  from looped.convert import program

  return program


def _export():
  from looped.convert import export

  return export


PROGRAMS = {
  "train": _train,
  "serve_sim": _serve_sim,
  "benice": _benice,
  "generate": _generate,
  "server": _server,
  "convert": _convert,
  "export": _export,
}


def load(config):
  """Returns the program module named by config.program."""
  name = config_checks.choice(config, "program", PROGRAMS)
  return PROGRAMS[name]()


def _chosen(module, overrides) -> dict:
  """{'chosen': ...} for a module reading a recorded model (module docstring), else {}."""
  if getattr(module, "model_source", None) is None:
    return {}
  return {"chosen": model_record.chosen_fields(overrides)}


def validate(config, workdir: str, overrides=()):
  """Checks the config and workdir (the same on every process) before any compute; returns the
  program module. overrides: the config fields set on the command line ('model.d_model', ...)."""
  if not workdir:
    raise config_checks.ConfigError("--workdir must be a non-empty path.")
  # First: a process with a stray flag would otherwise fail validation alone (or pass it
  # alone) and leave the others waiting for it.
  startup.check_processes_agree(config, workdir)
  module = load(config)
  source = getattr(module, "model_source", None)
  if source is not None and isinstance(source(config), str):
    model_record.check_overrides(source(config), config, overrides)
  module.validate(config, **_chosen(module, overrides))
  return module


def main(config, workdir: str, overrides=(), compilation_cache: str = "", **distributed):
  """What `python -m looped.main` runs: starts jax.distributed when asked (`distributed`: the
  arguments of initialize_distributed), turns on the persistent compilation cache (see
  enable_compilation_cache), splits the CPU backend (use_cpu_devices), validates the config
  once with only warnings logged, so that a bad value prints one line and not backend chatter,
  then runs the program.
  overrides: the config fields set on the command line."""
  startup.enable_compilation_cache(compilation_cache)
  multi_process = startup.initialize_distributed(**distributed)
  with cli.quiet_logs():
    cpu_devices = startup.use_cpu_devices(config, multi_process)
    module = validate(config, workdir, overrides)
  return _run_validated(module, config, workdir, overrides, cpu_devices)


def run(config, workdir: str, overrides=()):
  """Validates, takes the workdir's lock (process 0 only) and runs the program. overrides: the
  config fields the caller set on purpose, as on the command line (e.g. a recorded checkpoint
  run at another loop count: ('model.num_recurrences',))."""
  return _run_validated(validate(config, workdir, overrides), config, workdir, overrides)


def _recorded_model(module, config, chosen) -> tuple[str, object] | None:
  """(record path, model section) that a module reading a recorded model runs, or None when it
  reads none (no model_source, or a directory without a record)."""
  source = getattr(module, "model_source", None)
  directory = source(config) if source is not None else None
  if not isinstance(directory, str) or not os.path.isdir(directory):
    return None
  record = model_record.read(directory)
  if record is None:
    return None
  return record["path"], model_record.model_and_data(config, directory, chosen)[0]


def _run_validated(module, config, workdir: str, overrides=(), cpu_devices: int | None = None):
  """Runs the program; logs start once the workdir is taken, so that a busy one fails in one
  line."""
  kwargs = _chosen(module, overrides)

  def start():
    if cpu_devices:
      logging.info(
        "CPU backend: %d devices (mesh.cpu_devices = %s)", cpu_devices, config.mesh.cpu_devices
      )
    logging.info("Config (validated):\n%s", config)
    recorded = _recorded_model(module, config, kwargs.get("chosen", ()))
    if recorded is not None:
      logging.info(
        "Model (recorded in %s; it runs, not the config's model section):\n%s", *recorded
      )
    return module.run(config, workdir, **kwargs)

  if jax.process_index() != 0:  # One lock per run, not per host of a multi-host run.
    return start()
  try:
    lock = workdir_lock.WorkdirLock(workdir).acquire()
  except workdir_lock.WorkdirBusyError as e:
    raise config_checks.ConfigError(str(e)) from None
  with lock:
    return start()
