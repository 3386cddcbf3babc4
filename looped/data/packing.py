"""Packing a token stream into training rows.

Layout (the same for every source): documents are tokenized, each is followed by EOS, and the
results are concatenated into one stream s. Row i is the window s[i*T : i*T + T + 1] (T =
data.seq_len); inputs = row[:-1], targets = row[1:]. Consecutive rows overlap by exactly one
token (row i's last target is row i+1's first input), so every next-token pair (s[t], s[t+1]) of
the stream is a target exactly once and the inputs of rows 0..n-1 followed by the last target of
row n-1 reassemble s[:n*T + 1]. The tail that cannot fill a row is dropped.

Rows ignore document boundaries (nanodo / GPT-2 style): attention within a row crosses from one
document into the next, positions are row positions 0..T-1, and the EOS token is the only
boundary marker. The model learns to treat EOS as "a new document starts here".
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


def to_example(rows: np.ndarray) -> dict[str, np.ndarray]:
  """Splits packed rows [B, T + 1] into the model's {'inputs', 'targets'} (each [B, T]; targets
  = inputs shifted by 1)."""
  rows = np.asarray(rows, np.int32)
  return {"inputs": rows[:, :-1], "targets": rows[:, 1:]}


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
