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


# Families export writes (looped/convert/export.py); 'auto': the one model.injection names.
EXPORT_FAMILIES = ("parcae", "huginn", "ouro", "auto")


@dataclasses.dataclass(frozen=True)
class ExportConfig:
  """`config.export`: the looped checkpoint and the family whose folder layout it is written in."""

  checkpoint: str = field(
    "", "Trainer workdir, pipeline stage dir or converted model (checkpoints/).", nonempty=True
  )
  step: int = field(-1, "Checkpoint step to export (-1: the latest).", min=-1)
  family: str = field(
    "parcae",
    "Folder layout written, read by that family's public code ('auto': by model.injection, "
    "diagonal -> parcae, linear -> huginn, none -> ouro).",
    choices=EXPORT_FAMILIES,
  )
  torch_bin: bool = field(
    True, "Also write pytorch_model.bin (what Parcae's from_pretrained reads) beside safetensors."
  )
