"""Grain pipelines: the infinite, checkpointable training iterator and the fixed eval batches.

File sources ('stdlib', 'text') are tokenized once per process into one in-memory stream per
split (kept in a small in-process cache, nothing on disk); rows are windows of it (packing.py).
Training: row ids -> shuffle (seeded by config.seed, reshuffled every epoch) -> repeat forever ->
global batches of data.batch_size -> this process's slice [p*b, (p+1)*b) (b = B / process_count)
-> gather. Every process walks the same global order, so the global batch of a step does not
depend on the number of processes (a 2-host run trains exactly like a 1-host one). Without
worker processes the iterator state is one integer, so checkpoints are tiny.

TFDS is streamed: documents -> this process's shard -> shuffle documents per epoch -> repeat ->
tokenize -> pack into rows -> batch, reading only what the next batch needs (so, unlike file
sources, its global batches depend on the number of processes).

Eval batch j is rows [j*B, (j+1)*B) of the validation stream (B = data.eval_batch_size, no
shuffle); process p gets rows [p*b, (p+1)*b) of it (b = B / process_count), so the global eval
set does not depend on the number of processes.
"""

from __future__ import annotations

import os

import grain
import numpy as np
from absl import flags

from looped.data import packing, sources, tokenizers

_STREAM_CACHE: dict = {}  # (tokenizer, files with size and mtime) -> token stream.
_STREAM_CACHE_SIZE = 4  # Streams kept (train + validation of two configs).
_TFDS_READ = grain.ReadOptions(num_threads=4, prefetch_buffer_size=64)
_MEMORY_READ = grain.ReadOptions(num_threads=0)  # In-memory rows and the short eval read.


def split_stream(data_cfg, split: str) -> np.ndarray:
  """The token stream of a file source's split: each document's tokens followed by EOS."""
  docs = sources.split_documents(data_cfg, split)
  if not docs:
    raise ValueError(
      f"The {split} split of {_describe(data_cfg)} has no documents (an empty corpus, or "
      f"config.data.val_fraction = {data_cfg.val_fraction} leaves none in it; a smaller "
      f"config.data.segment_bytes = {data_cfg.segment_bytes} cuts long files into more "
      "segments to split)."
    )
  tokenizer = tokenizers.get(data_cfg)
  key = (
    data_cfg.tokenizer,
    getattr(tokenizer, "path", ""),
    tuple(
      (d.path, d.start, d.end, os.stat(d.path).st_size, os.stat(d.path).st_mtime_ns) for d in docs
    ),
  )
  if key not in _STREAM_CACHE:
    parts = [tokenizers.encode_document(tokenizer, sources.read_text(d)) for d in docs]
    if all(len(p) == 1 for p in parts):
      raise ValueError(f"All {len(docs)} {split} documents of {_describe(data_cfg)} are empty.")
    while len(_STREAM_CACHE) >= _STREAM_CACHE_SIZE:
      _STREAM_CACHE.pop(next(iter(_STREAM_CACHE)))
    _STREAM_CACHE[key] = np.concatenate(parts)
  return _STREAM_CACHE[key]


def _segment_eos(data_cfg) -> int | None:
  """The EOS id examples derive their segment ids from, or None when data.document_mask is off
  (then examples carry no segment ids). A stage config recorded before the field existed was
  trained without document masking."""
  if not data_cfg.get("document_mask", False):
    return None
  return tokenizers.get(data_cfg).eos_id


def make_train_iterator(config, *, process_index: int, process_count: int):
  """This process's infinite training iterator of {'inputs', 'targets'} and, with
  data.document_mask, 'segment_ids': int32[b, seq_len] each (packing.to_example).

  b = data.batch_size // process_count. Supports get_state()/set_state() and
  grain.checkpoint.CheckpointSave / CheckpointRestore.
  """
  data = config.data
  seq_len, local_batch = data.seq_len, data.batch_size // process_count
  seed = config.seed % 2**32
  if data.source == "tfds":
    docs = sources.tfds_documents(data, "train")[process_index::process_count]
    if not len(docs):
      raise ValueError(
        f"TFDS split {data.tfds_train_split!r} has fewer documents than processes "
        f"({process_count})."
      )
    if data.shuffle:
      docs = docs.shuffle(seed=seed)
    tokens = docs.repeat().map(EncodeDocument(tokenizers.get(data)))
    tokens = _with_workers(tokens.to_iter_dataset(_TFDS_READ), data.worker_count)
    rows = packing.PackedRowsIterDataset(tokens, seq_len).batch(local_batch, drop_remainder=True)
    return rows.map(packing.ToExample(_segment_eos(data))).__iter__()

  stream = split_stream(data, "train")
  total_rows = packing.num_rows(len(stream), seq_len)
  if total_rows < data.batch_size:
    raise ValueError(
      f"The train split of {_describe(data)} has {len(stream)} tokens = {total_rows} rows of "
      f"config.data.seq_len + 1 = {seq_len + 1}; one batch needs config.data.batch_size = "
      f"{data.batch_size} rows."
    )
  row_ids = grain.MapDataset.range(total_rows)
  if data.shuffle:
    row_ids = row_ids.shuffle(seed=seed)
  batches = row_ids.repeat().batch(data.batch_size, drop_remainder=True)
  mine = slice(process_index * local_batch, (process_index + 1) * local_batch)
  gather = GatherRows(stream, seq_len, _segment_eos(data), mine)
  batches = batches.map(gather).to_iter_dataset(_MEMORY_READ)
  return _with_workers(batches, data.worker_count).__iter__()


def eval_rows(config) -> np.ndarray:
  """int32[num_eval_batches * eval_batch_size, seq_len + 1]: the first validation rows, in order."""
  data = config.data
  seq_len, count = data.seq_len, data.num_eval_batches * data.eval_batch_size
  if data.source == "tfds":
    tokens = sources.tfds_documents(data, "validation").map(EncodeDocument(tokenizers.get(data)))
    rows_iter = iter(packing.PackedRowsIterDataset(tokens.to_iter_dataset(_MEMORY_READ), seq_len))
    rows = []
    for row in rows_iter:
      rows.append(row)
      if len(rows) == count:
        return np.stack(rows)
    available, what = len(rows), f"TFDS split {data.tfds_eval_split!r}"
  else:
    stream = split_stream(data, "validation")
    available = packing.num_rows(len(stream), seq_len)
    if available >= count:
      return packing.gather_rows(stream, np.arange(count), seq_len)
    what = f"the validation split of {_describe(data)} ({len(stream)} tokens)"
  raise ValueError(
    f"{what} is too small for evaluation: it has {available} rows of config.data.seq_len + 1 = "
    f"{seq_len + 1} tokens, but config.data.num_eval_batches * eval_batch_size = {count} rows "
    "are needed. Use fewer/smaller eval batches, a shorter seq_len or more validation data."
  )


def make_eval_batches(config, *, process_index: int, process_count: int) -> list[dict]:
  """This process's slice of the first data.num_eval_batches validation batches."""
  rows = eval_rows(config)
  global_batch = config.data.eval_batch_size
  local_batch = global_batch // process_count
  eos_id = _segment_eos(config.data)
  batches = []
  for j in range(config.data.num_eval_batches):
    start = j * global_batch + process_index * local_batch
    batches.append(packing.to_example(rows[start : start + local_batch], eos_id))
  return batches


def eval_bytes_per_token(config) -> float:
  """UTF-8 bytes of text per target token over all processes' eval rows.

  bits-per-byte = mean loss (nats/token) / ln 2 / this. EOS tokens count as tokens with 0 bytes
  (predicting a document's end is part of the loss but adds no text), so for the bytes tokenizer
  this is slightly below 1. For SentencePiece it counts the bytes the pieces spell (tokenizers.py).
  """
  rows = eval_rows(config)
  targets = rows[:, 1:]  # Consecutive rows overlap by one token: these are contiguous text.
  num_bytes = tokenizers.get(config.data).num_bytes(targets.reshape(-1), previous=rows[0, 0])
  return num_bytes / targets.size


class EncodeDocument:
  """Picklable str -> token ids + EOS, for Grain map (and its worker processes)."""

  def __init__(self, tokenizer: tokenizers.Tokenizer):
    self.tokenizer = tokenizer

  def __call__(self, text: str) -> np.ndarray:
    return tokenizers.encode_document(self.tokenizer, text)


class GatherRows:
  """Picklable batch of row ids -> {'inputs', 'targets'(, 'segment_ids')} of the rows `rows`
  selects (this process's slice of a global batch), gathered from an in-memory stream."""

  def __init__(
    self, stream: np.ndarray, seq_len: int, eos_id: int | None, rows: slice = slice(None)
  ):
    self.stream = stream
    self.seq_len = seq_len
    self.eos_id = eos_id
    self.rows = rows

  def __call__(self, row_ids) -> dict[str, np.ndarray]:
    rows = np.asarray(row_ids)[self.rows]
    return packing.to_example(packing.gather_rows(self.stream, rows, self.seq_len), self.eos_id)


def _with_workers(ds: grain.IterDataset, worker_count: int) -> grain.IterDataset:
  if worker_count <= 0:
    return ds
  if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; notebooks never parse them.
    flags.FLAGS.mark_as_parsed()
  return ds.mp_prefetch(grain.multiprocessing.MultiprocessingOptions(num_workers=worker_count))


def _describe(data_cfg) -> str:
  if data_cfg.source == "stdlib":
    return f"the Python standard library at {sources.stdlib_root()}"
  return f"config.data.text_glob = {data_cfg.text_glob!r}"
