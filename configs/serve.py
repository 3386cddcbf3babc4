"""OpenAI-compatible HTTP server on the generation engine (docs/server.md).

  python -m looped.main --config=configs/serve.py --workdir=/tmp/serve \
      --config.serve.checkpoint=/tmp/benice/benice
  python -m looped.main --config=configs/serve.py:smoke --workdir=/tmp/serve_smoke \
      --config.serve.checkpoint=/tmp/smoke --config.serve.share_kv=False --config.serve.port=8000

Args: `smoke` (the model of configs/pretrain.py:smoke, for its trainer workdirs).

The server listens on serve.host:serve.port (port 0: a free port) and writes the address to
WORKDIR/server.json once it accepts connections. SIGTERM (or Ctrl-C) stops accepting, finishes
the requests in flight and exits. `model` and `data` are read as by configs/generate.py: the
model and tokenizer the checkpoint records are used (only a directory without a record needs
them to describe it).
"""

import ml_collections

import configs
from configs import generate
from looped import schema
from looped.server.config import ServeConfig

VARIANTS = {
  "smoke": "the model of configs/pretrain.py:smoke (its trainer workdirs)",
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)

  c = ml_collections.ConfigDict()
  c.program = "server"  # Which program main runs.
  base = generate.get_config("smoke" if "smoke" in args else "")
  c.model = base.model  # The model, if the checkpoint records none (old workdirs).
  c.data = base.data  # Its tokenizer, likewise: data.tokenizer, spm_path, tokenizer_json.
  c.mesh = base.mesh  # The engine's devices, as configs/generate.py (one by default).
  c.mesh_rules = base.mesh_rules  # Logical -> mesh axes of the params.

  c.serve = schema.defaults(ServeConfig)  # looped/server/config.py: every field, doc, range.
  if "smoke" in args:
    c.serve.kv_budget_bytes = 4e6  # Room for the smoke model's pages.
  return c
