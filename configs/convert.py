"""Convert: import a looped checkpoint in the Hugging Face layout (Huginn-0125, Ouro, Parcae, or a
looped-family export) as a LoopedLM checkpoint directory (docs/convert.md).

  python -m looped.main --config=configs/convert.py --workdir=/tmp/huginn \
      --config.convert.source=/path/to/huginn-0125
  python -m looped.main --config=configs/generate.py --workdir=/tmp/gen \
      --config.gen.checkpoint=/tmp/huginn --config.gen.prompts='The capital of France is'

The source folder holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json) and tokenizer.json. The workdir gets model_config.json (the
model and tokenizer, read by every program that takes the checkpoint), tokenizer.json and
checkpoints/0.
"""

import ml_collections

from looped import schema
from looped.convert.config import ConvertConfig


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.program = "convert"  # Which program main runs.
  c.convert = schema.defaults(ConvertConfig)  # looped/convert/config.py: every field, doc, range.
  return c
