"""The convert section: every field of `config.convert` declared once, with its default, doc
and range (looped.schema derives configs/convert.py's ConfigDict, the range checks and help;
looped/convert/program.py checks the folder)."""

from __future__ import annotations

import dataclasses

from looped.schema import field


@dataclasses.dataclass(frozen=True)
class ConvertConfig:
  """`config.convert`: the Hugging Face folder and what the converted model records."""

  source: str = field(
    "", "Hugging Face folder: config.json, *.safetensors, tokenizer.json.", nonempty=True
  )
  num_recurrences: int = field(
    0, "R recorded for the model (0: the family's default depth).", min=0
  )
  max_seq_len: int = field(0, "Longest sequence recorded for the model (0: config.json's).", min=0)


# Families export writes (looped/convert/export.py); 'auto': the public family model.injection
# names when it expresses the model, else 'looped' (this project's own modeling code).
EXPORT_FAMILIES = ("parcae", "huginn", "ouro", "looped", "auto")
# export.dtype: the written weights' dtype ('checkpoint': the model's param_dtype).
EXPORT_DTYPES = ("checkpoint", "float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """`config.export`: the looped checkpoint and the family whose folder layout it is written in."""

  checkpoint: str = field(
    "", "Trainer workdir, pipeline stage dir or converted model (checkpoints/).", nonempty=True
  )
  step: int = field(-1, "Checkpoint step to export (-1: the latest).", min=-1)
  family: str = field(
    "parcae",
    "Folder layout written, read by that family's public code ('looped': by transformers with "
    "this project's modeling code; 'auto': model.injection's family, diagonal -> parcae, "
    "linear -> huginn, none -> ouro, if it expresses the model, else looped).",
    choices=EXPORT_FAMILIES,
  )
  torch_bin: bool = field(
    True,
    "Parcae, Huginn, Ouro: also write pytorch_model.bin (what Parcae's from_pretrained reads) "
    "beside safetensors.",
  )
  dtype: str = field(
    "checkpoint",
    "Dtype of the written weights ('checkpoint': the model's param_dtype; looped keeps its "
    "float32-only params float32).",
    choices=EXPORT_DTYPES,
  )
  max_shard_bytes: int = field(
    5_000_000_000,
    "looped, Huginn, Ouro: weights past this many bytes go into model-0000i-of-0000n.safetensors "
    "shards listed by model.safetensors.index.json (Parcae's loaders read one file).",
    min=1,
  )
