"""validate(config): every config.data field, checked before any compute: the ranges its
schema declares (looped/data/config.py), then the rules relating fields, files and devices.

Cheap by design: it lists files (a glob, the stdlib tree) and opens a SentencePiece model, but
reads no corpus. Problems only the data can reveal (an empty corpus, a validation split too small
for one eval batch) raise from the pipeline, which the trainer builds before compiling.
"""

from __future__ import annotations

import os

import jax

from looped import config_checks as cc
from looped import schema
from looped.data import sources, tokenizers
from looped.data.config import DataConfig


def validate(config) -> None:
  """Raises ConfigError naming the field and the allowed values for any bad config.data value."""
  schema.validate(DataConfig, config, "data")
  data = config.data
  source, tokenizer = data.source, data.tokenizer
  for field in ("tfds_train_split", "tfds_eval_split", "tfds_text_key"):
    cc.string(config, f"data.{field}", allow_empty=source != "tfds")
  if data.val_fraction >= 1:
    cc.fail("data.val_fraction", data.val_fraction, "must be < 1 (the rest is the train split)")
  max_seq_len = config.model.max_seq_len
  if data.seq_len > max_seq_len:
    cc.fail("data.seq_len", data.seq_len, f"must be <= config.model.max_seq_len = {max_seq_len}")
  for field in ("batch_size", "eval_batch_size"):
    cc.divides(config, f"data.{field}", jax.process_count(), "jax.process_count()")
    # Each batch is split over every device of the data mesh, not only over processes.
    cc.divides(config, f"data.{field}", jax.device_count(), "jax.device_count()")

  if source == "text":
    cc.string(config, "data.text_glob")
    sources.text_documents(data.text_glob)  # Raises naming the glob when it matches nothing.
  if source == "tfds":
    cc.string(config, "data.tfds_name")
    _check_tfds(data)
  if tokenizer == "sentencepiece" and not os.path.isfile(cc.string(config, "data.spm_path")):
    cc.fail("data.spm_path", data.spm_path, "must name an existing SentencePiece model file")
  if tokenizer == "huggingface" and not os.path.isfile(cc.string(config, "data.tokenizer_json")):
    cc.fail("data.tokenizer_json", data.tokenizer_json, "must name an existing tokenizer.json")

  vocab = cc.integer(config, "model.vocab_size", min_value=1)
  needed = tokenizers.get(data).vocab_size
  if vocab < needed:
    cc.fail("model.vocab_size", vocab, f"must be >= the {tokenizer} tokenizer's {needed} ids")


def tokenizer_vocab_size(data_cfg) -> int:
  """Ids the tokenizer emits, EOS included (bytes: 256 byte values + EOS id 256 = 257)."""
  return tokenizers.get(data_cfg).vocab_size


def _check_tfds(data) -> None:
  """The dataset and both splits must be prepared (nothing is created or downloaded)."""
  for split in sources.SPLITS:
    try:
      sources.tfds_documents(data, split)
    except Exception as e:  # noqa: BLE001  TFDS raises many types for a missing dataset.
      name = data.tfds_train_split if split == "train" else data.tfds_eval_split
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise cc.ConfigError(
        f"config.data.tfds_name = {data.tfds_name!r} is invalid: split {name!r} cannot be "
        f"read from data_dir {data.tfds_data_dir or '(TFDS default)'!r} ({reason[:200]})."
      ) from None
