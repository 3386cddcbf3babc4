r"""Learning curves of post-training: the shareability of every kept checkpoint of a stage.

  python -m looped.benice.curves --out=W/report/curves W/finetune W/benice
  python -m looped.benice.curves --step_cost=benice=2.9 --out=... W/finetune W/benice

Each argument is a trainer directory of the BeNice! pipeline (it holds `stage_config.json`, the
effective config it was trained with). Every checkpoint it keeps (`post.train.keep_checkpoints`
and `checkpoint_every` set the points) is evaluated by `looped.benice.evaluation` on that
config's eval data: unshared ppl and the Jacobi gap over the whole eval set, and the exact shared
gap (token-by-token shared decode) with its 95% interval over the first `--decode_batches` eval
batches: a cheap curve; the pipeline's own evaluation of the final checkpoint decodes them all.

Results are cached per checkpoint in `STAGE/curve.jsonl`, one line per step with the settings it
was computed with; a rerun evaluates only checkpoints not yet there, so it can follow a run that
is still training, and a line torn by a kill is ignored (and recomputed). `--out` gets
`curves.json`, `curves.md` (a table per stage) and `curves.png` (gap and unshared ppl against
post-training step and against compute, in finetune-step units: `--step_cost=NAME=COST` gives a
stage's cost per step relative to a finetune step, measured by `benchmarks/benice_step.py`).
"""

from __future__ import annotations

import json
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from absl import app, flags, logging

from looped import data as data_lib
from looped import model as model_lib
from looped.benice import evaluation, report
from looped.checkpoints import checkpointing
from looped.model.looped_lm import LoopedLM

CURVE_FILE = "curve.jsonl"

_DECODE_BATCHES = flags.DEFINE_integer(
  "decode_batches", 2, "Eval batches in the exact-decode subset of each point (0: all)."
)
_JACOBI = flags.DEFINE_integer("jacobi_passes", 4, "Jacobi shared passes reported per point.")
_OUT = flags.DEFINE_string("out", "", "Directory for curves.{json,md,png} ('' = none).")
_STEP_COST = flags.DEFINE_multi_string(
  "step_cost", [], "NAME=COST: a stage's step cost in finetune steps (default 1), for the plot."
)


def stage_config(stage_dir: str) -> ml_collections.ConfigDict:
  path = os.path.join(stage_dir, "stage_config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{stage_dir} is not a pipeline stage (no stage_config.json).")
  with open(path) as f:
    recorded = json.load(f)
  recorded.pop("parent", None)
  return ml_collections.ConfigDict(recorded)


def checkpoint_steps(stage_dir: str) -> list[int]:
  """Finished checkpoint steps (Orbax writes into a temporary name and renames when done)."""
  directory = checkpointing.checkpoint_dir(stage_dir)
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())


def read_cache(path: str, key: dict) -> dict[int, dict]:
  """step -> metrics of the lines computed with `key`; torn or foreign lines are skipped."""
  out = {}
  if not os.path.exists(path):
    return out
  with open(path) as f:
    for line in f:
      try:
        entry = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(entry, dict) and entry.get("key") == key:
        out[int(entry["step"])] = entry["metrics"]
  return out


def _append(path: str, entry: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(entry) + "\n")
    f.flush()
    os.fsync(f.fileno())


def evaluate_stage(stage_dir: str, decode_batches: int, jacobi_passes: int) -> dict[int, dict]:
  """step -> evaluation metrics for every checkpoint of `stage_dir` (cached in curve.jsonl)."""
  cfg = stage_config(stage_dir)
  model = LoopedLM(model_lib.from_config(cfg.model))
  eval_batches = data_lib.make_eval_batches(cfg, process_index=0, process_count=1)
  key = json.loads(
    json.dumps(
      {
        "decode_batches": decode_batches,
        "jacobi_passes": jacobi_passes,
        "metrics_version": evaluation.METRICS_VERSION,
        "data": cfg.data.to_dict(),
      }
    )
  )
  path = os.path.join(stage_dir, CURVE_FILE)
  done = read_cache(path, key)
  todo = [s for s in checkpoint_steps(stage_dir) if s not in done]
  if not todo:
    return done
  dummy = jnp.zeros((1, cfg.data.seq_len), jnp.int32)
  abstract = nn.unbox(
    jax.eval_shape(lambda: {"params": model.init(jax.random.PRNGKey(0), dummy)["params"]})
  )
  fns = evaluation.make_stats_fns(model.cfg)
  for step in todo:
    start = time.time()
    params = checkpointing.restore_params(stage_dir, abstract, step=step)
    metrics = evaluation.evaluate(
      fns, model.cfg, params, eval_batches, (jacobi_passes,), decode_batches=decode_batches
    )
    metrics.pop("cache_bytes", None)
    _append(path, {"step": step, "key": key, "metrics": metrics})
    done[step] = metrics
    logging.info(
      "%s step %d: %s (%.0f s)", stage_dir, step, report.summary(metrics), time.time() - start
    )
  return done


def _name(stage_dir: str) -> str:
  """'run/benice' for WORKDIR/run/benice: the stage and the run it belongs to."""
  parts = os.path.abspath(stage_dir).rstrip("/").split(os.sep)
  return "/".join(parts[-2:])


def curve_rows(curves: dict[str, dict[int, dict]], jacobi_passes: int) -> list[dict]:
  rows = []
  for name, by_step in curves.items():
    for step in sorted(by_step):
      m = by_step[step]
      rows.append(
        {
          "stage": name,
          "step": step,
          "ppl_unshared_eval": m["ppl_unshared_eval"],
          "gap_exact": m["gap_exact"],
          "gap_exact_ci95": m["gap_exact_ci95"],
          "gap_jacobi_eval": m["gap_jacobi_eval"][str(jacobi_passes)],
          "gap_jacobi_eval_ci95": m["gap_jacobi_eval_ci95"][str(jacobi_passes)],
          "decode_rows": m["decode_subset"]["rows"],
        }
      )
  return rows


def markdown(rows: list[dict], jacobi_passes: int) -> str:
  lines = [
    f"| stage | step | ppl unshared (eval) | gap exact [95% CI] (rows) | gap J{jacobi_passes} "
    "(eval) [95% CI] |",
    "|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['stage']} | {r['step']} | {r['ppl_unshared_eval']:.3f} | "
      f"{report.gap_with_ci(r['gap_exact'], r['gap_exact_ci95'])} ({r['decode_rows']}) | "
      f"{report.gap_with_ci(r['gap_jacobi_eval'], r['gap_jacobi_eval_ci95'])} |"
    )
  return "\n".join(lines)


def plot(path: str, rows: list[dict], step_cost: dict[str, float]) -> None:
  """Exact gap (with its interval) and unshared ppl against step and against compute."""
  import numpy as np
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  fig = Figure(figsize=(11, 7))
  axes = fig.subplots(2, 2, sharey="row")
  for name in dict.fromkeys(r["stage"] for r in rows):
    rs = [r for r in rows if r["stage"] == name]
    step = np.array([r["step"] for r in rs], float)
    cost = step_cost.get(name.split("/")[-1], step_cost.get(name, 1.0))
    gap = 100 * np.array([r["gap_exact"] for r in rs])
    ci = 100 * np.array([r["gap_exact_ci95"] for r in rs])
    ppl = np.array([r["ppl_unshared_eval"] for r in rs])
    for col, x in enumerate((step, step * cost)):
      axes[0, col].errorbar(x, gap, yerr=[gap - ci[:, 0], ci[:, 1] - gap], marker="o", label=name)
      axes[1, col].plot(x, ppl, marker="o", label=name)
  for col, xlabel in enumerate(("post-training step", "compute (finetune-step equivalents)")):
    axes[0, col].set(xlabel=xlabel, ylabel="exact shared gap (%)")
    axes[1, col].set(xlabel=xlabel, ylabel="unshared ppl (eval)")
    for ax in axes[:, col]:
      ax.grid(alpha=0.3)
      ax.legend(fontsize=7)
  axes[0, 0].set_title("Exact shared gap, 95% interval (decode subset)")
  axes[0, 1].set_title("... against compute")
  FigureCanvasAgg(fig)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _parse_costs(specs: list[str]) -> dict[str, float]:
  out = {}
  for spec in specs:
    name, sep, value = spec.partition("=")
    try:
      out[name] = float(value)
    except ValueError:
      sep = ""
    if not sep or not name or out[name] <= 0:
      raise app.UsageError(f"--step_cost={spec!r}: expected NAME=COST with COST > 0")
  return out


def main(argv):
  dirs = argv[1:]
  if not dirs:
    raise app.UsageError("give one or more stage directories (e.g. WORKDIR/benice)")
  costs = _parse_costs(_STEP_COST.value)
  for d in dirs:
    if not os.path.isfile(os.path.join(d, "stage_config.json")):
      sys.exit(f"curves: {d} is not a pipeline stage directory (no stage_config.json)")
    if not checkpoint_steps(d):
      sys.exit(f"curves: {d} has no finished checkpoint yet")
  curves = {_name(d): evaluate_stage(d, _DECODE_BATCHES.value, _JACOBI.value) for d in dirs}
  rows = curve_rows(curves, _JACOBI.value)
  table = markdown(rows, _JACOBI.value)
  print(table, flush=True)
  if _OUT.value:
    os.makedirs(_OUT.value, exist_ok=True)
    with open(os.path.join(_OUT.value, "curves.json"), "w") as f:
      json.dump({"rows": rows, "step_cost": costs, "versions": report.versions()}, f, indent=1)
    with open(os.path.join(_OUT.value, "curves.md"), "w") as f:
      f.write(table + "\n")
    plot(os.path.join(_OUT.value, "curves.png"), rows, costs)


if __name__ == "__main__":
  app.run(main)
