"""Document sources and their deterministic train/validation split.

- 'stdlib': every .py file of the running interpreter's standard library, sorted by relative
  path. site-packages / dist-packages are pruned: they hold installed packages, not the stdlib.
- 'text': the files matching `data.text_glob` (`**` recurses), sorted by path.
- 'tfds': `tfds.data_source` over a TFDS dataset prepared as array_record, read lazily.

File sources split by segment: a file of at most `data.segment_bytes` bytes is one segment,
keyed by its path relative to the corpus root; a longer file is cut into segments of that many
bytes, keyed `path#i`. A segment is validation iff sha256(its key) maps below
`data.val_fraction`, so the split survives adding, removing or moving files (as a tree), and a
single long file yields both splits. Consecutive segments of a file that land in the same split
are read as one document. TFDS datasets use their own named splits. Files are read as UTF-8
(undecodable bytes become U+FFFD) so every document is a str; segment cuts move forward to the
next UTF-8 character boundary, so the pieces of a file tile it exactly.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import sysconfig

import grain

from looped import config_checks

SPLITS = ("train", "validation")
_NON_STDLIB_DIRS = ("site-packages", "dist-packages")
_GLOB_CHARS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class FileDocument:
  name: str  # Path relative to the corpus root ('/'-separated), + '#i' for a file's segment i.
  path: str  # Path to open.
  start: int = 0  # Byte range of the file this document covers (before UTF-8 alignment).
  end: int | None = None  # None: to the end of the file.


def is_validation(name: str, val_fraction: float) -> bool:
  """Whether the document keyed `name` belongs to the validation split (stable across runs)."""
  digest = hashlib.sha256(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"]


def stdlib_documents() -> list[FileDocument]:
  """The interpreter's standard-library .py files, without anything under site/dist-packages."""
  root = stdlib_root()
  docs = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = [d for d in subdirs if d not in _NON_STDLIB_DIRS]
    for file in files:
      if file.endswith(".py"):
        path = os.path.join(directory, file)
        docs.append(FileDocument(_relative_name(path, root), path))
  return sorted(docs, key=lambda d: d.name)


def glob_root(pattern: str) -> str:
  """The directory part of `pattern` before its first wildcard (names are relative to it)."""
  parts = pattern.split(os.sep)
  fixed = []
  for part in parts[:-1]:
    if _GLOB_CHARS & set(part):
      break
    fixed.append(part)
  return os.sep.join(fixed) or (os.sep if pattern.startswith(os.sep) else ".")


def text_documents(pattern: str) -> list[FileDocument]:
  """Files matching `pattern`, sorted by path; ValueError naming the glob when none match."""
  pattern = os.path.expanduser(pattern)
  paths = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
  if not paths:
    raise config_checks.ConfigError(
      f"config.data.text_glob = {pattern!r} matches no files (missing file or bad glob)."
    )
  root = glob_root(pattern)
  return [FileDocument(_relative_name(p, root), p) for p in paths]


def file_documents(data_cfg) -> list[FileDocument]:
  """All documents of a file source ('stdlib' or 'text'), before the split."""
  if data_cfg.source == "stdlib":
    return stdlib_documents()
  if data_cfg.source == "text":
    return text_documents(data_cfg.text_glob)
  raise ValueError(f"source {data_cfg.source!r} is not a file source.")


def segment_documents(doc: FileDocument, segment_bytes: int, val_fraction: float, split: str):
  """The pieces of one file in `split`: runs of consecutive segments of that split."""
  want_val = split == "validation"
  size = os.path.getsize(doc.path)
  if segment_bytes <= 0 or size <= segment_bytes:
    return [doc] if is_validation(doc.name, val_fraction) == want_val else []
  pieces, run_start = [], None
  num_segments = -(-size // segment_bytes)
  for i in range(num_segments + 1):
    inside = i < num_segments and is_validation(f"{doc.name}#{i}", val_fraction) == want_val
    if inside and run_start is None:
      run_start = i
    elif not inside and run_start is not None:
      end = None if i == num_segments else i * segment_bytes
      name = f"{doc.name}#{run_start}"
      pieces.append(FileDocument(name, doc.path, run_start * segment_bytes, end))
      run_start = None
  return pieces


def split_documents(data_cfg, split: str) -> list[FileDocument]:
  """The documents of `split` ('train' or 'validation'), the first data.max_documents if > 0."""
  _check_split(split)
  docs = [
    piece
    for d in file_documents(data_cfg)
    for piece in segment_documents(d, data_cfg.segment_bytes, data_cfg.val_fraction, split)
  ]
  if data_cfg.max_documents > 0:
    docs = docs[: data_cfg.max_documents]
  return docs


def _char_boundary(raw: bytes, i: int) -> int:
  """The first index >= i that does not fall inside a UTF-8 character (continuation bytes)."""
  while i < len(raw) and raw[i] & 0xC0 == 0x80:
    i += 1
  return i


def read_text(doc: FileDocument) -> str:
  with open(doc.path, "rb") as f:
    if doc.start == 0 and doc.end is None:
      return f.read().decode("utf-8", errors="replace")
    f.seek(doc.start)
    # 3 bytes past the end cover the longest UTF-8 continuation of a cut character.
    raw = f.read() if doc.end is None else f.read(doc.end - doc.start + 3)
  stop = len(raw) if doc.end is None else _char_boundary(raw, doc.end - doc.start)
  start = _char_boundary(raw, 0) if doc.start else 0
  return raw[start:stop].decode("utf-8", errors="replace")


def tfds_documents(data_cfg, split: str) -> grain.MapDataset:
  """A lazy MapDataset of the document strings of the TFDS split mapped to `split`."""
  import tensorflow_datasets as tfds  # Lazy: only TFDS configs pay for the import.

  _check_split(split)
  name = data_cfg.tfds_train_split if split == "train" else data_cfg.tfds_eval_split
  source = tfds.data_source(
    data_cfg.tfds_name, split=name, data_dir=data_cfg.tfds_data_dir or None, download=False
  )
  if not len(source):
    raise ValueError(f"TFDS dataset {data_cfg.tfds_name!r} split {name!r} has no documents.")
  docs = grain.MapDataset.source(source)
  if data_cfg.max_documents > 0:
    docs = docs[: data_cfg.max_documents]
  return docs.map(TextFeature(data_cfg.tfds_text_key))


class TextFeature:
  """Picklable example -> str for Grain workers: reads one feature, decoding bytes as UTF-8."""

  def __init__(self, key: str):
    self.key = key

  def __call__(self, example) -> str:
    if self.key not in example:
      config_checks.fail(
        "data.tfds_text_key", self.key, f"must be one of the features {sorted(example)}"
      )
    value = example[self.key]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
      value = value.item()
    if isinstance(value, bytes):
      return value.decode("utf-8", errors="replace")
    if isinstance(value, str):
      return value
    config_checks.fail(
      "data.tfds_text_key", self.key, f"must name a text feature (got {type(value).__name__})"
    )


def _relative_name(path: str, root: str) -> str:
  return os.path.relpath(path, root).replace(os.sep, "/")


def _check_split(split: str) -> None:
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
