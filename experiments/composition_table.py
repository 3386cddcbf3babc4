r"""The composition table (docs/results.md, "Mixers: the composition table") from
experiments/composition.sh's pipeline runs.

  python experiments/composition_table.py /tmp/composition_runs/*_s[0-9]
  python experiments/composition_table.py experiments/results/composition/*_s[0-9]

Runs are named `<mixer>_<arm>_s<seed>` (arm: `poisson` or `fixed`). One row per arm, mixer and
model (zero-shot, standard finetune, BeNice!): the number of seeds, the unshared validation
perplexity (float32 cache), the exact-shared-decode gap with a float32 cache and through each
KV format, the 4-pass Jacobi gap on the whole eval set, what the nvfp4 cache costs the
unshared perplexity, and (BeNice! rows) BeNice!'s unshared perplexity against standard
finetune's of the same seed (the paper: "matching standard finetuning's unshared validation
perplexity"). Several seeds: mean (max - min) and the widest 95% half-width of the seeds
in points (looped.benice.collect); one seed: the gap with its 95% interval. Then, for the
`fixed` arm, each seed's exact gaps side by side.
"""

from __future__ import annotations

import os
import re
import sys

from looped.benice import collect

ARMS = ("fixed", "poisson")
MIXERS = ("gqa", "mla", "kda", "hybrid")
MODELS = ("zero_shot", "finetune", "benice")
FORMATS = ("bf16", "fp8", "nvfp4")
_NAME = re.compile(r"^(?P<mixer>[a-z]+)_(?P<arm>[a-z]+)_s(?P<seed>\d+)$")


def load_runs(paths: list[str]) -> dict:
  """{(arm, mixer): [report, ...]} over the run directories, in seed order (report["seed"])."""
  runs: dict = {}
  for path in paths:
    name = os.path.basename(path.rstrip("/"))
    match = _NAME.match(name)
    if not match or match["arm"] not in ARMS or match["mixer"] not in MIXERS:
      raise SystemExit(f"composition_table: {path}: expected a <mixer>_<arm>_s<seed> run dir")
    report = {**collect.load(path), "seed": int(match["seed"])}
    runs.setdefault((match["arm"], match["mixer"]), []).append(report)
  return {key: sorted(reports, key=lambda r: r["seed"]) for key, reports in runs.items()}


def _gap(ms: list[dict], fmt: str | None = None) -> str:
  cells = [m if fmt is None else m.get("kv_formats", {}).get(fmt) for m in ms]
  cells = [c for c in cells if c is not None]
  return collect.gap_stat([c["gap_exact"] for c in cells], [c["gap_exact_ci95"] for c in cells])


def _jacobi(ms: list[dict], n: str = "4") -> str:
  return collect.gap_stat(
    [m["gap_jacobi_eval"].get(n) for m in ms], [m["gap_jacobi_eval_ci95"].get(n) for m in ms]
  )


def _nvfp4_cost(ms: list[dict]) -> str:
  """nvfp4 unshared ppl / float32-cache unshared ppl - 1, over seeds."""
  costs = [
    m["kv_formats"]["nvfp4"]["ppl_unshared_eval"] / m["ppl_unshared_eval"] - 1
    for m in ms
    if "nvfp4" in m.get("kv_formats", {})
  ]
  return collect.stat(costs, collect._pct)


def _gap_exact(report: dict, model: str) -> float | None:
  m = report["models"].get(model)
  return None if m is None else m["gap_exact"]


def _benice_vs_finetune(report: dict) -> float | None:
  ms = report["models"]
  if "benice" not in ms or "finetune" not in ms:
    return None
  return ms["benice"]["ppl_unshared_eval"] / ms["finetune"]["ppl_unshared_eval"] - 1


def _vs_finetune(reports: list[dict]) -> str:
  """BeNice! unshared ppl / finetune unshared ppl - 1, per seed, over seeds."""
  ratios = [_benice_vs_finetune(r) for r in reports]
  return collect.stat([x for x in ratios if x is not None], collect._pct)


def table(runs: dict) -> str:
  header = (
    "| arm | mixer | model | seeds | ppl unshared | gap exact (fp32 cache) | gap J4 (eval) | "
    + " | ".join(f"gap exact {f}" for f in FORMATS)
    + " | nvfp4 cost to unshared ppl | unshared ppl vs finetune |"
  )
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for arm in ARMS:
    for mixer in MIXERS:
      reports = runs.get((arm, mixer))
      if not reports:
        continue
      for model in MODELS:
        ms = [r["models"][model] for r in reports if model in r["models"]]
        if not ms:
          continue
        ppl = collect.stat([m["ppl_unshared_eval"] for m in ms], lambda x: f"{x:.3f}")
        cells = [ppl, _gap(ms), _jacobi(ms)] + [_gap(ms, f) for f in FORMATS] + [_nvfp4_cost(ms)]
        cells.append(_vs_finetune(reports) if model == "benice" else "-")
        lines.append(f"| {arm} | {mixer} | {model} | {len(ms)} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _per_seed(values: list) -> str:
  return " / ".join("-" if v is None else f"{100 * v:+.1f}" for v in values) + "%"


def per_seed_table(runs: dict, arm: str = "fixed") -> str:
  """One row per mixer of `arm`: each seed's exact gap (float32 cache) per model, " / "-joined."""
  seeds = sorted({r["seed"] for (a, _), reports in runs.items() if a == arm for r in reports})
  if not seeds:
    return ""
  names = {"zero_shot": "zero-shot", "finetune": "standard finetune", "benice": "BeNice!"}
  header = (
    f"| mixer ({arm}; seed {' / '.join(map(str, seeds))}) | "
    + " | ".join(names[m] for m in MODELS)
    + " | BeNice! unshared ppl vs finetune |"
  )
  lines = [header, "|" + "---|" * (header.count("|") - 1)]
  for mixer in MIXERS:
    by_seed = {r["seed"]: r for r in runs.get((arm, mixer), [])}
    if not by_seed:
      continue
    row = [by_seed.get(s) for s in seeds]  # None where a seed did not run.
    cells = [_per_seed([None if r is None else _gap_exact(r, m) for r in row]) for m in MODELS]
    cells.append(_per_seed([None if r is None else _benice_vs_finetune(r) for r in row]))
    lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if not argv or any(a.startswith("-") for a in argv):
    raise SystemExit(__doc__)
  runs = load_runs(argv)
  print(table(runs))
  per_seed = per_seed_table(runs)
  if per_seed:
    print("\nPer seed, exact gap with a float32 cache:\n")
    print(per_seed)


if __name__ == "__main__":
  main(sys.argv[1:])
