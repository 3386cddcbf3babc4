"""Tests for looped.data against hand-built token streams.

Expected streams are built here from the documents directly (UTF-8 bytes or the SentencePiece
processor, plus EOS), never through the pipeline, and rows are compared with windows of them.
"""

import glob
import hashlib
import os
import tempfile
from unittest import mock

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
import sentencepiece
import tensorflow_datasets as tfds
from absl.testing import absltest

import looped.data as data
from configs import pretrain
from looped.config_checks import ConfigError
from looped.data import packing, sources, tokenizers
from looped.data import pipeline as data_pipeline

EOS = 256
SEQ = 8

# A small corpus with known contents: multi-byte UTF-8, an empty document, nested directories.
DOCS = {
  "doc00.txt": "def f(x):\n  return x + 1\n",
  "doc01.txt": "Grüße aus Zürich — ünïcödé bytes.",
  "doc02.txt": "validation text number one, somewhat longer than the others here.",
  "doc03.txt": "second validation document\twith a tab",
  "doc04.txt": "third validation document ends here",
  "doc05.txt": "",
  "doc06.txt": "x" * 50,
  "doc07.txt": "fourth validation file: 0123456789 abcdefghij",
  "doc08.txt": "eight is short",
  "doc09.txt": "nine: the quick brown fox jumps over the lazy dog",
  "sub/deep/doc10.txt": "nested validation document, two levels down",
  "sub/doc11.txt": "nested train document 🙂",
}
# Validation at val_fraction=0.3: the relative paths whose sha256 (first 8 bytes, big-endian, as a
# fraction of 2**64) is below 0.3; test_split_... recomputes this with hashlib.
VAL_DOCS = ["doc02.txt", "doc03.txt", "doc04.txt", "doc07.txt", "sub/deep/doc10.txt"]
TRAIN_DOCS = [n for n in sorted(DOCS) if n not in VAL_DOCS]


def byte_stream(texts) -> np.ndarray:
  """The expected bytes-tokenizer stream: each text's UTF-8 bytes, then EOS."""
  ids = []
  for text in texts:
    ids += list(text.encode("utf-8")) + [EOS]
  return np.array(ids)


def windows(stream, count, seq_len=SEQ) -> np.ndarray:
  """Rows 0..count-1 of the documented layout: s[i*T : i*T + T + 1]."""
  return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)])


def take_rows(iterator, num_batches) -> np.ndarray:
  """Rows (inputs with the last target appended) of the next num_batches batches."""
  rows = []
  for _ in range(num_batches):
    batch = next(iterator)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    assert batch["inputs"].dtype == np.int32 and batch["targets"].dtype == np.int32
    rows.append(np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1))
  return np.concatenate(rows)


def make_tempdir(test) -> str:
  """A temp dir removed after the test (absltest's create_tempdir needs parsed flags)."""
  return test.enterContext(tempfile.TemporaryDirectory())


def write_corpus(root, docs) -> None:
  for name, text in docs.items():
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
      f.write(text)


def text_config(root, **fields):
  c = pretrain.get_config("smoke")
  c.data.source = "text"
  c.data.text_glob = os.path.join(root, "**", "*.txt")
  c.data.val_fraction = 0.3
  c.data.max_documents = 0
  c.data.seq_len = SEQ
  c.data.batch_size = 4
  c.data.eval_batch_size = 4
  c.data.num_eval_batches = 3
  c.data.shuffle = False
  c.data.update(fields)
  return c


def assert_batches_equal(test, got, want):
  test.assertEqual(len(got), len(want))
  for g, w in zip(got, want):
    test.assertEqual(set(g), {"inputs", "targets", "segment_ids"})  # data.document_mask on.
    for key in g:
      np.testing.assert_array_equal(g[key], w[key])


def orbax_save_and_restore(test, iterator, fresh_iterator, step=3):
  """Saves `iterator` with Orbax, restores into `fresh_iterator`, returns it."""
  directory = make_tempdir(test)
  with ocp.CheckpointManager(directory) as manager:
    manager.save(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(iterator)))
    manager.wait_until_finished()
  with ocp.CheckpointManager(directory) as manager:
    restored = manager.restore(
      step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh_iterator))
    )
  return restored["data"]


class SingleFileCorpusTest(absltest.TestCase):
  """One long file is a corpus: its segments are split, and the pieces tile the file."""

  def setUp(self):
    super().setUp()
    self.root = make_tempdir(self)
    rng = np.random.default_rng(0)
    words = ["looped", "Grüße", "κόσμε", "🙂", "recurrence", "cache", "\n"]
    text = " ".join(rng.choice(words, size=180_000))  # ~1.1 MB with multi-byte characters.
    self.path = os.path.join(self.root, "input.txt")
    write_corpus(self.root, {"input.txt": text})
    self.text = text
    self.size = os.path.getsize(self.path)

  def config(self, **fields):
    c = text_config(self.root, **fields)
    c.data.text_glob = self.path
    return c

  def test_segments_split_by_their_own_hash_and_tile_the_file(self):
    c = self.config(val_fraction=0.05)
    seg = c.data.segment_bytes
    pieces = {s: sources.split_documents(c.data, s) for s in sources.SPLITS}
    self.assertNotEmpty(pieces["train"])
    self.assertNotEmpty(pieces["validation"])
    # Independent membership: segment i is validation iff sha256('input.txt#i') < 0.05 * 2**64.
    sha_fraction = lambda n: int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") / 2**64
    num_segments = -(-self.size // seg)
    want_val = [i for i in range(num_segments) if sha_fraction(f"input.txt#{i}") < 0.05]
    got_val = [
      i for d in pieces["validation"] for i in range(d.start // seg, (d.end or self.size) // seg)
    ] + ([num_segments - 1] if pieces["validation"][-1].end is None else [])
    self.assertEqual(sorted(set(got_val)), want_val)
    # The pieces of both splits, in file order, reassemble the file's text exactly.
    ordered = sorted(pieces["train"] + pieces["validation"], key=lambda d: d.start)
    self.assertEqual("".join(sources.read_text(d) for d in ordered), self.text)

  def test_whole_file_split_has_an_empty_train_split_and_says_what_to_change(self):
    c = self.config(segment_bytes=0, val_fraction=0.05)
    split = "train" if sha_fraction_of("input.txt") < 0.05 else "validation"
    with self.assertRaisesRegex(ValueError, "segment_bytes"):
      data_pipeline.split_stream(c.data, split)

  def test_trains_from_one_file(self):
    c = self.config(val_fraction=0.05)
    batch = next(data.make_train_iterator(c, process_index=0, process_count=1))
    self.assertEqual(batch["inputs"].shape, (4, SEQ))
    self.assertLen(data.make_eval_batches(c, process_index=0, process_count=1), 3)


def sha_fraction_of(name: str) -> float:
  return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64


class TextCorpusTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.root = make_tempdir(self)
    write_corpus(self.root, DOCS)
    self.train_stream = byte_stream(DOCS[n] for n in TRAIN_DOCS)
    self.val_stream = byte_stream(DOCS[n] for n in VAL_DOCS)
    self.num_train_rows = (len(self.train_stream) - 1) // SEQ

  def train_iter(self, c, process_index=0, process_count=1):
    return data.make_train_iterator(c, process_index=process_index, process_count=process_count)

  def test_split_is_deterministic_disjoint_and_covers_the_corpus(self):
    c = text_config(self.root)
    names = {s: [d.name for d in sources.split_documents(c.data, s)] for s in sources.SPLITS}
    again = {s: [d.name for d in sources.split_documents(c.data, s)] for s in sources.SPLITS}
    self.assertEqual(names, again)
    self.assertEqual(names["validation"], VAL_DOCS)
    sha_fraction = lambda n: int.from_bytes(hashlib.sha256(n.encode()).digest()[:8], "big") / 2**64
    self.assertEqual([n for n in sorted(DOCS) if sha_fraction(n) < 0.3], VAL_DOCS)
    self.assertEqual(names["train"], TRAIN_DOCS)
    self.assertEmpty(set(names["train"]) & set(names["validation"]))
    self.assertEqual(set(names["train"]) | set(names["validation"]), set(DOCS))

  def test_split_fraction_follows_val_fraction(self):
    keys = [f"dir{i % 7}/file{i}.py" for i in range(4000)]
    fraction = np.mean([sources.is_validation(k, 0.3) for k in keys])
    self.assertBetween(fraction, 0.27, 0.33)  # > 4 binomial standard deviations.

  def test_max_documents_keeps_the_first_documents_of_each_split(self):
    c = text_config(self.root, max_documents=2)
    self.assertEqual([d.name for d in sources.split_documents(c.data, "train")], TRAIN_DOCS[:2])
    self.assertEqual([d.name for d in sources.split_documents(c.data, "validation")], VAL_DOCS[:2])

  def test_rows_reassemble_the_concatenated_stream(self):
    c = text_config(self.root)
    n = self.num_train_rows
    rows = take_rows(self.train_iter(c), 2 * n // 4 + 2)
    # Unshuffled: row k is row k mod n, in order, forever.
    np.testing.assert_array_equal(rows[:n], windows(self.train_stream, n))
    np.testing.assert_array_equal(rows[n : 2 * n], rows[:n])
    # Inputs of all rows plus the last target are exactly the stream (minus a < T tail).
    rebuilt = np.concatenate([rows[:n, :-1].reshape(-1), rows[n - 1, -1:]])
    np.testing.assert_array_equal(rebuilt, self.train_stream[: n * SEQ + 1])
    self.assertLess(len(self.train_stream) - len(rebuilt), SEQ)
    # EOS sits right after every train document (the empty doc05 is a lone EOS).
    doc_ends = np.cumsum([len(DOCS[d].encode()) + 1 for d in TRAIN_DOCS]) - 1
    eos_positions = np.flatnonzero(rebuilt == EOS)
    np.testing.assert_array_equal(eos_positions, doc_ends[doc_ends < len(rebuilt)])

  def test_epochs_are_reshuffled_permutations(self):
    c = text_config(self.root, shuffle=True)
    n = self.num_train_rows
    rows = take_rows(self.train_iter(c), 2 * n // 4 + 1)
    all_rows = sorted(map(tuple, windows(self.train_stream, n)))
    first, second = rows[:n], rows[n : 2 * n]
    self.assertEqual(sorted(map(tuple, first)), all_rows)
    self.assertEqual(sorted(map(tuple, second)), all_rows)
    self.assertFalse(np.array_equal(first, second))
    self.assertFalse(np.array_equal(first, windows(self.train_stream, n)))
    np.testing.assert_array_equal(take_rows(self.train_iter(c), 3), rows[:12])
    c.seed = 1
    self.assertFalse(np.array_equal(take_rows(self.train_iter(c), 3), rows[:12]))

  def test_process_slices_tile_the_one_process_batches(self):
    # The global batch of every step is the same for 1 and 2 processes (process p holds rows
    # [p*b, (p+1)*b) of it), also past the first epoch's reshuffle.
    c = text_config(self.root, shuffle=True)
    steps = self.num_train_rows  # Batches of 4 rows: several epochs.
    one = self.train_iter(c)
    halves = [self.train_iter(c, process_index=p, process_count=2) for p in range(2)]
    for _ in range(steps):
      whole = next(one)
      parts = [next(h) for h in halves]
      for key in ("inputs", "targets"):
        self.assertEqual(parts[0][key].shape[0], 2)  # Local batch = 4 // 2.
        np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])

  def test_get_state_set_state_continues_the_stream(self):
    c = text_config(self.root, shuffle=True)
    iterator = self.train_iter(c)
    take_rows(iterator, 20)  # Past the first epoch.
    state = iterator.get_state()
    expected = take_rows(iterator, 5)
    restored = self.train_iter(c)
    restored.set_state(state)
    np.testing.assert_array_equal(take_rows(restored, 5), expected)

  def test_orbax_checkpoint_continues_the_stream(self):
    c = text_config(self.root, shuffle=True)
    iterator = self.train_iter(c)
    take_rows(iterator, 7)
    restored = orbax_save_and_restore(self, iterator, self.train_iter(c))
    expected = take_rows(iterator, 5)
    np.testing.assert_array_equal(take_rows(restored, 5), expected)

  def test_worker_process_yields_the_same_stream(self):
    c = text_config(self.root, shuffle=True)
    expected = take_rows(self.train_iter(c), 6)
    c.data.worker_count = 1
    iterator = self.train_iter(c)
    np.testing.assert_array_equal(take_rows(iterator, 6), expected)
    iterator.close()

  def test_eval_batches_are_the_first_validation_rows(self):
    c = text_config(self.root)
    batches = data.make_eval_batches(c, process_index=0, process_count=1)
    assert_batches_equal(self, data.make_eval_batches(c, process_index=0, process_count=1), batches)
    self.assertLen(batches, 3)
    rows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) for b in batches])
    np.testing.assert_array_equal(rows, windows(self.val_stream, 12))

  def test_segment_ids_number_the_documents_of_each_row(self):
    """Hand-derived: a token right after an EOS starts the next segment; the EOS ends its own."""
    inputs = np.array([[5, EOS, 7, 8, EOS, EOS, 2], [EOS, 1, 2, 3, 4, 5, 6]])
    want = np.array([[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(packing.segment_ids(inputs, EOS), want)

  def test_examples_carry_segment_ids_unless_document_mask_is_off(self):
    """Train and eval examples: segment ids counted from the stream's EOS markers independently
    (the stream built here, not the pipeline's); data.document_mask=False leaves them out."""
    c = text_config(self.root)
    batches = data.make_eval_batches(c, process_index=0, process_count=1)
    segments = np.concatenate([b["segment_ids"] for b in batches])
    for row, got in zip(windows(self.val_stream, 12), segments):
      want = [sum(int(x) == EOS for x in row[:t]) for t in range(SEQ)]
      np.testing.assert_array_equal(got, want)
    self.assertGreater(int(segments.max()), 0)  # Some row spans two documents.
    train = next(self.train_iter(c))
    np.testing.assert_array_equal(train["segment_ids"], packing.segment_ids(train["inputs"], EOS))
    off = text_config(self.root, document_mask=False)
    self.assertEqual(set(next(self.train_iter(off))), {"inputs", "targets"})
    eval_off = data.make_eval_batches(off, process_index=0, process_count=1)[0]
    self.assertEqual(set(eval_off), {"inputs", "targets"})
    np.testing.assert_array_equal(eval_off["inputs"], batches[0]["inputs"])

  def test_eval_process_slices_tile_the_global_batches(self):
    c = text_config(self.root)
    whole = data.make_eval_batches(c, process_index=0, process_count=1)
    halves = [data.make_eval_batches(c, process_index=p, process_count=2) for p in range(2)]
    for j, batch in enumerate(whole):
      for key in batch:
        tiled = np.concatenate([halves[0][j][key], halves[1][j][key]])
        np.testing.assert_array_equal(tiled, batch[key])

  def test_eval_bytes_per_token_counts_eos_as_zero_bytes(self):
    c = text_config(self.root)
    targets = self.val_stream[1 : 12 * SEQ + 1]
    want = np.count_nonzero(targets != EOS) / targets.size
    self.assertAlmostEqual(data.eval_bytes_per_token(c), want)
    self.assertLess(want, 1.0)


class PackedRowsTest(absltest.TestCase):
  """The streaming packer (used for TFDS) against windows of the concatenation."""

  def setUp(self):
    super().setUp()
    lengths = [3, 1, 17, 8, 9, 2, 2, 30, 5, 1, 12]
    starts = np.cumsum([0] + lengths)
    self.docs = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    self.stream = np.concatenate(self.docs)

  def packed(self, seq_len):
    docs = grain.MapDataset.source(self.docs).to_iter_dataset()
    return packing.PackedRowsIterDataset(docs, seq_len)

  def test_rows_are_windows_of_the_stream(self):
    for seq_len in (1, 4, 7, 40):
      rows = list(self.packed(seq_len))
      count = packing.num_rows(len(self.stream), seq_len)
      self.assertLen(rows, count)
      np.testing.assert_array_equal(np.stack(rows), windows(self.stream, count, seq_len))
      np.testing.assert_array_equal(
        packing.gather_rows(self.stream, np.arange(count), seq_len), np.stack(rows)
      )

  def test_state_restores_at_every_position(self):
    seq_len = 4
    full = list(self.packed(seq_len))
    iterator = iter(self.packed(seq_len))
    for k in range(len(full)):
      state = iterator.get_state()
      restored = iter(self.packed(seq_len))
      restored.set_state(state)
      np.testing.assert_array_equal(np.stack(list(restored)), np.stack(full[k:]))
      next(iterator)


class StdlibTest(absltest.TestCase):
  def test_documents_are_the_stdlib_without_installed_packages(self):
    root = sources.stdlib_root()
    names = [d.name for d in sources.stdlib_documents()]
    independent = sorted(
      os.path.relpath(p, root).replace(os.sep, "/")
      for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
      if not {"site-packages", "dist-packages"} & set(os.path.relpath(p, root).split(os.sep))
    )
    self.assertEqual(names, independent)
    self.assertIn("os.py", names)
    self.assertIn("json/__init__.py", names)

  def test_smoke_config_end_to_end(self):
    c = pretrain.get_config("smoke")
    data.validate(c)
    self.assertEqual(data.tokenizer_vocab_size(c.data), 257)
    batch = next(data.make_train_iterator(c, process_index=0, process_count=1))
    self.assertEqual(batch["inputs"].shape, (8, 64))
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    batches = data.make_eval_batches(c, process_index=0, process_count=1)
    self.assertLen(batches, 2)
    first_doc = sources.read_text(sources.split_documents(c.data, "validation")[0])
    np.testing.assert_array_equal(batches[0]["inputs"][0], byte_stream([first_doc])[:64])
    self.assertBetween(data.eval_bytes_per_token(c), 0.99, 1.0)


class TfdsTest(absltest.TestCase):
  """TFDS through tfds.testing.mock_data: `tfds.data_source` returns an ArrayRecordDataSource over
  deterministic random examples, with no TensorFlow and no files."""

  def tfds_config(self, **fields):
    c = pretrain.get_config("smoke")
    c.data.update(
      source="tfds",
      tfds_name="lm1b",
      tfds_train_split="train",
      tfds_eval_split="test",
      seq_len=SEQ,
      batch_size=4,
      eval_batch_size=4,
      num_eval_batches=2,
      shuffle=False,
    )
    c.data.update(fields)
    return c

  def documents(self, split):
    source = tfds.data_source("lm1b", split=split)
    return [source[i]["text"] for i in range(len(source))]

  def test_rows_are_windows_of_the_documents_over_epochs(self):
    with tfds.testing.mock_data(num_examples=10):
      docs = self.documents("train")
      c = self.tfds_config()
      data.validate(c)
      rows = take_rows(data.make_train_iterator(c, process_index=0, process_count=1), 12)
    stream = byte_stream(docs * 3)
    self.assertGreater(len(rows) * SEQ, len(byte_stream(docs)))  # Crosses an epoch.
    np.testing.assert_array_equal(rows, windows(stream, len(rows)))

  def test_each_process_reads_every_pth_document(self):
    with tfds.testing.mock_data(num_examples=9):
      docs = self.documents("train")
      c = self.tfds_config(batch_size=3)
      for p in range(3):
        it = data.make_train_iterator(c, process_index=p, process_count=3)
        rows = take_rows(it, 4)
        self.assertEqual(rows.shape[0], 4)  # One row per process and batch.
        np.testing.assert_array_equal(rows, windows(byte_stream(docs[p::3] * 8), len(rows)))

  def test_shuffled_checkpoint_continues_the_stream(self):
    with tfds.testing.mock_data(num_examples=10):
      c = self.tfds_config(shuffle=True)
      make = lambda: data.make_train_iterator(c, process_index=0, process_count=1)
      iterator = make()
      take_rows(iterator, 5)
      state = iterator.get_state()
      restored = orbax_save_and_restore(self, iterator, make())
      expected = take_rows(iterator, 6)
      np.testing.assert_array_equal(take_rows(restored, 6), expected)
      again = make()
      again.set_state(state)
      np.testing.assert_array_equal(take_rows(again, 6), expected)
      shuffled = take_rows(make(), 11)
      c.data.shuffle = False
      self.assertFalse(np.array_equal(shuffled, take_rows(make(), 11)))

  def test_eval_batches_use_the_eval_split(self):
    with tfds.testing.mock_data(num_examples=10):
      docs = self.documents("test")
      c = self.tfds_config()
      batches = data.make_eval_batches(c, process_index=0, process_count=1)
      bytes_per_token = data.eval_bytes_per_token(c)
    rows = np.concatenate([np.concatenate([b["inputs"], b["targets"][:, -1:]], 1) for b in batches])
    stream = byte_stream(docs)
    np.testing.assert_array_equal(rows, windows(stream, 8))
    targets = stream[1 : 8 * SEQ + 1]
    self.assertAlmostEqual(bytes_per_token, np.count_nonzero(targets != EOS) / targets.size)

  def test_reads_lazily_and_decodes_bytes(self):
    texts = [f"document {i} ".encode() * (1 + i % 3) for i in range(1000)]
    accessed = set()

    class Source:
      def __len__(self):
        return len(texts)

      def __getitem__(self, i):
        accessed.add(i)
        return {"text": texts[i]}

    with tfds.testing.mock_data(as_data_source_fn=lambda *args, **kwargs: Source()):
      c = self.tfds_config()
      rows = take_rows(data.make_train_iterator(c, process_index=0, process_count=1), 2)
    want = byte_stream(t.decode() for t in texts[:20])
    np.testing.assert_array_equal(rows, windows(want, len(rows)))
    self.assertLess(len(accessed), 200)

  def test_eval_split_too_small(self):
    with tfds.testing.mock_data(num_examples=2):
      c = self.tfds_config(num_eval_batches=50)
      with self.assertRaisesRegex(ValueError, r"'test' is too small"):
        data.make_eval_batches(c, process_index=0, process_count=1)


class SentencePieceTest(absltest.TestCase):
  LINES = ["the quick brown fox jumps over the lazy dog", "hello world, hello café"] * 10

  def train_model(self, **kwargs) -> str:
    prefix = os.path.join(make_tempdir(self), "spm")
    sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(self.LINES),
      model_prefix=prefix,
      vocab_size=48,
      model_type="bpe",
      character_coverage=1.0,
      normalization_rule_name="identity",
      remove_extra_whitespaces=False,
      minloglevel=2,
      **kwargs,
    )
    return prefix + ".model"

  def test_round_trip_and_eos(self):
    path = self.train_model()
    c = pretrain.get_config("smoke")
    c.data.update(tokenizer="sentencepiece", spm_path=path)
    tokenizer = tokenizers.get(c.data)
    processor = sentencepiece.SentencePieceProcessor(model_file=path)
    text = "hello  the lazy café fox"
    ids = tokenizer.encode(text)
    self.assertEqual(ids.tolist(), processor.encode(text))
    self.assertEqual(tokenizer.decode(ids), text)
    self.assertEqual(tokenizer.eos_id, processor.eos_id())
    self.assertEqual(data.tokenizer_vocab_size(c.data), processor.get_piece_size())
    np.testing.assert_array_equal(
      tokenizers.encode_document(tokenizer, text), processor.encode(text) + [processor.eos_id()]
    )
    # Bytes of a stream of whole documents = bytes of their text (EOS and dummy prefix add none).
    docs = ["hello world", "", " the  fox", "café"]
    stream = np.concatenate([tokenizers.encode_document(tokenizer, d) for d in docs])
    self.assertEqual(
      tokenizer.num_bytes(stream, previous=tokenizer.eos_id), sum(len(d.encode()) for d in docs)
    )

  def test_model_without_eos_uses_one_past_the_vocabulary(self):
    path = self.train_model(eos_id=-1)
    c = pretrain.get_config("smoke")
    c.data.update(tokenizer="sentencepiece", spm_path=path)
    size = sentencepiece.SentencePieceProcessor(model_file=path).get_piece_size()
    self.assertEqual(tokenizers.get(c.data).eos_id, size)
    self.assertEqual(data.tokenizer_vocab_size(c.data), size + 1)

  def test_pipeline_packs_sentencepiece_tokens(self):
    path = self.train_model()
    root = make_tempdir(self)
    write_corpus(root, {n: " ".join(self.LINES[: 1 + i % 4]) for i, n in enumerate(DOCS)})
    c = text_config(root, tokenizer="sentencepiece", spm_path=path, num_eval_batches=1)
    c.model.vocab_size = 48
    data.validate(c)
    processor = sentencepiece.SentencePieceProcessor(model_file=path)
    stream = []
    for name in TRAIN_DOCS:
      with open(os.path.join(root, name)) as f:
        stream += processor.encode(f.read()) + [processor.eos_id()]
    rows = take_rows(data.make_train_iterator(c, process_index=0, process_count=1), 3)
    np.testing.assert_array_equal(rows, windows(np.array(stream), 12))
    with open(os.path.join(root, VAL_DOCS[0])) as f:
      first_val_doc = f.read()  # Longer than the 4 eval rows: all their targets lie inside it.
    ids = processor.encode(first_val_doc)
    self.assertGreater(len(ids), 4 * SEQ + 1)
    text_bytes = lambda n: len(processor.decode(ids[:n]).encode())  # Prefixes decode exactly.
    want = (text_bytes(4 * SEQ + 1) - text_bytes(1)) / (4 * SEQ)
    self.assertAlmostEqual(data.eval_bytes_per_token(c), want)
    self.assertGreater(want, 1.2)  # Pieces merge several bytes.


class ErrorTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.root = make_tempdir(self)
    write_corpus(self.root, DOCS)

  def test_glob_that_matches_nothing(self):
    c = text_config(self.root, text_glob=os.path.join(self.root, "**", "*.md"))
    with self.assertRaisesRegex(ConfigError, r"text_glob = '.*\*\.md' matches no files"):
      data.validate(c)
    with self.assertRaisesRegex(ConfigError, r"\*\.md' matches no files"):
      data.make_train_iterator(c, process_index=0, process_count=1)

  def test_missing_file(self):
    missing = os.path.join(self.root, "nope.txt")
    with self.assertRaisesRegex(ConfigError, "nope.txt' matches no files"):
      data.validate(text_config(self.root, text_glob=missing))

  def test_empty_corpus(self):
    empty = make_tempdir(self)
    write_corpus(empty, {n: "" for n in DOCS})
    c = text_config(empty)
    data.validate(c)  # Reads no corpus.
    with self.assertRaisesRegex(ValueError, r"All 7 train documents .* are empty"):
      data.make_train_iterator(c, process_index=0, process_count=1)

  def test_split_without_documents(self):
    root = make_tempdir(self)
    write_corpus(root, {"doc02.txt": "only a validation document"})
    with self.assertRaisesRegex(ValueError, r"train split .* has no documents"):
      data.make_train_iterator(text_config(root), process_index=0, process_count=1)

  def test_validation_split_too_small(self):
    c = text_config(self.root, num_eval_batches=100)
    with self.assertRaisesRegex(
      ValueError, r"too small for evaluation: it has \d+ rows.* 400 rows"
    ):
      data.make_eval_batches(c, process_index=0, process_count=1)
    with self.assertRaisesRegex(ValueError, "too small"):
      data.eval_bytes_per_token(c)

  def test_missing_spm_file(self):
    path = os.path.join(self.root, "missing.model")
    c = text_config(self.root, tokenizer="sentencepiece", spm_path=path)
    with self.assertRaisesRegex(ConfigError, r"config\.data\.spm_path = '.*missing\.model'"):
      data.validate(c)
    with self.assertRaisesRegex(ConfigError, r"missing\.model"):
      data.tokenizer_vocab_size(c.data)

  def test_vocab_too_small_for_tokenizer(self):
    c = text_config(self.root)
    c.model.vocab_size = 256
    with self.assertRaisesRegex(ConfigError, r"config\.model\.vocab_size = 256 .* >= .* 257"):
      data.validate(c)

  def test_seq_len_longer_than_model(self):
    c = text_config(self.root, seq_len=65)
    with self.assertRaisesRegex(ConfigError, r"config\.data\.seq_len = 65 .*max_seq_len = 64"):
      data.validate(c)

  def test_bad_values_name_field_and_allowed_values(self):
    cases = [
      ("source", "wiki", r"config\.data\.source = 'wiki'.*'stdlib', 'text', 'tfds'"),
      ("tokenizer", "gpt2", r"config\.data\.tokenizer = 'gpt2'.*'bytes', 'sentencepiece'"),
      ("val_fraction", 1.0, r"config\.data\.val_fraction = 1\.0.*< 1"),
      ("batch_size", 0, r"config\.data\.batch_size = 0.*>= 1"),
      ("max_documents", -1, r"config\.data\.max_documents = -1.*>= 0"),
      ("num_eval_batches", 0, r"config\.data\.num_eval_batches = 0.*>= 1"),
      ("worker_count", -2, r"config\.data\.worker_count = -2.*>= 0"),
    ]
    for field, value, pattern in cases:
      c = text_config(self.root)
      c.data[field] = value
      with self.assertRaisesRegex(ConfigError, pattern):
        data.validate(c)
    c = text_config(self.root, source="tfds")
    with self.assertRaisesRegex(ConfigError, r"config\.data\.tfds_name = ''"):
      data.validate(c)
    c = text_config(self.root)
    c.data.seqlen = 3
    with self.assertRaisesRegex(ConfigError, r"unknown field\(s\) \['seqlen'\]"):
      data.validate(c)

  def test_missing_tfds_dataset_fails_in_validation_naming_it(self):
    tmp = make_tempdir(self)
    c = text_config(self.root, source="tfds", tfds_name="no_such_dataset_xyz", tfds_data_dir=tmp)
    with self.assertRaisesRegex(ConfigError, r"config\.data\.tfds_name = 'no_such_dataset_xyz'"):
      data.validate(c)
    self.assertEqual(os.listdir(tmp), [])  # Nothing created.

  def test_batch_size_must_divide_over_devices(self):
    c = text_config(self.root, batch_size=6)
    with mock.patch.object(jax, "device_count", return_value=4):
      with self.assertRaisesRegex(
        ConfigError, r"config\.data\.batch_size = 6 .* multiple of jax\.device_count\(\) = 4"
      ):
        data.validate(c)

  def test_batch_size_must_divide_over_processes(self):
    c = text_config(self.root, eval_batch_size=6)
    with mock.patch.object(jax, "process_count", return_value=4):
      with self.assertRaisesRegex(ConfigError, r"config\.data\.eval_batch_size = 6 .*= 4"):
        data.validate(c)


if __name__ == "__main__":
  absltest.main()
