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
