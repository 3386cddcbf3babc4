"""Where the pipeline's wall time goes: one row per stage, read back from what each stage wrote.

A training stage's `done.json` holds its wall seconds split by part (trainer._Timing: setup,
compile, steps, data, eval, checkpoint); an evaluation's cache file holds its seconds split into
the float32-cache evaluation, the KV formats' and the samples'. A stage that this invocation
skipped or took from another run keeps the seconds of the run that did the work, marked so.
`WORKDIR/timing.json` holds the table's data and the invocation's own wall time.
"""

from __future__ import annotations

import json
import os

TRAIN_PARTS = ("setup", "compile", "steps", "data", "eval", "checkpoint")
EVAL_PARTS = ("fp32", "kv_formats", "samples")


def train_row(stage: str, stage_dir: str, status: str) -> dict:
  """The stage's recorded timing (from its done.json), with how this invocation got it."""
  path = os.path.join(stage_dir, "done.json")
  done = {}
  if os.path.exists(path):
    with open(path) as f:
      done = json.load(f)
  return {
    "stage": stage,
    "status": status,
    "wall_s": done.get("wall_s"),
    "parts": done.get("timing", {}),
    "steps_trained": done.get("steps_trained"),
  }


def eval_row(model: str, parts: dict | None, status: str) -> dict:
  parts = parts or {}
  wall = sum(parts.values()) if parts else None
  return {"stage": f"eval {model}", "status": status, "wall_s": wall, "parts": parts}


def write(workdir: str, rows: list[dict], invocation_s: float) -> dict:
  out = {"invocation_wall_s": invocation_s, "stages": rows}
  with open(os.path.join(workdir, "timing.json"), "w") as f:
    json.dump(out, f, indent=1)
  return out


def markdown(timing: dict) -> str:
  """The stage table: wall seconds per stage and where they went."""
  parts = TRAIN_PARTS + EVAL_PARTS
  head = ["stage", "this run", "wall s"] + list(parts)
  lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
  fmt = lambda x: "-" if x is None else f"{x:.0f}"
  total = 0.0
  for row in timing["stages"]:
    total += row["wall_s"] or 0.0
    cells = [fmt(row["parts"].get(p)) for p in parts]
    lines.append(
      f"| {row['stage']} | {row['status']} | {fmt(row['wall_s'])} | " + " | ".join(cells) + " |"
    )
  lines.append("")
  lines.append(
    f"Stages sum to {total:.0f} s; this invocation took {timing['invocation_wall_s']:.0f} s "
    "(stages it skipped or reused count in the sum with the seconds of the run that did them). "
    "compile: the first step, tracing and XLA compilation included; steps: the others; eval "
    "(training): validation passes; fp32 / kv_formats / samples: the shareability evaluation "
    "with a float32 cache, with each KV format, and the greedy samples."
  )
  return "\n".join(lines)
