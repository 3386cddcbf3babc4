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

  c.serve = ml_collections.ConfigDict()
  c.serve.checkpoint = ""  # Trainer workdir, pipeline stage dir or converted model (checkpoints/).
  c.serve.step = -1  # Checkpoint step to load (-1: the latest).
  c.serve.model_name = ""  # Name in /v1/models and responses ('': the checkpoint dir's name).
  c.serve.host = "127.0.0.1"  # Address to listen on.
  c.serve.port = 0  # TCP port (0: any free port; the one taken is written to server.json).
  c.serve.share_kv = True  # KV-sharing: cache only the final recurrence's K/V of core layers.
  c.serve.kv_format = ""  # Page storage: '' (raw, compute dtype), 'bf16', 'fp8', 'mxfp8',
  # 'mxfp8_rceil', 'nvfp4'.
  c.serve.kv_budget_bytes = 64e6  # KV page pool in bytes; must hold one max_seq_len request.
  c.serve.page_size = 16  # Tokens per KV page (prefix-cache granularity).
  c.serve.max_num_batched_tokens = 64  # Per-step token budget (decodes + prefill chunks).
  c.serve.max_num_seqs = 8  # Cap on requests running at once.
  c.serve.row_buckets = ()  # Padded batch rows, one compilation each (): powers of two.
  c.serve.token_buckets = ()  # Padded new tokens per row (): powers of two.
  c.serve.column_buckets = ()  # Padded page-table widths (): powers of two.
  c.serve.max_waiting = 256  # Requests queued beyond the running ones; more get HTTP 429.
  c.serve.max_logprobs = 5  # Largest `logprobs` a request may ask for (as OpenAI's API).
  c.serve.drain_timeout_s = 600.0  # After SIGTERM, wait this long for requests in flight.
  c.serve.warmup = True  # Compile every step shape before serving (no request waits for one).
  c.serve.max_body_bytes = 1 << 22  # Request bodies over this many bytes get HTTP 413.
  if "smoke" in args:
    c.serve.kv_budget_bytes = 4e6
  return c
