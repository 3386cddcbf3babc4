"""Tokenizers: text -> int token ids, each document followed by one EOS id.

The tokenizers are small picklable objects (a SentencePiece model or a Hugging Face
`tokenizer.json` is loaded lazily from its path) so that Grain worker processes can receive them.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import sentencepiece

from looped import config_checks

BYTES_EOS = 256  # The bytes tokenizer's EOS id: one past the 256 byte values.


class BytesTokenizer:
  """UTF-8 bytes as ids 0..255; EOS = 256. Vocabulary size 257."""

  vocab_size = 257
  eos_id = BYTES_EOS

  def encode(self, text: str) -> np.ndarray:
    """Returns the UTF-8 bytes of `text` as uint16 ids (no EOS)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.uint16)

  def decode(self, ids) -> str:
    """Inverse of encode; EOS ids are dropped, invalid UTF-8 is replaced."""
    ids = np.asarray(ids)
    return ids[ids != BYTES_EOS].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

  def num_bytes(self, ids, previous: int | None = None) -> int:
    """UTF-8 bytes of text the ids stand for: one per byte id, zero per EOS."""
    del previous  # Byte ids carry no document-start marker.
    return int(np.count_nonzero(np.asarray(ids) != BYTES_EOS))


class SentencePieceTokenizer:
  """A SentencePiece model file; EOS = the model's eos id, or one past its vocabulary if none."""

  def __init__(self, path: str):
    self.path = path
    self._processor = None

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])

  @property
  def processor(self) -> sentencepiece.SentencePieceProcessor:
    if self._processor is None:
      self._processor = sentencepiece.SentencePieceProcessor(model_file=self.path)
    return self._processor

  @property
  def eos_id(self) -> int:
    eos = self.processor.eos_id()
    return eos if eos >= 0 else self.processor.get_piece_size()

  @property
  def vocab_size(self) -> int:
    return max(self.processor.get_piece_size(), self.eos_id + 1)

  def encode(self, text: str) -> np.ndarray:
    dtype = np.uint16 if self.vocab_size <= 2**16 else np.int32
    return np.asarray(self.processor.encode(text), dtype=dtype)

  def decode(self, ids) -> str:
    """Inverse of encode; EOS ids are dropped."""
    ids = np.asarray(ids)
    return self.processor.decode(ids[ids != self.eos_id].tolist())

  def num_bytes(self, ids, previous: int | None = None) -> int:
    """UTF-8 bytes of the (normalised) text the ids spell; `previous` is the id before ids[0].

    Counts each piece's bytes ('▁' is a space, byte-fallback pieces 1, control and unknown
    pieces 0), minus the dummy-prefix space the model puts before the first piece of a document
    (a piece right after EOS). Exact for identity normalisation and no unknown pieces.
    """
    ids = np.asarray(ids).reshape(-1)
    total = int(self._piece_bytes[ids].sum())
    if self._dummy_prefix and ids.size:
      follows_eos = np.concatenate([[previous == self.eos_id], ids[:-1] == self.eos_id])
      total -= int(np.count_nonzero(follows_eos & self._starts_with_space[ids]))
    return total

  @functools.cached_property
  def _piece_bytes(self) -> np.ndarray:
    sp = self.processor
    lengths = np.zeros(self.vocab_size, np.int64)
    for i in range(sp.get_piece_size()):
      if sp.is_byte(i):
        lengths[i] = 1
      elif not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i)):
        lengths[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return lengths

  @functools.cached_property
  def _starts_with_space(self) -> np.ndarray:
    sp = self.processor
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    starts = [p.startswith("\u2581") and self._piece_bytes[i] > 0 for i, p in enumerate(pieces)]
    return np.array(starts + [False] * (self.vocab_size - len(pieces)))

  @functools.cached_property
  def _dummy_prefix(self) -> bool:
    """Whether the model prepends '▁' to every input (SentencePiece's add_dummy_prefix)."""
    return self.processor.encode("a", out_type=str)[0].startswith("\u2581")


class HuggingFaceTokenizer:
  """A Hugging Face `tokenizer.json` (the `tokenizers` package): what an imported checkpoint
  brings (looped/convert). EOS: the `eos_token` of a `tokenizer_config.json` beside it, if the
  vocabulary has it; else the first of _EOS_NAMES the vocabulary has (the end-of-text tokens
  of the supported families first); else one past the vocabulary."""

  CONFIG = "tokenizer_config.json"  # Beside tokenizer.json; its `eos_token` names the EOS.
  _EOS_NAMES = (
    "<|end_text|>",  # Huginn-0125's.
    "<|end_of_text|>",
    "<|endoftext|>",  # Ouro's.
    "</s>",
    "<|im_end|>",
    "<|end_turn|>",
  )

  def __init__(self, path: str):
    self.path = path
    self._tokenizer = None

  def __getstate__(self):
    return {"path": self.path}

  def __setstate__(self, state):
    self.__init__(state["path"])

  @property
  def tokenizer(self):
    if self._tokenizer is None:
      import tokenizers as hf_tokenizers  # Lazy: only imported models need it.

      self._tokenizer = hf_tokenizers.Tokenizer.from_file(self.path)
    return self._tokenizer

  def _configured_eos(self) -> tuple[str, ...]:
    """The eos_token of tokenizer_config.json beside the tokenizer (a string, or a dict with
    'content' as older files write it); () if there is none."""
    path = os.path.join(os.path.dirname(os.path.abspath(self.path)), self.CONFIG)
    try:
      with open(path) as f:
        eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
      return ()
    if isinstance(eos, dict):
      eos = eos.get("content")
    return (eos,) if isinstance(eos, str) and eos else ()

  @functools.cached_property
  def eos_id(self) -> int:
    for name in self._configured_eos() + self._EOS_NAMES:
      token_id = self.tokenizer.token_to_id(name)
      if token_id is not None:
        return int(token_id)
    return self.tokenizer.get_vocab_size(with_added_tokens=True)

  @property
  def vocab_size(self) -> int:
    return max(self.tokenizer.get_vocab_size(with_added_tokens=True), self.eos_id + 1)

  def encode(self, text: str) -> np.ndarray:
    """Ids of `text` without special tokens (no BOS/EOS added)."""
    dtype = np.uint16 if self.vocab_size <= 2**16 else np.int32
    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=dtype)

  def decode(self, ids) -> str:
    """Inverse of encode; EOS ids are dropped."""
    ids = np.asarray(ids).reshape(-1)
    return self.tokenizer.decode(ids[ids != self.eos_id].tolist(), skip_special_tokens=False)

  def num_bytes(self, ids, previous: int | None = None) -> int:
    """UTF-8 bytes of the text the ids decode to (EOS ids spell none)."""
    del previous
    return len(self.decode(ids).encode("utf-8"))


Tokenizer = BytesTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer


@functools.lru_cache(maxsize=8)
def _spm(path: str) -> SentencePieceTokenizer:
  return SentencePieceTokenizer(path)


@functools.lru_cache(maxsize=8)
def _hf(path: str) -> HuggingFaceTokenizer:
  return HuggingFaceTokenizer(path)


def get(data_cfg) -> Tokenizer:
  """Returns the tokenizer that config.data names (ConfigError for a bad kind or missing file)."""
  kind = data_cfg.tokenizer
  if kind == "bytes":
    return BytesTokenizer()
  if kind == "sentencepiece":
    path = data_cfg.spm_path
    if not path or not os.path.isfile(path):
      config_checks.fail("data.spm_path", path, "must name an existing SentencePiece model file")
    return _spm(path)
  if kind == "huggingface":
    path = data_cfg.get("tokenizer_json", "")
    if not path or not os.path.isfile(path):
      config_checks.fail(
        "data.tokenizer_json", path, "must name an existing Hugging Face tokenizer.json file"
      )
    return _hf(path)
  config_checks.fail(
    "data.tokenizer", kind, "must be one of 'bytes', 'sentencepiece', 'huggingface'"
  )


def encode_document(tokenizer: Tokenizer, text: str) -> np.ndarray:
  """Token ids of one document followed by EOS."""
  ids = tokenizer.encode(text)
  return np.append(ids, np.asarray(tokenizer.eos_id, ids.dtype))
