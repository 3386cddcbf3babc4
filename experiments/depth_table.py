r"""The test-time depth tables of docs/results.md ("Test-time depth: quality against compute")
from experiments/test_time_depth.py's reports.

  python experiments/depth_table.py experiments/results/test_time_depth

Each subdirectory holding a depth_sweep.json is one model (its name: see MODELS). Two tables:

  exits   per model, layout and exit criterion, the threshold that saves the most compute
          within quality: among the criterion's thresholds whose gap vs full depth has the upper
          end of its 95% CI at or below +1% (`LIMIT`), the one with the fewest mean recurrences
          per token (ties: the smaller gap, then the smaller threshold). The `fixed R'` row
          applies the same rule to R' = 1..R without exits, the baseline an exit must beat.
  fixed   the fixed-R' curve: ppl and gap vs full depth per R' = 1..2R, shared and unshared.
"""

from __future__ import annotations

import glob
import json
import os
import sys

REPORT = "depth_sweep.json"
LIMIT = 0.01  # The largest gap vs full depth (upper end of its 95% CI) a selected point may have.
# Report directories -> the model's name in the tables, in table order.
MODELS = {
  "default_pretrain": "default (stochastic depth), pretrained",
  "default_benice": "default, BeNice!",
  "fixed_pretrain": "`:fixed` (fixed depth), pretrained",
  "fixed_benice": "`:fixed`, BeNice!",
}
LAYOUTS = ("shared", "unshared")


def load(root: str) -> dict[str, dict]:
  """{directory name: report} of every root/*/depth_sweep.json, in MODELS' order (others after,
  by name)."""
  found = {}
  for path in sorted(glob.glob(os.path.join(root, "*", REPORT))):
    with open(path) as f:
      found[os.path.basename(os.path.dirname(path))] = json.load(f)
  order = [m for m in MODELS if m in found] + sorted(set(found) - set(MODELS))
  return {name: found[name] for name in order}


def label(name: str) -> str:
  return MODELS.get(name, name)


def select(points: dict[str, dict], limit: float = LIMIT) -> tuple[str, dict] | None:
  """(key, point) of the point with the fewest mean recurrences among those whose gap's CI upper
  end is <= limit; ties: the smaller gap, then the smaller key value. None if no point is."""
  within = [(k, p) for k, p in points.items() if p["gap_vs_full_depth_ci95"][1] <= limit]
  if not within:
    return None
  rank = lambda kp: (kp[1]["mean_recurrences"], kp[1]["gap_vs_full_depth"], _number(kp[0]))
  return min(within, key=rank)


def _number(key: str) -> float:
  """A point key's value: R' ('3') or threshold ('kl@0.001')."""
  return float(key.rpartition("@")[2])


def by_criterion(exits: dict[str, dict]) -> dict[str, dict[str, dict]]:
  """A layout's exit points {criterion@threshold: point} grouped by criterion, in report order."""
  out: dict[str, dict[str, dict]] = {}
  for key, point in exits.items():
    out.setdefault(key.rpartition("@")[0], {})[key] = point
  return out


def gap(point: dict) -> str:
  """'+0.12% [-0.03, +0.27]': a gap vs full depth and its 95% CI, in percent."""
  lo, hi = point["gap_vs_full_depth_ci95"]
  return f"{100 * point['gap_vs_full_depth']:+.2f}% [{100 * lo:+.2f}, {100 * hi:+.2f}]"


def recurrences(point: dict) -> str:
  lo, hi = point["mean_recurrences_ci95"]
  return f"{point['mean_recurrences']:.2f} [{lo:.2f}, {hi:.2f}]"


def _row(model: str, layout: str, what: str, r: int, chosen, grid: int) -> str:
  """One row of the exits table; chosen: select()'s answer."""
  if chosen is None:
    return f"| {model} | {layout} | {what} | none of {grid} within +{100 * LIMIT:g}% | | | | |"
  key, p = chosen
  saved = 1 - p["mean_recurrences"] / r
  return (
    f"| {model} | {layout} | {what} | {key.rpartition('@')[2]} | {recurrences(p)} | "
    f"{100 * saved:.0f}% | {p['ppl']:.3f} | {gap(p)} |"
  )


def exits_table(reports: dict[str, dict]) -> str:
  """Table (a): the module docstring's `exits`."""
  lines = [
    "| model | layout | criterion | threshold (or R') | mean recurrences [95% CI] | "
    "compute saved vs R | ppl | gap vs full depth [95% CI] |",
    "|---|---|---|---:|---:|---:|---:|---:|",
  ]
  for name, rep in reports.items():
    r = rep["setup"]["num_recurrences"]
    for layout in LAYOUTS:
      fixed = {k: p for k, p in rep["fixed"][layout].items() if int(k) <= r}
      lines.append(_row(label(name), layout, "fixed R' (no exit)", r, select(fixed), len(fixed)))
      for criterion, points in by_criterion(rep["exits"][layout]).items():
        lines.append(_row(label(name), layout, criterion, r, select(points), len(points)))
  return "\n".join(lines)


def fixed_table(reports: dict[str, dict]) -> str:
  """Table (b): the module docstring's `fixed`."""
  lines = [
    "| model | R' | ppl shared | gap shared [95% CI] | ppl unshared | gap unshared [95% CI] |",
    "|---|---:|---:|---:|---:|---:|",
  ]
  for name, rep in reports.items():
    r = rep["setup"]["num_recurrences"]
    shared, unshared = (rep["fixed"][layout] for layout in LAYOUTS)
    for key in sorted(shared, key=int):
      s, u = shared[key], unshared.get(key)
      trained = " (trained)" if int(key) == r else ""
      cells = f"{u['ppl']:.3f} | {gap(u)}" if u else "missing | missing"
      lines.append(f"| {label(name)} | {key}{trained} | {s['ppl']:.3f} | {gap(s)} | {cells} |")
  return "\n".join(lines)


def setup_line(reports: dict[str, dict]) -> str:
  """What every report measured: rows, tokens, dates (for the page's prose)."""
  parts = []
  for name, rep in reports.items():
    s = rep["setup"]
    parts.append(
      f"{name}: {s['checkpoint']} step {s['step']}, {s['rows']} rows x {s['tokens_per_row']} "
      f"tokens, R = {s['num_recurrences']}, {rep.get('date', '?')}, jax {rep.get('jax_version')}"
    )
  return "\n".join(parts)


if __name__ == "__main__":
  found = load(sys.argv[1] if len(sys.argv) > 1 else "experiments/results/test_time_depth")
  print(setup_line(found), exits_table(found), fixed_table(found), sep="\n\n")
