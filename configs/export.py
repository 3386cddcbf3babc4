"""Export: write a looped checkpoint (trained or converted) as a folder in the Hugging Face
layout of the Parcae, Huginn or Ouro family (export.family), the inverse of convert
(docs/convert.md, Export).

  python -m looped.main --config=configs/export.py --workdir=/tmp/parcae_out \
      --config.export.checkpoint=/tmp/smoke --config.export.family=parcae

The workdir gets config.json (`_class_name: ParcaeConfig`, or `architectures:
[RavenForCausalLM]` / `[OuroForCausalLM]`), model.safetensors, pytorch_model.bin (what
Parcae's from_pretrained reads; export.torch_bin=False skips it) and
the checkpoint's tokenizer.json (with tokenizer_config.json) when its record names one.
"""

import ml_collections

from looped import schema
from looped.convert.config import ExportConfig


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.program = "export"  # Which program main runs.
  c.export = schema.defaults(ExportConfig)  # looped/convert/config.py: every field, doc, range.
  return c
