r"""One Markdown table over many pipeline runs (seeds, arms, ablations), with per-group means.

  python -m looped.benice.collect /tmp/benice_runs/*_s[0-9]
  python -m looped.benice.collect --models=benice /tmp/benice_runs/abl_*_s[0-9]

Each argument is a pipeline workdir (or its report/shareability.json); `--models=a,b` keeps only
those models. Runs whose names differ only in a trailing `_s<seed>` form a group; the table
lists every run and model, each gap with its 95% interval, then each group's mean with its spread
(max - min over seeds) in brackets and, for every gap, the widest 95% half-width of its seeds
(one seed: its interval). Block prefill gaps (`gap block C=`) appear when any report has them; a
report evaluated without them shows `missing` there (rerun its pipeline to evaluate them).
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

from looped.benice import report

COLUMNS = ("ppl_unshared_eval", "ppl_unshared_subset", "ppl_shared_exact_subset", "gap_exact")


def load(path: str) -> dict:
  if os.path.isdir(path):
    path = os.path.join(path, "report", "shareability.json")
  if not os.path.isfile(path):
    raise SystemExit(f"collect: no report at {path} (has that pipeline run finished?)")
  with open(path) as f:
    try:
      report = json.load(f)
    except json.JSONDecodeError as e:
      raise SystemExit(f"collect: {path} is not a shareability report ({e})") from None
  if not isinstance(report, dict) or "models" not in report:
    raise SystemExit(f"collect: {path} is not a shareability report (no 'models')")
  return report


def _run_name(path: str) -> str:
  path = path.rstrip("/")
  if path.endswith(".json"):
    path = os.path.dirname(os.path.dirname(path))
  return os.path.basename(path)


def _group(name: str) -> str:
  return re.sub(r"_s\d+$", "", name)


def rows(paths: list[str], models: tuple[str, ...] = ()) -> list[dict]:
  """One row per (run, model): headline numbers and the gap at every Jacobi pass count."""
  out = []
  for path in paths:
    report = load(path)
    for model, m in report["models"].items():
      if models and model not in models:
        continue
      out.append(
        {
          "run": _run_name(path),
          "model": model,
          **{k: m[k] for k in COLUMNS},
          "gap_exact_ci95": m["gap_exact_ci95"],
          "gap_jacobi": {int(n): g for n, g in m["gap_jacobi_eval"].items()},
          "gap_jacobi_ci95": {int(n): ci for n, ci in m["gap_jacobi_eval_ci95"].items()},
          # Absent from reports evaluated before block prefill was: shown as missing.
          "gap_block": {int(c): g for c, g in m.get("gap_block", {}).items()},
          "gap_block_ci95": {int(c): ci for c, ci in m.get("gap_block_ci95", {}).items()},
          "contraction": m["contraction_ratios"],
          "k_drift_r1": [layer[0] for layer in m["kv_drift"]["k"]],
        }
      )
  return out


_pct = report.pct


def stat(values, fmt) -> str:
  """'mean (spread)' over seeds (max - min), or the one value; None entries are skipped."""
  values = [v for v in values if v is not None]
  if not values:
    return "-"
  mean, spread = float(np.mean(values)), float(np.ptp(values))
  return f"{fmt(mean)} ({fmt(spread).lstrip('+')})" if len(values) > 1 else fmt(mean)


def gap_stat(gaps, cis) -> str:
  """One seed: '+1.2% [+0.8, +1.6]'; several: '+1.2% (0.4%) ±0.5', mean (spread) and the
  widest 95% half-width among the seeds, in points."""
  pairs = [(g, ci) for g, ci in zip(gaps, cis) if g is not None]
  if not pairs:
    return "-"
  if len(pairs) == 1:
    return report.gap_with_ci(*pairs[0])
  half = max((ci[1] - ci[0]) / 2 for _, ci in pairs)
  return f"{stat([g for g, _ in pairs], _pct)} ±{100 * half:.1f}"


def _block_cell(row: dict, c: int) -> str:
  if c not in row["gap_block"]:
    return report.MISSING
  return report.gap_with_ci(row["gap_block"][c], row["gap_block_ci95"][c])


def table(paths: list[str], models: tuple[str, ...] = ()) -> str:
  """Per-run rows, then per-group means with the spread (max - min over seeds) in brackets."""
  rs = rows(paths, models)
  passes = sorted({n for r in rs for n in r["gap_jacobi"]})
  blocks = sorted({c for r in rs for c in r["gap_block"]})
  lines = [
    "| run | model | ppl unshared (eval) | ppl unshared (subset) | ppl shared exact (subset) | "
    "gap exact [95% CI] |"
    + "".join(f" gap block C={c} [95% CI] |" for c in blocks)
    + " "
    + " | ".join(f"gap J{n} [95% CI]" for n in passes)
    + " | contraction | K drift r=1 |",
    "|---|---|---|---|---|---|" + "---|" * (len(blocks) + len(passes)) + "---|---|",
  ]
  for r in rs:
    jacobi = " | ".join(
      report.gap_with_ci(r["gap_jacobi"][n], r["gap_jacobi_ci95"][n])
      if n in r["gap_jacobi"]
      else "-"
      for n in passes
    )
    lines.append(
      f"| {r['run']} | {r['model']} | {r['ppl_unshared_eval']:.3f} | "
      f"{r['ppl_unshared_subset']:.3f} | {r['ppl_shared_exact_subset']:.3f} | "
      f"{report.gap_with_ci(r['gap_exact'], r['gap_exact_ci95'])} | "
      + "".join(f"{_block_cell(r, c)} | " for c in blocks)
      + f"{jacobi} | "
      + " ".join(f"{c:.2f}" for c in r["contraction"])
      + " | "
      + " ".join(f"{c:.2f}" for c in r["k_drift_r1"])
      + " |"
    )
  groups: dict = {}
  for r in rs:
    groups.setdefault((_group(r["run"]), r["model"]), []).append(r)
  lines += [
    "",
    "| group | model | seeds | ppl unshared (eval) | ppl unshared (subset) | "
    "ppl shared exact (subset) | gap exact |"
    + "".join(f" gap block C={c} |" for c in blocks)
    + " "
    + " | ".join(f"gap J{n}" for n in passes)
    + " |",
    "|---|---|---|---|---|---|---|" + "---|" * (len(blocks) + len(passes)),
  ]

  f3 = lambda x: f"{x:.3f}"
  for (group, model), members in groups.items():
    cells = [
      stat([m[k] for m in members], f3)
      for k in ("ppl_unshared_eval", "ppl_unshared_subset", "ppl_shared_exact_subset")
    ]
    cells.append(
      gap_stat([m["gap_exact"] for m in members], [m["gap_exact_ci95"] for m in members])
    )
    # A seed without the block gap is missing from its group, not a zero in the mean.
    cells += [
      gap_stat([m["gap_block"][c] for m in members], [m["gap_block_ci95"][c] for m in members])
      if all(c in m["gap_block"] for m in members)
      else report.MISSING
      for c in blocks
    ]
    cells += [
      gap_stat(
        [m["gap_jacobi"].get(n) for m in members], [m["gap_jacobi_ci95"].get(n) for m in members]
      )
      for n in passes
    ]
    lines.append(f"| {group} | {model} | {len(members)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  models = tuple(m for a in argv if a.startswith("--models=") for m in a[9:].split(",") if m)
  paths = [a for a in argv if not a.startswith("--")]
  if not paths or any(a.startswith("--") and not a.startswith("--models=") for a in argv):
    raise SystemExit(__doc__)
  print(table(paths, models))


if __name__ == "__main__":
  main(sys.argv[1:])
