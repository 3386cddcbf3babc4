"""Generation: sample text from a trained looped model on the paged engine (docs/engine.md;
docs/design.md §5).

  python -m looped.main --config=configs/generate.py --workdir=/tmp/gen \
      --config.gen.checkpoint=/tmp/benice/benice --config.gen.prompts='def main('
  python -m looped.main --config=configs/generate.py --workdir=/tmp/gen \
      --config.gen.checkpoint=/tmp/smoke --config.gen.prompts=prompts.jsonl \
      --config.gen.share_kv=False

Args: `smoke` (the model of configs/pretrain.py:smoke, for its trainer workdirs; short outputs).

A checkpoint directory records its model and tokenizer (model_config.json beside the
checkpoints of a trainer workdir or a converted model, stage_config.json in a pipeline stage
dir); they are used whatever `model` and `data` say here, and a `--config.model.*` flag that
disagrees with the record fails naming the field, except `--config.model.num_recurrences`: the
loop count to run the recorded model at (docs/convert.md). Only a workdir written before
records existed needs `model` and `data` to describe it (`:smoke` for configs/pretrain.py:smoke).
"""

import ml_collections

import configs
from configs import pretrain
from looped import schema
from looped.data.config import TOKENIZER_FIELDS, DataConfig
from looped.engine.config import GenConfig

VARIANTS = {
  "smoke": "the model of configs/pretrain.py:smoke (its trainer workdirs), 16 new tokens",
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)

  c = ml_collections.ConfigDict()
  c.program = "generate"  # Which program main runs.
  # Sections: every field, default, doc and range in its schema (see `--help`).
  c.model = pretrain.model_config()  # The model, if the checkpoint records none (old workdirs).
  # The tokenizer's fields of looped/data/config.py (DataConfig) (recorded: ignored).
  c.data = schema.defaults(DataConfig, only=TOKENIZER_FIELDS)
  c.gen = schema.defaults(GenConfig)  # looped/engine/config.py (GenConfig).
  # The engine's devices (looped/engine/mesh.py): params split by mesh_rules, the page pool over
  # KV heads; 1 x 1 x 1 is one device, --config.mesh.tensor=8 splits heads over 8.
  c.mesh = pretrain.mesh_config()  # looped/sharding.py (MeshConfig).
  c.mesh.data = 1  # No -1: the engine takes the first data x fsdp x tensor devices.
  c.mesh_rules = pretrain.mesh_rules()  # Logical -> mesh axes, as training places params.

  if "smoke" in args:
    pretrain.smoke_model(c.model)
    c.gen.max_new_tokens = 16  # Short outputs.
    c.gen.kv_budget_bytes = 4e6  # Room for the smoke model's pages.
  return c
