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

VARIANTS = {
  "smoke": "the model of configs/pretrain.py:smoke (its trainer workdirs), 16 new tokens",
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)

  c = ml_collections.ConfigDict()
  c.program = "generate"  # Which program main runs.
  c.model = pretrain.model_config()  # The model, if the checkpoint records none (old workdirs).
  c.data = ml_collections.ConfigDict()
  c.data.tokenizer = "bytes"  # 'bytes', 'sentencepiece' or 'huggingface' (recorded: ignored).
  c.data.spm_path = ""  # SentencePiece model file for tokenizer='sentencepiece'.
  c.data.tokenizer_json = ""  # Hugging Face tokenizer.json for tokenizer='huggingface'.

  c.gen = ml_collections.ConfigDict()
  c.gen.checkpoint = ""  # Trainer workdir, pipeline stage dir or converted model (checkpoints/).
  c.gen.step = -1  # Checkpoint step to load (-1: the latest).
  c.gen.prompts = ""  # One prompt, a tuple of prompts, or a file: .jsonl ({"prompt": ...} per
  # line) or text (one prompt per line; '\n' in a line stands for a newline).
  c.gen.share_kv = True  # KV-sharing: cache only the final recurrence's K/V of core layers.
  c.gen.kv_format = ""  # Page storage: '' (raw, compute dtype), 'bf16', 'fp8', 'mxfp8',
  # 'mxfp8_rceil', 'nvfp4'.
  c.gen.kv_budget_bytes = 64e6  # KV page pool in bytes (None: room for every prompt at once).
  c.gen.page_size = 16  # Tokens per KV page (prefix-cache granularity).
  c.gen.max_num_batched_tokens = 64  # Per-step token budget (decodes + prefill chunks).
  c.gen.max_num_seqs = 8  # Cap on requests running at once.
  c.gen.max_new_tokens = 64  # Tokens generated per prompt at most.
  c.gen.temperature = 0.0  # 0: greedy; > 0: sample from softmax(logits / temperature).
  c.gen.top_k = 0  # Sample among the k most likely tokens (0: all).
  c.gen.top_p = 1.0  # Nucleus sampling mass in (0, 1] (1: off).
  c.gen.seed = 0  # Sampler seed; prompt i uses seed + i.
  c.gen.stop_strings = ()  # Generated text containing one of these ends the prompt's output.
  c.gen.stop_at_eos = True  # The tokenizer's EOS ends a prompt's output.
  c.gen.stream = True  # With a single prompt, print its text as it is generated.

  if "smoke" in args:
    pretrain.smoke_model(c.model)
    c.gen.max_new_tokens = 16
    c.gen.kv_budget_bytes = 4e6
  return c
