"""Program 'export': a looped checkpoint (trained or converted) -> a folder in the Hugging Face
layout of the Parcae, Huginn, Ouro or looped family (export.family), the inverse of convert
(docs/convert.md, Export).

validate(config) reads the checkpoint's recorded model and refuses, in one line naming the model
field, what the family cannot express (its module's `check`: parcae_export, huginn_export,
ouro_export, looped_export), before any weight is read; 'auto' takes the public family
model.injection names when it expresses the model and the looped family (this project's own
modeling code, which expresses every model) otherwise. run restores the params, refuses what
only the params show (the module's `check_params`: Parcae's learned QK-norm scales, Huginn's
per-layer RoPE tables; 'auto' then takes looped), maps them (`to_tensors`), casts them to
export.dtype and writes config.json (with the tokenizer's bos/eos/pad ids and the dtype),
model.safetensors (sharded past export.max_shard_bytes where the family's loader reads shards),
pytorch_model.bin (export.torch_bin, the families that read one), the tokenizer files
(tokenizer_files.py) and, for looped, its modeling code. Everything is written into a temporary
directory inside the workdir first, made 0644, and moved in, config.json last: a folder without
config.json is not a checkpoint, so an interrupted export never leaves one half-written; the
workdir's lock file goes last, so the folder holds the export's files only.
"""

from __future__ import annotations

import json
import os
import shutil

import ml_collections
import ml_dtypes
import numpy as np
from absl import logging
from safetensors.numpy import save_file

from looped import config_checks as cc
from looped import schema
from looped.checkpoints import model_record, restore, workdir_lock
from looped.convert import (
  hf_folder,
  huginn_export,
  looped_export,
  ouro_export,
  parcae_export,
  tokenizer_files,
  torch_save,
)
from looped.convert.config import ExportConfig
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM

_PARTIAL = ".export.partial"  # The temporary directory inside the workdir.
EXPORTERS = {
  "parcae": parcae_export,
  "huginn": huginn_export,
  "ouro": ouro_export,
  "looped": looped_export,
}
# export.family='auto': each public family has one injection form, so model.injection names the
# only one that can express the model; its check names any other field it cannot, and then the
# looped family writes it.
_AUTO = {"diagonal": "parcae", "linear": "huginn", "none": "ouro"}
_MODE = 0o644  # Every written file: readable by all, as the tokenizer and config files are.
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


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
  """The module writing `family` ('auto': the public family model.injection names, _AUTO; see
  `choose` for the fallback to looped)."""
  if family == "auto":
    if cfg.injection not in _AUTO:
      raise cc.ConfigError(
        f"model.injection = {cfg.injection!r} cannot be exported with export.family = 'auto': "
        f"no family injects that way ({', '.join(f'{k} -> {v}' for k, v in _AUTO.items())})."
      )
    family = _AUTO[cfg.injection]
  return EXPORTERS[family]


def choose(family: str, cfg, params=None):
  """The module writing the model: `family`'s, or for 'auto' the public family model.injection
  names if it expresses the model (its check, and with `params` its check_params, pass), else
  looped's."""
  if family != "auto":
    return EXPORTERS[family]
  module = EXPORTERS.get(_AUTO.get(cfg.injection, "looped"))
  try:
    module.check(cfg)
    if params is not None:
      module.check_params(params, cfg)
  except cc.ConfigError as e:
    logging.info("export: family 'auto' writes looped (%s)", e)
    return looped_export
  return module


def _check(config, workdir: str):
  schema.validate(ExportConfig, config, "export")
  cfg, record = _recorded_model(config)
  choose(config.export.family, cfg).check(cfg)
  ignored = (workdir_lock.LOCK_NAME, _PARTIAL)
  taken = [n for n in os.listdir(workdir) if n not in ignored] if workdir else []
  if workdir and os.path.isdir(workdir) and taken:
    raise cc.ConfigError(
      f"--workdir {workdir} is not empty (it holds {sorted(taken)[0]}); export into a new "
      "directory."
    )
  return cfg, record


def validate(config) -> None:
  """Every field and the recorded model; reads no weight."""
  cc.choice(config, "program", ("export",))
  schema.validate(ExportConfig, config, "export")
  cfg = _recorded_model(config)[0]
  choose(config.export.family, cfg).check(cfg)


def _cast(tensors: dict, name: str, family) -> dict:
  """The tensors in export.dtype `name` (a looped export keeps looped's float32-only params)."""
  dtype = _DTYPES[name]
  keep = getattr(family, "FLOAT32", ())
  return {
    k: x if x.dtype == dtype or k.endswith(keep) else x.astype(dtype) for k, x in tensors.items()
  }


def _save_safetensors(directory: str, tensors: dict, max_bytes: int, shards: bool) -> None:
  """model.safetensors, or (shards, past max_bytes) model-0000i-of-0000n.safetensors and the
  index transformers reads, tensors packed in name order."""
  total = sum(x.nbytes for x in tensors.values())
  if not shards or total <= max_bytes:
    save_file(tensors, os.path.join(directory, hf_folder.SINGLE), metadata={"format": "pt"})
    return
  groups, size = [[]], 0
  for name in sorted(tensors):
    if groups[-1] and size + tensors[name].nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += tensors[name].nbytes
  weight_map = {}
  for i, names in enumerate(groups):
    shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
    part = {n: tensors[n] for n in names}
    save_file(part, os.path.join(directory, shard), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(names, shard))
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  with open(os.path.join(directory, hf_folder.INDEX), "w") as f:
    json.dump(index, f, indent=2, sort_keys=True)
    f.write("\n")


def _config_json(hf: dict, family, ids: dict, dtype: str) -> dict:
  """config.json: the family's fields, the token ids and the weights' dtype. Parcae's
  config.json is a ParcaeConfig (its loaders refuse other keys): the ids go into its free-form
  `hf_config`, and it names no dtype (its loaders cast)."""
  out = dict(hf)
  if family is parcae_export:
    out["hf_config"] = {**out.get("hf_config", {}), **ids}
  else:
    out.update(ids)
    out["torch_dtype"] = dtype
  return out


def run(config, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  cfg, record = _check(config, workdir)
  params = restore.restore_params(
    LoopedLM(cfg), config.export.checkpoint, config.export.step, "export.checkpoint"
  )
  family = choose(config.export.family, cfg, params)
  hf = family.check(cfg)
  family.check_params(params, cfg)
  dtype = config.export.dtype if config.export.dtype != "checkpoint" else cfg.param_dtype
  tensors = _cast(family.to_tensors(params, cfg, hf), dtype, family)
  partial = os.path.join(workdir, _PARTIAL)
  shutil.rmtree(partial, ignore_errors=True)  # A crashed export's leftovers.
  os.makedirs(partial)
  shards = getattr(family, "SHARDS", family is not parcae_export)
  _save_safetensors(partial, tensors, config.export.max_shard_bytes, shards)
  if config.export.torch_bin and getattr(family, "TORCH_BIN", True):
    torch_save.save(os.path.join(partial, hf_folder.TORCH_BIN), tensors)
  tokenizer = tokenizer_files.write(partial, record["data"], cfg.max_seq_len)
  for name in getattr(family, "MODELING_FILES", ()):
    shutil.copyfile(os.path.join(family.HERE, name), os.path.join(partial, name))
  hf = _config_json(hf, family, tokenizer_files.token_ids(record["data"]), dtype)
  with open(os.path.join(partial, hf_folder.CONFIG), "w") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
    f.write("\n")
  names = sorted(os.listdir(partial), key=lambda n: n == hf_folder.CONFIG)  # config.json last.
  for name in names:
    os.chmod(os.path.join(partial, name), _MODE)
  for name in names:
    os.replace(os.path.join(partial, name), os.path.join(workdir, name))
  os.rmdir(partial)
  # The workdir's lock (programs.run holds it) is no file of the export: gone before returning.
  lock = os.path.join(workdir, workdir_lock.LOCK_NAME)
  if os.path.isfile(lock):
    os.remove(lock)
  if not tokenizer:
    logging.warning("export: the checkpoint records no tokenizer files to write; none written.")
  logging.info(
    "export: %s (%d tensors, %s) -> %s (%s: %s)",
    config.export.checkpoint,
    len(tensors),
    dtype,
    workdir,
    family.FAMILY,
    ", ".join(names),
  )
  return {"folder": workdir, "files": names, "num_tensors": len(tensors), "family": family.FAMILY}
