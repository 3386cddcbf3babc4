"""Program 'export': a looped checkpoint (trained or converted) -> a folder in the Hugging Face
layout of the Parcae, Huginn or Ouro family (export.family), the inverse of convert
(docs/convert.md, Export).

validate(config) reads the checkpoint's recorded model and refuses, in one line naming the model
field, what the family cannot express (its module's `check`: parcae_export, huginn_export,
ouro_export), before any weight is read. run restores the params, refuses what only the params
show (the module's `check_params`: Parcae's learned QK-norm scales, Huginn's per-layer RoPE
tables), maps them (`to_tensors`) and writes config.json, model.safetensors, pytorch_model.bin
(export.torch_bin) and the recorded tokenizer.json (with its tokenizer_config.json) into the
workdir. Everything is written into a temporary directory inside the workdir first and then
moved in, config.json last: a folder without config.json is not a checkpoint, so an interrupted
export never leaves one half-written.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_collections
from absl import logging
from safetensors.numpy import save_file

from looped import config_checks as cc
from looped import schema
from looped.checkpoints import model_record, restore
from looped.convert import hf_folder, huginn_export, ouro_export, parcae_export, torch_save
from looped.convert.config import ExportConfig
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM

_PARTIAL = ".export.partial"  # The temporary directory inside the workdir.
EXPORTERS = {"parcae": parcae_export, "huginn": huginn_export, "ouro": ouro_export}
# export.family='auto': each family has one injection form, so model.injection names the only
# family that can express the model; that family's check names any other field it cannot.
_AUTO = {"diagonal": "parcae", "linear": "huginn", "none": "ouro"}


def _recorded_model(config) -> tuple[model_lib.ModelConfig, dict]:
  checkpoint = config.export.checkpoint
  restore.check_checkpoint(config, "export")
  record = model_record.read(checkpoint)
  if record is None:
    cc.fail(
      "export.checkpoint",
      checkpoint,
      f"it records no model ({model_record.FILENAME}); export needs the model it holds",
    )
  fields = {
    f: model_record.recorded_value(record, f) for f in model_lib.ModelConfig.__dataclass_fields__
  }
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  model_cfg = ml_collections.ConfigDict(fields)
  model_lib.validate(ml_collections.ConfigDict({"model": model_cfg}))
  return model_lib.from_config(model_cfg), record


def exporter(family: str, cfg):
  """The module writing `family` ('auto': the one model.injection names, _AUTO)."""
  if family == "auto":
    if cfg.injection not in _AUTO:
      raise cc.ConfigError(
        f"model.injection = {cfg.injection!r} cannot be exported with export.family = 'auto': "
        f"no family injects that way ({', '.join(f'{k} -> {v}' for k, v in _AUTO.items())})."
      )
    family = _AUTO[cfg.injection]
  return EXPORTERS[family]


def _check(config, workdir: str):
  schema.validate(ExportConfig, config, "export")
  cfg, record = _recorded_model(config)
  hf = exporter(config.export.family, cfg).check(cfg)
  taken = [n for n in os.listdir(workdir) if n not in (".lock", _PARTIAL)] if workdir else []
  if workdir and os.path.isdir(workdir) and taken:
    raise cc.ConfigError(
      f"--workdir {workdir} is not empty (it holds {sorted(taken)[0]}); export into a new "
      "directory."
    )
  return cfg, record, hf


def validate(config) -> None:
  """Every field and the recorded model; reads no weight."""
  cc.choice(config, "program", ("export",))
  schema.validate(ExportConfig, config, "export")
  cfg = _recorded_model(config)[0]
  exporter(config.export.family, cfg).check(cfg)


def _tokenizer_files(record: dict) -> list[str]:
  """The recorded Hugging Face tokenizer.json and the tokenizer_config.json beside it."""
  data = record["data"]
  path = data.get("tokenizer_json", "")
  if data.get("tokenizer") != "huggingface" or not path:
    return []
  beside = os.path.join(os.path.dirname(path), hf_folder.TOKENIZER_CONFIG)
  return [path] + ([beside] if os.path.isfile(beside) else [])


def run(config, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  cfg, record, hf = _check(config, workdir)
  params = restore.restore_params(
    LoopedLM(cfg), config.export.checkpoint, config.export.step, "export.checkpoint"
  )
  family = exporter(config.export.family, cfg)
  family.check_params(params, cfg)
  tensors = family.to_tensors(params, cfg, hf)
  partial = os.path.join(workdir, _PARTIAL)
  shutil.rmtree(partial, ignore_errors=True)  # A crashed export's leftovers.
  os.makedirs(partial)
  save_file(tensors, os.path.join(partial, hf_folder.SINGLE), metadata={"format": "pt"})
  if config.export.torch_bin:
    torch_save.save(os.path.join(partial, hf_folder.TORCH_BIN), tensors)
  tokenizer = _tokenizer_files(record)
  for path in tokenizer:
    shutil.copyfile(path, os.path.join(partial, os.path.basename(path)))
  with open(os.path.join(partial, hf_folder.CONFIG), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
    f.write("\n")
  names = sorted(os.listdir(partial), key=lambda n: n == hf_folder.CONFIG)  # config.json last.
  for name in names:
    os.replace(os.path.join(partial, name), os.path.join(workdir, name))
  os.rmdir(partial)
  if not tokenizer:
    logging.warning("export: the checkpoint records no tokenizer.json; none written.")
  logging.info(
    "export: %s (%d tensors) -> %s (%s: %s)",
    config.export.checkpoint,
    len(tensors),
    workdir,
    family.FAMILY,
    ", ".join(names),
  )
  return {"folder": workdir, "files": names, "num_tensors": len(tensors), "family": family.FAMILY}
