"""Generation: sample text from a trained looped model on the paged engine (docs/engine.md;
docs/design.md §5).

  python -m looped.main --config=configs/generate.py --workdir=/tmp/gen \
      --config.gen.checkpoint=/tmp/benice/benice --config.gen.prompts='def main('
  python -m looped.main --config=configs/generate.py --workdir=/tmp/gen \
      --config.gen.checkpoint=/tmp/smoke --config.gen.prompts=prompts.jsonl \
      --config.gen.share_kv=False

Args: `smoke` (the model of configs/pretrain.py:smoke, for its trainer workdirs; short outputs).

A pipeline stage directory (WORKDIR/pretrain, finetune, benice) records its model and tokenizer
in stage_config.json, which then override `model` and `data` here; a plain trainer workdir has
no record, so `model` and `data` must describe the model it trained.
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
  c.model = pretrain.model_config()  # The trained model (ignored for a stage dir: its record).
  c.data = ml_collections.ConfigDict()
  c.data.tokenizer = "bytes"  # 'bytes' or 'sentencepiece' (ignored for a stage dir).
  c.data.spm_path = ""  # SentencePiece model file for tokenizer='sentencepiece'.

  c.gen = ml_collections.ConfigDict()
  c.gen.checkpoint = ""  # Trainer workdir or BeNice! pipeline stage dir holding checkpoints/.
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
