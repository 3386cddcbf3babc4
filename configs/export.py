"""Export: write a looped checkpoint (trained or converted) as a folder in the Hugging Face
layout of the Parcae, Huginn, Ouro or looped family (export.family), the inverse of convert
(docs/convert.md, Export).

  python -m looped.main --config=configs/export.py --workdir=/tmp/parcae_out \
      --config.export.checkpoint=/tmp/smoke --config.export.family=parcae
  python -m looped.main --config=configs/export.py --workdir=/tmp/benice_hf \
      --config.export.checkpoint=/tmp/benice/benice --config.export.family=auto

The workdir gets config.json (`_class_name: ParcaeConfig`, or `architectures:
[RavenForCausalLM]` / `[OuroForCausalLM]` / `[LoopedForCausalLM]`, with the tokenizer's
bos/eos/pad ids), model.safetensors (sharded past export.max_shard_bytes, in export.dtype),
pytorch_model.bin (what Parcae's from_pretrained reads; export.torch_bin=False skips it; not for
looped), the checkpoint's tokenizer files, and for looped the modeling code transformers runs
(`AutoModelForCausalLM.from_pretrained(W, trust_remote_code=True)`). 'auto' writes the public
family model.injection names when it expresses the model, else looped.
"""

import ml_collections

from looped import schema
from looped.convert.config import ExportConfig


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.program = "export"  # Which program main runs.
  c.export = schema.defaults(ExportConfig)  # looped/convert/config.py: every field, doc, range.
  return c
