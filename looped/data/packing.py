"""Packing a token stream into training rows.

Layout (the same for every source): documents are tokenized, each is followed by EOS, and the
results are concatenated into one stream s. Row i is the window s[i*T : i*T + T + 1] (T =
data.seq_len); inputs = row[:-1], targets = row[1:]. Consecutive rows overlap by exactly one
token (row i's last target is row i+1's first input), so every next-token pair (s[t], s[t+1]) of
the stream is a target exactly once and the inputs of rows 0..n-1 followed by the last target of
row n-1 reassemble s[:n*T + 1]. The tail that cannot fill a row is dropped.

Rows ignore document boundaries when they are cut; each example records them instead:
`segment_ids` [B, T] (int32) numbers the documents of a row's inputs from 0, and a token right
after an EOS starts a new segment (the EOS itself ends its document). They are derived from the
inputs' EOS markers when a batch is built (`to_example`), so the iterator state, which counts
tokens, keeps its format. With `data.document_mask` (the default) the model lets a token attend
to, and a KDA layer carry state from, its own segment only; positions stay row positions
0..T-1 (RoPE scores depend on relative positions only, so a document scores the same wherever
it starts in a row). Without it attention crosses from one document into the next and EOS is
the only boundary marker (nanodo / GPT-2 style).
"""

from __future__ import annotations

import collections

import grain
import numpy as np


def num_rows(stream_len: int, seq_len: int) -> int:
  """Rows of seq_len + 1 tokens (stride seq_len) that fit in a stream of stream_len tokens."""
  return max(stream_len - 1, 0) // seq_len


def gather_rows(stream: np.ndarray, row_ids, seq_len: int) -> np.ndarray:
  """int32[len(row_ids), seq_len + 1]: rows row_ids of `stream` (see module docstring)."""
  starts = np.asarray(row_ids, np.int64)[:, None] * seq_len
  return stream[starts + np.arange(seq_len + 1)].astype(np.int32)


def segment_ids(inputs: np.ndarray, eos_id: int) -> np.ndarray:
  """int32[B, T]: each input token's document within its row, from 0; a token right after an
  EOS starts the next one."""
  after_eos = np.zeros(inputs.shape, np.int32)
  after_eos[:, 1:] = inputs[:, :-1] == eos_id
  return np.cumsum(after_eos, axis=1, dtype=np.int32)


def to_example(rows: np.ndarray, eos_id: int | None) -> dict[str, np.ndarray]:
  """Splits packed rows [B, T + 1] into the model's {'inputs', 'targets', 'segment_ids'} (each
  [B, T]; targets = inputs shifted by 1; segment_ids from the inputs' EOS markers, left out
  when eos_id is None: no document masking)."""
  rows = np.asarray(rows, np.int32)
  inputs = rows[:, :-1]
  example = {"inputs": inputs, "targets": rows[:, 1:]}
  if eos_id is not None:
    example["segment_ids"] = segment_ids(inputs, eos_id)
  return example


class ToExample:
  """Picklable `to_example` with the tokenizer's EOS id, for Grain map."""

  def __init__(self, eos_id: int | None):
    self.eos_id = eos_id

  def __call__(self, rows: np.ndarray) -> dict[str, np.ndarray]:
    return to_example(rows, self.eos_id)


class PackedRowsIterDataset(grain.IterDataset):
  """Streams rows (see module docstring) from a parent that yields token arrays, one per document.

  Lazy: holds only the documents that overlap the next row. Checkpointable: its state is the
  parent's state before the oldest document still buffered plus how many of that document's
  tokens were already consumed; restoring re-reads from there.
  """

  def __init__(self, parent: grain.IterDataset, seq_len: int):
    super().__init__(parent)
    self._seq_len = seq_len

  def __iter__(self) -> _PackedRowsIterator:
    return _PackedRowsIterator(self._parent.__iter__(), self._seq_len)

  def __str__(self) -> str:
    return f"PackedRowsIterDataset(seq_len={self._seq_len})"


class _PackedRowsIterator(grain.DatasetIterator):
  """Iterator of PackedRowsIterDataset."""

  def __init__(self, parent: grain.DatasetIterator, seq_len: int):
    super().__init__(parent)
    self._seq_len = seq_len
    self._start_state = parent.get_state()  # Parent state when no document is buffered.
    self._reset(self._start_state, offset=0)

  def _reset(self, parent_state, offset: int) -> None:
    self._chunks = collections.deque()  # (parent state before the document, its tokens)
    self._offset = offset  # Tokens of the first buffered document already consumed.
    self._buffered = -offset  # Unconsumed tokens in the buffer.
    self._start_state = parent_state

  def __next__(self) -> np.ndarray:
    row_len = self._seq_len + 1
    while self._buffered < row_len:
      state = self._parent.get_state()
      tokens = np.asarray(next(self._parent))
      self._chunks.append((state, tokens))
      self._buffered += len(tokens)
    parts, need, start = [], row_len, self._offset
    for _, tokens in self._chunks:
      part = tokens[start : start + need]
      parts.append(part)
      need -= len(part)
      start = 0
      if not need:
        break
    # Consume seq_len tokens: the row's last token stays buffered as the next row's first.
    self._offset += self._seq_len
    self._buffered -= self._seq_len
    while self._offset >= len(self._chunks[0][1]):
      self._offset -= len(self._chunks.popleft()[1])
    return np.concatenate(parts).astype(np.int32)

  def get_state(self):
    parent_state = self._chunks[0][0] if self._chunks else self._start_state
    return {"parent": parent_state, "offset": self._offset}

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._reset(state["parent"], offset=state["offset"])
