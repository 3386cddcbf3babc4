r"""The sweep table of docs/results.md ("Where sharing breaks") from experiments/gap_sweep.sh runs,
one row per point.

  python experiments/gap_table.py /tmp/gap_runs                 # Markdown table on stdout
  python experiments/gap_table.py experiments/results/gap_sweep --json=/tmp/gap.json

Each argument is a directory of sweep points (one pipeline workdir each, or the copies kept in
experiments/results/gap_sweep/: `POINT/pretrain/stage_config.json` and
`POINT/report/shareability.json`). A point's overrides are read from its pretraining config and
diffed against `configs/benice.py:zero_shot` at fixed depth, so the table names what each point
changed however the run was started. Fields a point's model does not use (the `kda_*` fields
of a model without KDA layers) are left out, so a later change of their defaults does not show
up as an override.
"""

from __future__ import annotations

import json
import os
import sys

from configs import benice
from looped.benice import report


def base_config() -> dict:
  """The pretraining fields every sweep point starts from (fixed depth)."""
  c = benice.get_config("zero_shot")
  return {"model": c.model.to_dict(), "train": c.train.to_dict(), "depth": {"sampler": "fixed"}}


def overrides(stage_config: dict, base: dict) -> list[str]:
  """`--config.model.x=v` for every pretraining field that differs from the base."""
  out = []
  model = stage_config["model"]
  stages = ("prelude_mixers", "core_mixers", "coda_mixers")
  uses_kda = any("kda" in model.get(stage, ()) for stage in stages)
  for section in ("model", "train", "depth"):
    for key, default in base[section].items():
      if section == "model" and key.startswith("kda_") and not uses_kda:
        continue
      value = stage_config[section].get(key, default)
      if (section, key) == ("model", "remat") and isinstance(value, bool):
        value = "full" if value else "none"  # Recorded before remat became a policy name.
      if (section, key) == ("model", "attention_impl") and (value, default) == ("xla", "auto"):
        value = "auto"  # Recorded before 'auto' was the default; on the CPU it ran, 'auto' is XLA.
      if isinstance(default, tuple):
        value = tuple(value)
      if value != default:
        out.append(f"--config.{section}.{key}={value}")
  return out


def load_point(path: str) -> dict:
  with open(os.path.join(path, "report", "shareability.json")) as f:
    shareability = json.load(f)
  m = shareability["models"]["zero_shot"]
  with open(os.path.join(path, "pretrain", "stage_config.json")) as f:
    stage_config = json.load(f)
  # The stage config leaves out the step count (a run may be extended); the report has it.
  stage_config["train"]["num_steps"] = shareability["stages"]["pretrain"]["step"]
  return {
    "point": os.path.basename(path.rstrip("/")),
    "overrides": overrides(stage_config, base_config()),
    "num_steps": stage_config["train"]["num_steps"],
    "num_recurrences": stage_config["model"]["num_recurrences"],
    **{
      k: m[k]
      for k in (
        "ppl_unshared_eval",
        "ppl_unshared_subset",
        "ppl_shared_exact_subset",
        "gap_exact",
        "gap_exact_ci95",
        "gap_jacobi_eval",
        "gap_jacobi_eval_ci95",
        "kv_drift",
        "residual_norms",
        "contraction_ratios",
        "decode_subset",
      )
    },
  }


def points(dirs: list[str]) -> list[dict]:
  out = []
  for d in dirs:
    for name in sorted(os.listdir(d)):
      path = os.path.join(d, name)
      if os.path.isfile(os.path.join(path, "report", "shareability.json")):
        out.append(load_point(path))
  if not out:
    raise SystemExit(
      f"gap_table: no finished sweep point (POINT/report/shareability.json) in {dirs}."
    )
  return sorted(out, key=lambda p: -p["gap_exact"])


def table(rows: list[dict]) -> str:
  f2 = lambda xs: " ".join(f"{x:.2f}" for x in xs)
  lines = [
    "| point | overrides (fixed depth, seed 0) | ppl unshared (eval) | gap exact [95% CI] | "
    "gap J4 (eval) [95% CI] | K drift r=1..R-1 (core layer 0) | V drift r=1..R-1 | "
    "residual norms r=1..R | contraction r=2..R |",
    "|---|---|---:|---:|---:|---|---|---|---|",
  ]
  for p in rows:
    j4 = report.gap_with_ci(p["gap_jacobi_eval"]["4"], p["gap_jacobi_eval_ci95"]["4"])
    lines.append(
      f"| {p['point']} | {' '.join(f'`{o}`' for o in p['overrides']) or '(base)'} | "
      f"{p['ppl_unshared_eval']:.3f} | {report.gap_with_ci(p['gap_exact'], p['gap_exact_ci95'])} | "
      f"{j4} | {f2(p['kv_drift']['k'][0][:-1])} | {f2(p['kv_drift']['v'][0][:-1])} | "
      f"{' '.join(f'{x:.1f}' for x in p['residual_norms'])} | {f2(p['contraction_ratios'])} |"
    )
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  out = [a[len("--json=") :] for a in argv if a.startswith("--json=")]
  dirs = [a for a in argv if not a.startswith("--")]
  if not dirs or len(dirs) + len(out) != len(argv):
    raise SystemExit(__doc__)
  rows = points(dirs)
  print(table(rows))
  if out:
    with open(out[0], "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])
