r"""The BeNice! recipe sweep table (experiments/recipe.sh) from its pipeline reports.

  python experiments/recipe_table.py /tmp/recipe
  python experiments/recipe_table.py experiments/results/recipe
  python experiments/recipe_table.py --curves experiments/results/recipe_curves/curves_s0

With --curves, the learning-curve table instead: finetune and BeNice! side by side per step,
from the `curves.json` that `python -m looped.benice.curves --out=DIR` wrote.

The directory holds `base_s<seed>` (the `:fixed` pipeline's zero-shot and finetune models) and
`<point>_s<seed>` runs (`default`: BeNice! as configured). A point's BeNice! model is compared
with the zero-shot model of its seed's base and with the standard finetune trained beside it (a
`steps<N>` point) or else base's (same steps, data and optimizer). The change column is read
from the reports' settings (what differs from base's), so it cannot disagree with what ran.
Per seed, the three targets:
  gap <= 1/5 zero-shot   BeNice!'s exact gap at most a fifth of the zero-shot gap, with its
                         95% interval below a quarter of it;
  < finetune             BeNice!'s exact gap below standard finetuning's;
  ppl within 1%          BeNice!'s unshared ppl at most 1% above standard finetuning's.
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

SETTINGS = ("benice", "post_depth", "post_train")


def load_runs(root: str) -> dict[tuple[str, int], dict]:
  """(point, seed) -> report, for every `<point>_s<seed>/report/shareability.json` in root."""
  out = {}
  for name in sorted(os.listdir(root)):
    match = re.fullmatch(r"(.+)_s(\d+)", name)
    path = os.path.join(root, name, "report", "shareability.json")
    if match and os.path.isfile(path):
      with open(path) as f:
        out[(match.group(1), int(match.group(2)))] = json.load(f)
  return out


def changes(run: dict, base: dict) -> str:
  """'section.field=value' for every setting that differs from base's."""
  out = []
  for section in SETTINGS:
    mine, theirs = run["settings"].get(section, {}), base["settings"].get(section, {})
    for key in sorted(set(mine) | set(theirs)):
      if section == "post_train" and key in ("checkpoint_every", "eval_every", "log_every"):
        continue  # Cadence: does not change what is computed.
      if mine.get(key) != theirs.get(key):
        out.append(f"{section}.{key}={mine.get(key)}")
  return " ".join(out) or "(the configured recipe)"


def _steps(report: dict):
  return report["settings"].get("post_train", {}).get("num_steps")


def seed_row(run: dict, base: dict) -> dict | None:
  """One seed of one point: BeNice!'s gap against zero-shot's and finetune's, and its ppl.
  None when the run has no finetune of its own and base's ran another number of steps (or
  the run does not record its steps): no fair baseline."""
  bn = run["models"]["benice"]
  ft = run["models"].get("finetune")
  if ft is None:
    if _steps(run) is None or _steps(run) != _steps(base):
      return None
    ft = base["models"]["finetune"]
  zs = base["models"]["zero_shot"]
  zero = zs["gap_exact"]
  return {
    "gap": bn["gap_exact"],
    "ci": bn["gap_exact_ci95"],
    "zero_shot_gap": zero,
    "finetune_gap": ft["gap_exact"],
    "ratio": bn["gap_exact"] / zero,
    "ppl_unshared": bn["ppl_unshared_eval"],
    "ppl_shared": bn.get("ppl_shared_exact_subset", float("nan")),
    "ppl_vs_finetune": bn["ppl_unshared_eval"] / ft["ppl_unshared_eval"] - 1.0,
    "fifth": bn["gap_exact"] <= zero / 5 and bn["gap_exact_ci95"][1] < zero / 4,
    "below_finetune": bn["gap_exact"] < ft["gap_exact"],
    "ppl_1pct": bn["ppl_unshared_eval"] <= 1.01 * ft["ppl_unshared_eval"],
  }


def rows(runs: dict) -> list[dict]:
  out = []
  # Runs without a BeNice! model (base, a lone finetune) are baselines, not points.
  points = {p for (p, _), run in runs.items() if "benice" in run["models"]} - {"base"}
  points = sorted(points, key=lambda p: (p != "default", p))
  for point in points:
    seeds = sorted(
      s
      for (p, s), run in runs.items()
      if p == point and "benice" in run["models"] and ("base", s) in runs
    )
    if not seeds:
      continue
    per_seed = {s: seed_row(runs[(point, s)], runs[("base", s)]) for s in seeds}
    per_seed = {s: v for s, v in per_seed.items() if v is not None}
    if not per_seed:
      continue
    seeds = sorted(per_seed)
    change = changes(runs[(point, seeds[0])], runs[("base", seeds[0])])
    out.append({"point": point, "change": change, "seeds": per_seed})
  return out


def _mean_spread(values, fmt) -> str:
  if len(values) == 1:
    return fmt(values[0])
  return f"{fmt(float(np.mean(values)))} ({fmt(float(np.ptp(values))).lstrip('+')})"


_pct = lambda x: f"{100 * x:+.1f}%"
_f3 = lambda x: f"{x:.3f}"


def markdown(table_rows: list[dict]) -> str:
  lines = [
    "| point | change from base | seeds | BeNice! gap exact, per seed [95% CI] | mean (spread) "
    "| / zero-shot gap | finetune gap | BeNice! ppl unshared / shared exact | unshared ppl vs "
    "finetune | targets met (fifth, < ft, ppl 1%) |",
    "|---|---|---|---|---:|---:|---:|---:|---:|---|",
  ]
  for r in table_rows:
    seeds = r["seeds"]
    per_seed = "; ".join(
      f"s{s} {_pct(v['gap'])} [{100 * v['ci'][0]:+.1f}, {100 * v['ci'][1]:+.1f}]"
      for s, v in seeds.items()
    )
    col = lambda k, fmt, seeds=seeds: _mean_spread([v[k] for v in seeds.values()], fmt)
    met = " ".join(
      f"s{s} " + "".join("y" if v[k] else "n" for k in ("fifth", "below_finetune", "ppl_1pct"))
      for s, v in seeds.items()
    )
    lines.append(
      f"| {r['point']} | {r['change']} | {len(seeds)} | {per_seed} | {col('gap', _pct)} | "
      f"{col('ratio', lambda x: f'{x:.2f}')} | {col('finetune_gap', _pct)} | "
      f"{col('ppl_unshared', _f3)} / {col('ppl_shared', _f3)} | "
      f"{col('ppl_vs_finetune', _pct)} | {met} |"
    )
  return "\n".join(lines)


def curves_table(curves_dir: str) -> str:
  """Per step: unshared ppl and exact gap (decode subset) of each arm, and BeNice!'s ppl over
  finetune's. Stages are told apart by their last path part (finetune, benice)."""
  with open(os.path.join(curves_dir, "curves.json")) as f:
    rows = json.load(f)["rows"]
  arms: dict = {}
  for r in rows:
    arms.setdefault(r["stage"].split("/")[-1], {})[r["step"]] = r
  ft, bn = arms["finetune"], arms["benice"]
  lines = [
    "| step | finetune ppl | BeNice! ppl | BeNice! / finetune ppl | finetune gap exact [95% CI] "
    "| BeNice! gap exact [95% CI] | exact-decode rows |",
    "|---:|---:|---:|---:|---:|---:|---:|",
  ]
  ci = lambda r: (
    f"{_pct(r['gap_exact'])} [{_pct(r['gap_exact_ci95'][0])[:-1]}, "
    + (f"{_pct(r['gap_exact_ci95'][1])[:-1]}]")
  )
  for step in sorted(set(ft) & set(bn)):
    a, b = ft[step], bn[step]
    lines.append(
      f"| {step} | {a['ppl_unshared_eval']:.3f} | {b['ppl_unshared_eval']:.3f} | "
      f"{_pct(b['ppl_unshared_eval'] / a['ppl_unshared_eval'] - 1)} | {ci(a)} | {ci(b)} | "
      f"{b['decode_rows']} |"
    )
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if len(argv) == 2 and argv[0] == "--curves":
    print(curves_table(argv[1]))
    return
  if len(argv) != 1 or not os.path.isdir(argv[0]):
    raise SystemExit(__doc__)
  runs = load_runs(argv[0])
  if not any(p == "base" for p, _ in runs):
    raise SystemExit(f"recipe_table: no finished base_s<seed> run in {argv[0]}")
  print(markdown(rows(runs)))


if __name__ == "__main__":
  main(sys.argv[1:])
