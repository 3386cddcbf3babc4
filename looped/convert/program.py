"""Program 'convert': a looped checkpoint in the Hugging Face layout -> a LoopedLM checkpoint.

validate(config) reads config.json, the shard index and every shard's header, and fails in one
line, before any weight is read, on an unknown architecture (naming the supported ones), a
variant the model cannot express, a missing shard or tensor, a tensor whose shape does not
match config.json (naming the tensor and both shapes), or a tokenizer (with its EOS) that needs
more ids than config.json's vocab_size. run(config, workdir) writes WORKDIR/model_config.json
(the model and its tokenizer), WORKDIR/tokenizer.json (with the source's tokenizer_config.json,
which names the EOS, and special_tokens_map.json) and WORKDIR/checkpoints/0 (the params): a
checkpoint directory that generation, the server and the BeNice! pipeline
(`pipeline.pretrain_workdir`) read like a trainer's.
"""

from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from looped import config_checks as cc
from looped import convert, schema
from looped.checkpoints import checkpointing, model_record
from looped.convert import common, hf_folder
from looped.convert.config import ConvertConfig
from looped.data import tokenizers
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM, init_params

# What the converted checkpoint's record says its tokenizer is (relative to the workdir).
_TOKENIZER = {"tokenizer": "huggingface", "spm_path": "", "tokenizer_json": hf_folder.TOKENIZER}


def model_fields(config, folder: hf_folder.HFFolder) -> dict:
  """The converted model's config: the family's mapping of config.json, then the
  convert.num_recurrences / convert.max_seq_len overrides."""
  fields = convert.family(folder.architecture).model_config(folder.config)
  defaults = model_lib.ModelConfig()
  out = {f: getattr(defaults, f) for f in model_lib.ModelConfig.__dataclass_fields__}
  out.update(fields)
  if config.convert.num_recurrences:
    out["num_recurrences"] = config.convert.num_recurrences
  if config.convert.max_seq_len:
    if fields.get("rope_table") and config.convert.max_seq_len > fields["max_seq_len"]:
      cc.fail(
        "convert.max_seq_len",
        config.convert.max_seq_len,
        f"the checkpoint's stored RoPE table holds {fields['max_seq_len']} positions",
      )
    out["max_seq_len"] = config.convert.max_seq_len
  return out


def _fit_rope_tables(params: dict, length: int) -> dict:
  """Stored RoPE tables (model.rope_table) cut to the converted context's first `length` rows."""
  cut = lambda path, x: x[:length] if getattr(path[-1], "key", None) == "rope_table" else x
  return jax.tree_util.tree_map_with_path(cut, params)


def _check(config) -> tuple[hf_folder.HFFolder, dict]:
  schema.validate(ConvertConfig, config, "convert")
  source = config.convert.source
  folder = hf_folder.open_folder(source)
  family = convert.family(folder.architecture)
  fields = model_fields(config, folder)
  model_lib.validate(ml_collections.ConfigDict({"model": fields}))
  expected, optional = family.expected_shapes(folder.config)
  common.check_tensors(hf_folder.tensor_shapes(folder), expected, optional)
  if not folder.tokenizer_json:
    cc.fail("convert.source", source, f"it has no {hf_folder.TOKENIZER}")
  tok = tokenizers.HuggingFaceTokenizer(folder.tokenizer_json)
  if tok.vocab_size > fields["vocab_size"]:
    cc.fail(
      "convert.source",
      source,
      f"its {hf_folder.TOKENIZER} needs {tok.vocab_size} ids (EOS id {tok.eos_id}) but "
      f"the model's vocab_size (from {hf_folder.CONFIG}) is {fields['vocab_size']}",
    )
  return folder, fields


def validate(config) -> None:
  """Every field, the folder, its architecture and every tensor's shape; reads no weight."""
  cc.choice(config, "program", ("convert",))
  _check(config)


def _check_tree(params, abstract) -> None:
  """The mapped params have exactly the model's names and shapes (a mapping bug fails here)."""
  got = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(params)}
  want = {
    jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(abstract)
  }
  for key in sorted(got.keys() | want.keys()):
    if got.get(key) != want.get(key):
      raise ValueError(f"converted params{key}: {got.get(key)} but the model has {want.get(key)}")


def run(config, workdir: str) -> dict:
  folder, fields = _check(config)
  if checkpointing.has_any(workdir):
    raise cc.ConfigError(
      f"--workdir {workdir} already holds checkpoints; convert into a new directory."
    )
  family = convert.family(folder.architecture)
  cfg = model_lib.from_config(ml_collections.ConfigDict(fields))
  expected, _ = family.expected_shapes(folder.config)
  tensors = hf_folder.load(folder, sorted(expected))
  params = _fit_rope_tables(family.to_params(tensors, folder.config), cfg.max_seq_len)
  model = LoopedLM(cfg)
  abstract = jax.eval_shape(
    lambda: init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  )
  _check_tree(params, abstract)
  params = jax.tree.map(lambda x, a: np.asarray(x, a.dtype), params, abstract)
  os.makedirs(workdir, exist_ok=True)
  shutil.copyfile(folder.tokenizer_json, os.path.join(workdir, hf_folder.TOKENIZER))
  # tokenizer_config.json names the EOS (HuggingFaceTokenizer); these travel on to an export, and
  # the chat template (a file, or in tokenizer_config.json) is the server's.
  for name in (hf_folder.TOKENIZER_CONFIG, hf_folder.SPECIAL_TOKENS_MAP, hf_folder.CHAT_TEMPLATE):
    if os.path.isfile(os.path.join(folder.path, name)):
      shutil.copyfile(os.path.join(folder.path, name), os.path.join(workdir, name))
  record = {
    "model": model_record.make(ml_collections.ConfigDict(fields), {})["model"],
    "data": dict(_TOKENIZER),
    "written_by": "convert",
    "architecture": folder.architecture,
    "source": os.path.abspath(folder.path),
  }
  model_record.write(workdir, record)  # Before the checkpoint, as the trainer does.
  path = checkpointing.save_params(workdir, 0, params)
  count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
  logging.info(
    "convert: %s (%s, %d params, %d tensors) -> %s",
    folder.path,
    folder.architecture,
    count,
    len(tensors),
    path,
  )
  return {"checkpoint": path, "architecture": folder.architecture, "num_params": count}
