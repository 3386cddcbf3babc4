r"""One Markdown table over many pipeline runs (seeds, arms, ablations), with per-group means.

  python -m looped.benice.collect /work/runs/benice/*

Each argument is a pipeline workdir (or its report/shareability.json). Runs whose names differ
only in a trailing `_s<seed>` form a group; the table lists every run and model, then each
group's mean and spread (max - min) over seeds.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

COLUMNS = ("ppl_unshared", "ppl_shared", "gap")


def load(path: str) -> dict:
  if os.path.isdir(path):
    path = os.path.join(path, "report", "shareability.json")
  with open(path) as f:
    return json.load(f)


def _run_name(path: str) -> str:
  path = path.rstrip("/")
  if path.endswith(".json"):
    path = os.path.dirname(os.path.dirname(path))
  return os.path.basename(path)


def _group(name: str) -> str:
  return re.sub(r"_s\d+$", "", name)


def rows(paths: list[str]) -> list[dict]:
  """One row per (run, model): the headline numbers and the largest Jacobi pass count's gap."""
  out = []
  for path in paths:
    report = load(path)
    for model, m in report["models"].items():
      last = list(m["gap_jacobi"])[-1]
      out.append(
        {
          "run": _run_name(path),
          "model": model,
          **{k: m[k] for k in COLUMNS},
          "gap_jacobi": m["gap_jacobi"][last],
          "jacobi_passes": last,
          "contraction": m["contraction_ratios"],
        }
      )
  return out


def table(paths: list[str]) -> str:
  rs = rows(paths)
  lines = [
    "| run | model | ppl unshared | ppl shared exact | gap exact | gap Jacobi | contraction |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rs:
    lines.append(
      f"| {r['run']} | {r['model']} | {r['ppl_unshared']:.3f} | {r['ppl_shared']:.3f} | "
      f"{100 * r['gap']:+.1f}% | {100 * r['gap_jacobi']:+.1f}% (J{r['jacobi_passes']}) | "
      + " ".join(f"{c:.2f}" for c in r["contraction"])
      + " |"
    )
  groups: dict = {}
  for r in rs:
    groups.setdefault((_group(r["run"]), r["model"]), []).append(r)
  lines += [
    "",
    "| group | model | seeds | ppl unshared | ppl shared exact | gap exact (mean, spread) |",
    "|---|---|---|---|---|---|",
  ]
  for (group, model), members in groups.items():
    mean = {k: float(np.mean([m[k] for m in members])) for k in COLUMNS}
    spread = float(np.ptp([m["gap"] for m in members]))
    lines.append(
      f"| {group} | {model} | {len(members)} | {mean['ppl_unshared']:.3f} | "
      f"{mean['ppl_shared']:.3f} | {100 * mean['gap']:+.1f}% ({100 * spread:.1f} pts) |"
    )
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if not argv:
    raise SystemExit(__doc__)
  print(table(argv))


if __name__ == "__main__":
  main(sys.argv[1:])
