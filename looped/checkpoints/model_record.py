"""The model a checkpoint directory holds, recorded beside its checkpoints.

A trainer workdir or a converted checkpoint keeps `model_config.json` ({"model": the model
fields, "data": the tokenizer fields}); a BeNice! pipeline stage dir also keeps its whole
`stage_config.json`. Programs that read a checkpoint (generation, the server, the pipeline's
`pipeline.pretrain_workdir`) take the model and tokenizer from the record, so the config given
with them need not describe it; a field set on the command line that disagrees with the record
is refused naming the field and both values. The trainer writes the record (atomically) before
its first checkpoint and refuses to resume a workdir recorded with another model. A directory
without a record (written before records existed) is read with the config's model, as before.

EXECUTION_FIELDS say how to compute, not what: they always come from the config. READER_FIELDS
(the loop count R: a looped model's params do not depend on it) are the record's unless the
reader chooses them: generation, the server and the pipeline's reused pretraining run accept a
command-line `--config.model.num_recurrences` (`chosen`). The trainer resuming a workdir still
refuses any model field, R included, that disagrees with the record.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_collections

from looped import config_checks as cc
from looped.data.config import TOKENIZER_FIELDS
from looped.model.config import ModelConfig

FILENAME = "model_config.json"
STAGE_FILENAME = "stage_config.json"
EXECUTION_FIELDS = (
  "scan_recurrences",
  "scan_unroll",
  "remat",
  "attention_impl",
  "kda_chunk_size",
  "dtype",
)
# Fields a reader of a checkpoint may choose (the record's value otherwise); not when resuming.
READER_FIELDS = ("num_recurrences",)
# Paths a record may hold relative to its directory (a converted checkpoint's tokenizer.json).
_PATH_FIELDS = ("spm_path", "tokenizer_json")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _plain(value):
  """JSON-comparable: tuples as lists, recursively."""
  return json.loads(json.dumps(value))


def _tokenizer_fields(data_cfg) -> dict:
  keys = data_cfg.keys() if hasattr(data_cfg, "keys") else ()
  out = {k: data_cfg[k] for k in TOKENIZER_FIELDS if k in keys}
  for k in _PATH_FIELDS:
    if out.get(k):
      out[k] = os.path.abspath(out[k])
  return out


def make(model_cfg, data_cfg, **info) -> dict:
  """The record of a model config and the tokenizer fields of a data config (+ `info`)."""
  model = model_cfg.to_dict() if hasattr(model_cfg, "to_dict") else dict(model_cfg)
  return _plain({"model": model, "data": _tokenizer_fields(data_cfg), **info})


def write(directory: str, record: dict) -> str:
  """Writes directory/model_config.json atomically (a crash leaves the old file or none)."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, FILENAME)
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  return path


def read(directory: str) -> dict | None:
  """{"model", "data", "path"} recorded in `directory` (model_config.json, else a stage dir's
  stage_config.json); None if neither exists. Relative tokenizer paths are resolved against
  the directory."""
  for name in (FILENAME, STAGE_FILENAME):
    path = os.path.join(directory, name)
    if os.path.isfile(path):
      break
  else:
    return None
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise cc.ConfigError(f"{path} cannot be read: {e}") from None
  if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
    raise cc.ConfigError(f"{path} records no model (no 'model' object).")
  data = {k: v for k, v in dict(raw.get("data") or {}).items() if k in TOKENIZER_FIELDS}
  for k in _PATH_FIELDS:
    if data.get(k) and not os.path.isabs(data[k]):
      data[k] = os.path.join(os.path.abspath(directory), data[k])
  return {"model": raw["model"], "data": data, "path": path}


def recorded_value(record: dict, field: str):
  """A model field of a record; a field added to looped after the record was written takes its
  default (the behaviour the model was trained with)."""
  return record["model"].get(field, _DEFAULTS.get(field))


def differences(record: dict, model_cfg) -> list[tuple[str, object, object]]:
  """(field, recorded, given) of every model field (not EXECUTION_FIELDS) that differs."""
  out = []
  for field in sorted(set(model_cfg.keys()) | set(record["model"])):
    if field in EXECUTION_FIELDS:
      continue
    given = model_cfg[field] if field in model_cfg.keys() else _DEFAULTS.get(field)
    recorded = recorded_value(record, field)
    if _plain(given) != _plain(recorded):
      out.append((field, recorded, given))
  return out


def _show(value) -> str:
  return repr(tuple(value) if isinstance(value, list) else value)


def chosen_fields(overrides) -> tuple[str, ...]:
  """The READER_FIELDS among command-line overrides (field paths such as 'model.num_recurrences'):
  what a program reading a recorded checkpoint takes from config.model instead of the record."""
  given = set(overrides or ())
  return tuple(f for f in READER_FIELDS if f"model.{f}" in given)


def model_and_data(
  config, directory: str, chosen: tuple[str, ...] = ()
) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  """(model, data) describing the checkpoint in `directory`: the record's model with the
  config's EXECUTION_FIELDS and `chosen` READER_FIELDS, and the config's data with the record's
  tokenizer fields; the config's own sections when there is no record."""
  record = read(directory) if directory and os.path.isdir(directory) else None
  if record is None:
    return config.model, config.data
  model = {k: recorded_value(record, k) for k in sorted(set(record["model"]) | set(_DEFAULTS))}
  model = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items()}
  for field in EXECUTION_FIELDS + tuple(f for f in chosen if f in READER_FIELDS):
    if field in config.model.keys():
      model[field] = config.model[field]
  data = config.data.to_dict()
  for k in TOKENIZER_FIELDS:
    if k in data or k in record["data"]:
      data[k] = record["data"].get(k, "" if k != "tokenizer" else "bytes")
  return ml_collections.ConfigDict(model), ml_collections.ConfigDict(data)


def with_recorded_model(
  config, directory: str, chosen: tuple[str, ...] = ()
) -> ml_collections.ConfigDict:
  """A copy of `config` whose model and tokenizer are those recorded in `directory` (with the
  config's `chosen` READER_FIELDS)."""
  model, data = model_and_data(config, directory, chosen)
  out = ml_collections.ConfigDict(config.to_dict())
  out.model = model
  out.data = data
  return out


def check_overrides(directory: str, config, overrides) -> None:
  """ConfigError for a command-line override of a model or tokenizer field (`overrides`: the
  overridden field paths, e.g. 'model.d_model') whose value disagrees with the record;
  READER_FIELDS may disagree (the reader's choice)."""
  record = read(directory) if directory and os.path.isdir(directory) else None
  if record is None or not overrides:
    return
  for path in sorted(overrides):
    section, _, field = path.partition(".")
    skip = EXECUTION_FIELDS + READER_FIELDS
    if section == "model" and field and field not in skip and "." not in field:
      recorded = recorded_value(record, field)
    elif section == "data" and field in TOKENIZER_FIELDS:
      recorded = record["data"].get(field, "bytes" if field == "tokenizer" else "")
    else:
      continue
    given = config[section][field]
    if section == "data" and field in _PATH_FIELDS and given:
      given = os.path.abspath(given)
    if _plain(given) != _plain(recorded):
      raise cc.ConfigError(
        f"--config.{path} = {_show(given)} disagrees with the checkpoint's {field} = "
        f"{_show(recorded)} (recorded in {record['path']}); drop the flag to use the "
        "checkpoint's model."
      )


def check(workdir: str, config) -> None:
  """Trainer, before compute: ConfigError if `workdir` records a model other than config's
  (naming the first differing field and both values)."""
  if not os.path.isfile(os.path.join(workdir, FILENAME)):
    return
  record = read(workdir)
  changed = differences(record, config.model)
  if changed:
    field, recorded, given = changed[0]
    more = f" (and {len(changed) - 1} more field(s))" if len(changed) > 1 else ""
    raise cc.ConfigError(
      f"config.model.{field} = {_show(given)} disagrees with the model recorded in "
      f"{record['path']}: {field} = {_show(recorded)}{more}; use the model it was trained "
      "with or a new --workdir."
    )


def write_if_absent(workdir: str, config) -> None:
  """Trainer, before its first checkpoint: records config's model and tokenizer."""
  if not os.path.isfile(os.path.join(workdir, FILENAME)):
    write(workdir, make(config.model, config.data, written_by="train"))
