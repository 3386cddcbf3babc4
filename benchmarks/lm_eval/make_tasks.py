r"""Writes the data of the local lm-evaluation-harness tasks in this directory (README.md here).

  python benchmarks/lm_eval/make_tasks.py            # rewrites benchmarks/lm_eval/data/*.jsonl
  python benchmarks/lm_eval/make_tasks.py --check    # exit 1 if the files differ from a rewrite

The items come from the held-out split of the data every model of configs/pretrain.py and
configs/benice.py trains on: the interpreter's standard-library .py files, validation segments
(`looped.data.sources`, `data.val_fraction` 0.05 of 4096-byte segments). Each task draws its
items from distinct documents, seeded, ASCII text only (so characters are bytes for the bytes
tokenizer). Contexts are the 96 characters before the cut, so context + answer stays near the
128-token rows the models trained on (161 characters at most).

- `stdlib_mc.jsonl` (task looped_stdlib_mc, loglikelihood): `context`, `choices` (the next line
  of the document, with its indentation and newline, and 3 distractors: lines of other held-out
  documents with the same indentation and a stripped length within 30%), `gold` (its index).
- `stdlib_gen.jsonl` (looped_stdlib_gen, greedy generation): `context` ends inside a line,
  `target` is the rest of that line (4 to 16 characters, no newline).
- `stdlib_ppl.jsonl` (looped_stdlib_ppl, rolling loglikelihood): `text`, 128 characters of a
  document from a line start.

The split depends on the Python version's standard library (the files the models trained on);
the committed files were written with Python 3.11.7, and `--check` only holds on that version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))

from configs import pretrain  # noqa: E402
from looped.data import sources  # noqa: E402

DATA = os.path.join(_HERE, "data")
CONTEXT_CHARS = 96  # Characters of context before each cut.
NUM_ITEMS = {"stdlib_mc": 100, "stdlib_gen": 100, "stdlib_ppl": 40}
NUM_DISTRACTORS = 3
PPL_CHARS = 128  # Characters of each perplexity text.
SEED = 0
# Text the repository's own files may not hold (tests/docs_test.py: dated by work history, not by
# a date or version); items that would carry it are skipped.
_UNPUBLISHABLE = re.compile(r"[Ss]ession[ -][0-9]|[Ii]ssue #?[0-9]")


def held_out_documents() -> list[tuple[str, str]]:
  """(name, text) of every validation document of configs/pretrain.py's data config."""
  data = pretrain.data_config()
  return [(d.name, sources.read_text(d)) for d in sources.split_documents(data, "validation")]


def _lines(text: str) -> list[tuple[int, str]]:
  """(offset, line without its newline) of each complete line (one followed by a newline)."""
  out, offset = [], 0
  for line in text.split("\n")[:-1]:
    out.append((offset, line))
    offset += len(line) + 1
  return out


def _indent(line: str) -> str:
  return line[: len(line) - len(line.lstrip())]


def _ok_line(line: str, lo: int, hi: int) -> bool:
  body = line.strip()
  return line.isascii() and line == line.rstrip() and lo <= len(body) <= hi and _ok_text(line)


def _ok_text(text: str) -> bool:
  return not _UNPUBLISHABLE.search(text)


def mc_items(docs, rng: random.Random) -> list[dict]:
  lines = {name: [(o, s) for o, s in _lines(text) if _ok_line(s, 10, 40)] for name, text in docs}
  pool = [(name, s) for name, ls in lines.items() for _, s in ls]
  items = []
  for name, text in rng.sample(docs, len(docs)):
    cands = [
      (o, s)
      for o, s in lines[name]
      if o >= CONTEXT_CHARS and text[:o].isascii() and _ok_text(text[o - CONTEXT_CHARS : o])
    ]
    rng.shuffle(cands)
    for offset, line in cands:
      body = len(line.strip())
      others = sorted(
        {
          s
          for n, s in pool
          if n != name
          and _indent(s) == _indent(line)
          and s.strip() != line.strip()
          and abs(len(s.strip()) - body) <= 0.3 * body
        }
      )
      if len(others) < NUM_DISTRACTORS:
        continue
      choices = [line] + rng.sample(others, NUM_DISTRACTORS)
      order = list(range(len(choices)))
      rng.shuffle(order)
      items.append(
        {
          "doc": name,
          "context": text[offset - CONTEXT_CHARS : offset],
          "choices": [choices[i] + "\n" for i in order],
          "gold": order.index(0),
        }
      )
      break
    if len(items) == NUM_ITEMS["stdlib_mc"]:
      return items
  raise ValueError(f"only {len(items)} multiple-choice items")


def gen_items(docs, rng: random.Random) -> list[dict]:
  items = []
  for name, text in rng.sample(docs, len(docs)):
    cands = [
      (o, s) for o, s in _lines(text) if _ok_line(s, 16, 80) and text[max(0, o - 100) : o].isascii()
    ]
    rng.shuffle(cands)
    for offset, line in cands:
      cut = offset + len(line) - rng.randint(4, 16)
      target = text[cut : offset + len(line)]
      if cut < CONTEXT_CHARS or not target.strip() or not _ok_text(text[cut - CONTEXT_CHARS : cut]):
        continue
      items.append({"doc": name, "context": text[cut - CONTEXT_CHARS : cut], "target": target})
      break
    if len(items) == NUM_ITEMS["stdlib_gen"]:
      return items
  raise ValueError(f"only {len(items)} generation items")


def ppl_items(docs, rng: random.Random) -> list[dict]:
  items = []
  for name, text in rng.sample(docs, len(docs)):
    starts = [o for o, s in _lines(text) if s.strip() and text[o : o + PPL_CHARS].isascii()]
    starts = [o for o in starts if o + PPL_CHARS <= len(text) and _ok_text(text[o : o + PPL_CHARS])]
    if starts:
      o = rng.choice(starts)
      items.append({"doc": name, "text": text[o : o + PPL_CHARS]})
    if len(items) == NUM_ITEMS["stdlib_ppl"]:
      return items
  raise ValueError(f"only {len(items)} perplexity items")


def build() -> dict[str, str]:
  """File name -> JSONL text of every task's data."""
  docs = held_out_documents()
  out = {}
  for i, (task, make) in enumerate(
    (("stdlib_mc", mc_items), ("stdlib_gen", gen_items), ("stdlib_ppl", ppl_items))
  ):
    items = make(docs, random.Random(SEED + i))
    out[f"{task}.jsonl"] = "".join(json.dumps(x) + "\n" for x in items)
  return out


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--check", action="store_true", help="compare instead of writing")
  args = parser.parse_args()
  files = build()
  if args.check:
    stale = []
    for name, text in files.items():
      path = os.path.join(DATA, name)
      if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
        stale.append(name)
    print("stale: " + ", ".join(stale) if stale else "up to date")
    return 1 if stale else 0
  os.makedirs(DATA, exist_ok=True)
  for name, text in files.items():
    with open(os.path.join(DATA, name), "w", encoding="utf-8") as f:
      f.write(text)
    print(f"wrote {os.path.join(DATA, name)}: {text.count(chr(10))} items")
  return 0


if __name__ == "__main__":
  sys.exit(main())
