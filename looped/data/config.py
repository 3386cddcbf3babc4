"""The data section: every field of `config.data` declared once, with its default, doc and
range (looped.schema derives the config files' ConfigDict, the range checks and help)."""

from __future__ import annotations

import dataclasses

from looped.schema import field

SOURCES = ("stdlib", "text", "tfds")
TOKENIZERS = ("bytes", "sentencepiece", "huggingface")
# The fields a tokenizer is built from (generation and the server read only these).
TOKENIZER_FIELDS = ("tokenizer", "spm_path", "tokenizer_json")
_TFDS = "non-empty string when source='tfds'"


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """`config.data`: the corpus, its tokenizer and the batches (looped/data/checks.py checks the
  rules relating fields, files and devices)."""

  source: str = field(
    "stdlib",
    "'stdlib' (interpreter's own .py sources), 'text' (glob) or 'tfds'.",
    choices=SOURCES,
  )
  text_glob: str = field("", "Files for source='text', e.g. '/data/*.txt'.")
  tfds_name: str = field("", "TFDS dataset for source='tfds', prepared as array_record.")
  tfds_data_dir: str = field("", "TFDS data_dir ('' = TFDS default).")
  tfds_train_split: str = field("train", "TFDS split for training.", by_hand=_TFDS)
  tfds_eval_split: str = field("validation", "TFDS split for evaluation.", by_hand=_TFDS)
  tfds_text_key: str = field("text", "Feature holding the document text.", by_hand=_TFDS)
  tokenizer: str = field(
    "bytes", "'bytes' (UTF-8 bytes + EOS), 'sentencepiece' or 'huggingface'.", choices=TOKENIZERS
  )
  spm_path: str = field("", "SentencePiece model file for tokenizer='sentencepiece'.")
  tokenizer_json: str = field("", "Hugging Face tokenizer.json for tokenizer='huggingface'.")
  val_fraction: float = field(
    0.05,
    "Fraction of documents (files) held out for validation; < 1 (the rest is the train split).",
    gt=0.0,
  )
  segment_bytes: int = field(
    4096, "Files longer than this are split train/val in segments (0: whole).", min=0
  )
  max_documents: int = field(
    0, "Use only the first N documents after the split hash (0 = all).", min=0
  )
  seq_len: int = field(128, "Tokens per training row; <= model.max_seq_len.", min=1)
  batch_size: int = field(
    16, "Global batch size (rows per step, split across processes and devices).", min=1
  )
  eval_batch_size: int = field(16, "Global batch size for validation.", min=1)
  num_eval_batches: int = field(
    8, "Validation batches per evaluation (fixed, deterministic set).", min=1
  )
  shuffle: bool = field(True, "Shuffle training rows (seeded by config.seed).")
  document_mask: bool = field(
    True, "Tokens attend only within their own document of a packed row (segment ids)."
  )
  worker_count: int = field(0, "Grain worker processes (0 = in the main process).", min=0)
