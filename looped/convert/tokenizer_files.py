"""The tokenizer files an export folder carries, and the token ids its config.json names.

A Hugging Face tokenizer (data.tokenizer='huggingface') leaves as it came: its tokenizer.json
and the tokenizer_config.json, special_tokens_map.json and chat_template.jinja beside it. The
bytes tokenizer (data.tokenizer='bytes', the default) leaves as a tokenizer.json that
transformers reads with the same ids: byte-level symbols with no merges, byte b at id b, and
`<|end_of_text|>` at id 256 (the EOS), with a tokenizer_config.json naming it. A SentencePiece
model is not converted (its ids are still named).

Ids: EOS is the tokenizer's EOS as looped reads it (looped.data.tokenizers); BOS and PAD are the
ones tokenizer_config.json (SentencePiece: the model) names, else the EOS, which precedes every
document in looped's data (each document ends with one EOS).
"""

from __future__ import annotations

import json
import os
import shutil

from looped.convert.hf_folder import CHAT_TEMPLATE, SPECIAL_TOKENS_MAP, TOKENIZER, TOKENIZER_CONFIG
from looped.data import tokenizers

BYTES_EOS = "<|end_of_text|>"


def _byte_symbols() -> list[str]:
  """The byte-level alphabet, in byte order: byte b as the character byte-level
  pre-tokenizers map it to (printable Latin-1 as itself, the others from U+0100 on)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  symbols, extra = [], 0
  for b in range(256):
    if b in printable:
      symbols.append(chr(b))
    else:
      symbols.append(chr(256 + extra))
      extra += 1
  return symbols


def write_bytes_tokenizer(directory: str, max_seq_len: int) -> list[str]:
  """tokenizer.json and tokenizer_config.json of looped's bytes tokenizer (ids 0..255, EOS
  256); the names written."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers

  vocab = {s: i for i, s in enumerate(_byte_symbols())}
  vocab[BYTES_EOS] = tokenizers.BYTES_EOS
  tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([BYTES_EOS])
  tok.save(os.path.join(directory, TOKENIZER))
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BYTES_EOS,
    "eos_token": BYTES_EOS,
    "pad_token": BYTES_EOS,
    "model_max_length": max_seq_len,
    "clean_up_tokenization_spaces": False,
  }
  with open(os.path.join(directory, TOKENIZER_CONFIG), "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
  return [TOKENIZER, TOKENIZER_CONFIG]


def _named(config_path: str, key: str) -> str | None:
  """The token tokenizer_config.json names under `key` (a string, or {'content': ...})."""
  try:
    with open(config_path) as f:
      value = json.load(f).get(key)
  except (OSError, ValueError, AttributeError):
    return None
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def token_ids(data: dict) -> dict[str, int]:
  """{'bos_token_id', 'eos_token_id', 'pad_token_id'} of the record's tokenizer."""
  kind = data.get("tokenizer") or "bytes"
  if kind == "huggingface" and data.get("tokenizer_json"):
    tok = tokenizers.HuggingFaceTokenizer(data["tokenizer_json"])
    eos = tok.eos_id
    beside = os.path.join(os.path.dirname(data["tokenizer_json"]), TOKENIZER_CONFIG)
    ids = {}
    for key in ("bos", "pad"):
      name = _named(beside, f"{key}_token")
      found = tok.tokenizer.token_to_id(name) if name else None
      ids[key] = eos if found is None else int(found)
    return {"bos_token_id": ids["bos"], "eos_token_id": eos, "pad_token_id": ids["pad"]}
  if kind == "spm" and data.get("spm_path"):
    tok = tokenizers.SentencePieceTokenizer(data["spm_path"])
    eos = tok.eos_id
    bos, pad = tok.processor.bos_id(), tok.processor.pad_id()
    return {
      "bos_token_id": bos if bos >= 0 else eos,
      "eos_token_id": eos,
      "pad_token_id": pad if pad >= 0 else eos,
    }
  eos = tokenizers.BYTES_EOS
  return {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}


def write(directory: str, data: dict, max_seq_len: int) -> list[str]:
  """The record's tokenizer files written into `directory` (copied, or the bytes tokenizer's);
  the names written ([] for a SentencePiece model)."""
  kind = data.get("tokenizer") or "bytes"
  if kind == "huggingface" and data.get("tokenizer_json"):
    path = data["tokenizer_json"]
    names = []
    for name in (TOKENIZER, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE):
      source = path if name == TOKENIZER else os.path.join(os.path.dirname(path), name)
      if os.path.isfile(source):
        shutil.copyfile(source, os.path.join(directory, name))
        names.append(name)
    return names
  if kind == "bytes":
    return write_bytes_tokenizer(directory, max_seq_len)
  return []
