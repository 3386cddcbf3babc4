"""Dataset loaders of the task YAMLs here (lm-eval's `custom_dataset`): the JSONL files under
data/ (written by make_tasks.py), found next to this file, so lm_eval runs from any directory."""

import json
import os

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _load(name: str):
  import datasets  # lm-eval's dependency; this module is only imported by lm-eval.

  with open(os.path.join(_DATA, name), encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  return {"test": datasets.Dataset.from_list(rows)}


def load_mc(**kwargs):
  del kwargs  # lm-eval passes the task's metadata.
  return _load("stdlib_mc.jsonl")


def load_gen(**kwargs):
  del kwargs
  return _load("stdlib_gen.jsonl")


def load_ppl(**kwargs):
  del kwargs
  return _load("stdlib_ppl.jsonl")
