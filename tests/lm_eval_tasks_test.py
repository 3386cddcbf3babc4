"""benchmarks/lm_eval/: the local lm-eval tasks' YAMLs name loaders and data that exist, and
every item is well formed (no lm-eval here: the YAML and JSONL are read as text)."""

import json
import os
import re

from absl.testing import absltest

_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
_DIR = os.path.join(_DIR, "lm_eval")
_CONTEXT = 96  # make_tasks.CONTEXT_CHARS (make_tasks imports the data pipeline; this does not).


def _rows(name: str) -> list[dict]:
  with open(os.path.join(_DIR, "data", name), encoding="utf-8") as f:
    return [json.loads(line) for line in f]


class LmEvalTasksTest(absltest.TestCase):
  def test_yamls_name_their_loaders_and_data(self):
    with open(os.path.join(_DIR, "utils.py"), encoding="utf-8") as f:
      utils = f.read()
    tasks = {}
    for name in sorted(os.listdir(_DIR)):
      if name.endswith(".yaml"):
        with open(os.path.join(_DIR, name), encoding="utf-8") as f:
          text = f.read()
        task = re.search(r"^task: (\S+)", text, re.M)[1]
        loader = re.search(r"^custom_dataset: !function utils\.(\w+)", text, re.M)[1]
        self.assertEqual(name, f"{task}.yaml")
        self.assertIn(f"def {loader}(", utils, name)
        data = re.search(rf"def {loader}\(.*?_load\(\"([\w.]+)\"\)", utils, re.S)[1]
        self.assertTrue(os.path.isfile(os.path.join(_DIR, "data", data)), data)
        tasks[task] = data
    self.assertEqual(
      tasks,
      {
        "looped_stdlib_gen": "stdlib_gen.jsonl",
        "looped_stdlib_mc": "stdlib_mc.jsonl",
        "looped_stdlib_ppl": "stdlib_ppl.jsonl",
      },
    )

  def test_multiple_choice_items(self):
    rows = _rows("stdlib_mc.jsonl")
    self.assertLen(rows, 100)
    self.assertLen({r["doc"] for r in rows}, 100)  # One item per held-out document.
    for r in rows:
      self.assertLen(r["context"], _CONTEXT)
      self.assertTrue(r["context"].isascii())
      self.assertLen(set(r["choices"]), 4)
      self.assertIn(r["gold"], range(4))
      indents = {c[: len(c) - len(c.lstrip())] for c in r["choices"]}
      self.assertLen(indents, 1, r)  # Indentation gives the answer away otherwise.
      self.assertTrue(all(c.endswith("\n") and c.count("\n") == 1 for c in r["choices"]))

  def test_generation_items(self):
    rows = _rows("stdlib_gen.jsonl")
    self.assertLen(rows, 100)
    for r in rows:
      self.assertLen(r["context"], _CONTEXT)
      self.assertBetween(len(r["target"]), 4, 16)
      self.assertNotIn("\n", r["target"])  # The task stops generating at a newline.
      self.assertTrue(r["target"].strip() and r["target"].isascii())

  def test_perplexity_items(self):
    rows = _rows("stdlib_ppl.jsonl")
    self.assertLen(rows, 40)
    self.assertTrue(all(len(r["text"]) == 128 and r["text"].isascii() for r in rows))


if __name__ == "__main__":
  absltest.main()
