r"""The quality-compute curve of test-time depth for one trained checkpoint (docs/results.md,
"Test-time depth: quality against compute").

  python experiments/test_time_depth.py --config=configs/benice.py:fixed \
      --checkpoint=RUNS/fixed_s0/pretrain --rows=128 \
      --out=experiments/results/test_time_depth/fixed_pretrain

On the first `--rows` eval rows (the evaluation's decode subset), by exact token-by-token decode
(docs/design.md §3, "Depth at test time"), shared and unshared:
  full_depth  each row's CE at the trained depth R: exact shared decode and the unshared forward,
              the references the evaluation's `depth` block uses (looped/benice/evaluation.py).
  fixed       every token runs R' = 1 .. max_factor x R recurrences.
  exits       each exit criterion (looped/model/adaptive.py) over a threshold grid, at most R
              recurrences per token.
Each point: ppl, its gap vs the same layout's full depth with a paired 95% bootstrap CI (rows
resampled), mean recurrences per token with its CI, each row's CE (nats summed over its tokens)
and, with exits, each row's recurrences summed over its tokens (for paired comparisons later).
One compiled decode per layout serves every point: R' and the exit settings are per-row data of
a model whose static loop length is max_factor x R (a looped model's params do not depend on its
loop count); `check` records how far its R' = R point is from the reference CE (float rounding
only).

The report (`--out`/depth_sweep.json) is written after every point, atomically, and a rerun
skips the points it holds (it refuses a report made with other settings). Paths outside the
repository are recorded as RUNS/<run>/<stage>.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # Run as a script from anywhere: the config files import `configs`.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from looped.benice import evaluation, stages  # noqa: E402
from looped.checkpoints import model_record, restore  # noqa: E402
from looped.data import pipeline as data_lib  # noqa: E402
from looped.losses import token_cross_entropy  # noqa: E402
from looped.model import adaptive, from_config  # noqa: E402
from looped.model.looped_lm import LoopedLM  # noqa: E402
from looped.model.sharing import decode_forward  # noqa: E402

REPORT = "depth_sweep.json"
VERSION = 1  # Bumped when a point's definition changes (a report of another version is refused).
LAYOUTS = {"shared": True, "unshared": False}
# Threshold grids, each from "(almost) never exits before R = 4" to "exits at its first possible
# check" (the definitions in looped/model/adaptive.py's docstring): decades from a probe of the
# default model's 150-step checkpoint on 16 rows, filled in where the `:fixed` model's exits
# moved between two of them; Huginn's default in each. Every model gets every threshold.
GRIDS = {
  "entropy-diff": (1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0),
  "latent-diff": (0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 1.0, 3.0),
  "kl": (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 10.0),
  "minp-kl": (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0),
  "argmax-stability": (1.0, 2.0, 3.0),
  "cosine": (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 1e-2, 0.1, 0.2, 0.3, 0.5, 1.0),
}


def portable(path: str) -> str:
  """A path as a kept report may name it: repo-relative, else RUNS/<parent>/<name>."""
  full = os.path.abspath(path)
  if full.startswith(_REPO + os.sep):
    return os.path.relpath(full, _REPO)
  return "RUNS/" + "/".join(full.rstrip(os.sep).split(os.sep)[-2:])


def load_config(spec: str):
  """configs/FILE.py:ARGS (as `python -m looped.main --config=` takes) -> its ConfigDict."""
  path, _, arg = spec.partition(":")
  if not os.path.isabs(path) and not os.path.exists(path):
    path = os.path.join(_REPO, path)
  loader = importlib.util.spec_from_file_location("depth_sweep_config", path)
  module = importlib.util.module_from_spec(loader)
  loader.loader.exec_module(module)
  return module.get_config(arg)


def grid_of(overrides: list[str]) -> dict[str, tuple[float, ...]]:
  """GRIDS with `criterion=t1,t2,...` overrides (an empty list drops the criterion)."""
  grids = dict(GRIDS)
  for item in overrides:
    name, _, values = item.partition("=")
    adaptive.criterion_index(name)  # ValueError for an unknown criterion.
    grids[name] = tuple(float(v) for v in values.split(",") if v)
  return {k: v for k, v in grids.items() if v}


@dataclasses.dataclass(frozen=True)
class _TracedDepth:
  """decode_forward's `depth` with traced settings, so one compilation serves every point:
  `recurrences` is the loop's static length, `values` the per-call scalars."""

  recurrences: int
  values: dict

  def inputs(self, batch, d_model, recurrences, prompt, state_BxD=None):
    del recurrences, prompt, state_BxD  # No prefill call and no warm start in this sweep.
    v = self.values
    full = lambda x, dtype: jnp.broadcast_to(jnp.asarray(x, dtype), (batch,))
    return adaptive.DepthInputs(
      full(v["recurrences"], jnp.int32),
      full(v["criterion"], jnp.int32),
      full(v["threshold"], jnp.float32),
      full(v["min_recurrences"], jnp.int32),
      full(v["check_every"], jnp.int32),
      full(1.0, jnp.float32),
      full(False, bool),
      jnp.zeros((batch, d_model), jnp.float32),
    )


def make_sweep_fn(cfg, exit_lookup: str):
  """Jitted (params, inputs, targets, segments, values, share_kv (static)) -> (CE per row,
  recurrences per row summed over tokens); cfg's num_recurrences is the loop's length."""
  model = LoopedLM(cfg)

  def decode(params, inputs_BxT, targets_BxT, segments_BxT, values, share_kv):
    logits, cache = decode_forward(
      model,
      params,
      inputs_BxT,
      share_kv=share_kv,
      segment_ids_BxT=segments_BxT,
      depth=_TracedDepth(cfg.num_recurrences, values),
      exit_lookup=exit_lookup,
    )
    ce_B = jnp.sum(token_cross_entropy(logits, targets_BxT), axis=1)
    return ce_B, jnp.sum(cache.depth_BxS, axis=1)

  return jax.jit(decode, static_argnums=5)


def point_values(recurrences: int, criterion: str, threshold: float, args) -> dict:
  return {
    "recurrences": np.int32(recurrences),
    "criterion": np.int32(adaptive.criterion_index(criterion)),
    "threshold": np.float32(adaptive.threshold_of(criterion, threshold)),
    "min_recurrences": np.int32(args.min_recurrences),
    "check_every": np.int32(args.exit_every),
  }


def run_rows(fn, params, subset, group: int, *extra):
  """fn over the subset's rows, `group` rows per call: its outputs concatenated (float64)."""
  inputs, targets, segments = subset
  outs = []
  for start in range(0, len(inputs), group):
    part = slice(start, start + group)
    seg = None if segments is None else jnp.asarray(segments[part])
    out = fn(params, jnp.asarray(inputs[part]), jnp.asarray(targets[part]), seg, *extra)
    outs.append([np.asarray(x, np.float64) for x in (out if isinstance(out, tuple) else (out,))])
  return [np.concatenate(parts) for parts in zip(*outs)]


def full_depth(cfg, params, subset, group: int) -> dict:
  """Each row's CE at the trained depth: exact shared decode and the unshared forward (the
  evaluation's own functions)."""
  fns = evaluation.make_stats_fns(cfg)
  (shared,) = run_rows(fns.decode, params, subset, group)
  jacobi = lambda p, i, t, s: fns.jacobi(p, i, t, s, 1)[0][0]  # Pass 0: the unshared forward.
  (unshared,) = run_rows(jacobi, params, subset, group)
  return {"shared": shared, "unshared": unshared}


def summarize(ce, ran_sums, full_ce, tokens_per_row: int, seconds: float, exits: bool) -> dict:
  """One point of the report: ppl, gap vs full depth and mean recurrences, with 95% CIs; the
  per-row CE and (with exits) recurrences summed over the row's tokens."""
  ppl, ppl_full = evaluation._ppl(ce, tokens_per_row), evaluation._ppl(full_ce, tokens_per_row)
  ran = np.asarray(ran_sums, np.float64) / tokens_per_row
  point = {
    "ppl": ppl,
    "gap_vs_full_depth": ppl / ppl_full - 1.0,
    "gap_vs_full_depth_ci95": evaluation.gap_ci95(ce, full_ce, tokens_per_row),
    "mean_recurrences": float(ran.mean()),
    "mean_recurrences_ci95": evaluation._mean_ci95(ran),
    "seconds": round(seconds, 2),
    "ce_rows": rows_of(ce),
  }
  if exits:
    point["recurrence_sums"] = [int(round(x)) for x in ran_sums]
  return point


def rows_of(ce) -> list[float]:
  """Per-row CE (nats summed over the row) as kept: 0.01 nats is 1e-4 of a 128-token row's."""
  return [round(float(x), 2) for x in ce]


def write_atomic(path: str, report: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  tmp = f"{path}.tmp.{os.getpid()}"
  text = json.dumps(report, indent=1)
  # Lists of numbers on one line each (the per-row values), the rest one field a line.
  text = re.sub(r"\[\s+([-+0-9.eE,\s]+?)\s+\]", lambda m: f"[{' '.join(m[1].split())}]", text)
  with open(tmp, "w") as f:
    f.write(text + "\n")
  os.replace(tmp, path)


def plan(r: int, max_factor: int, grids: dict) -> list[tuple[str, str, str, int, str, float]]:
  """Every point as (section, layout, key, R', criterion, threshold): the fixed R' curve
  first, then each criterion's grid, alternating layouts so both fill in together."""
  out = []
  for rp in range(1, max_factor * r + 1):
    for layout in LAYOUTS:
      out.append(("fixed", layout, str(rp), rp, "none", 0.0))
  for criterion, grid in grids.items():
    for t in grid:
      for layout in LAYOUTS:
        out.append(("exits", layout, f"{criterion}@{t:g}", r, criterion, t))
  return out


def command_line(argv: list[str]) -> str:
  """The command as run, with paths outside the repository as RUNS/..."""
  words = []
  for word in argv:
    flag, eq, value = word.partition("=")
    if eq and flag in ("--checkpoint", "--out"):
      word = f"{flag}={portable(value)}"
    words.append(word)
  return "python experiments/test_time_depth.py " + " ".join(words)


def setup_of(args, cfg, step: int, tokens_per_row: int, grids: dict) -> dict:
  """What a report's points depend on: a rerun with other settings is refused."""
  return {
    "version": VERSION,
    "checkpoint": portable(args.checkpoint),
    "step": step,
    "config": args.config,
    "rows": args.rows,
    "tokens_per_row": tokens_per_row,
    "num_recurrences": cfg.num_recurrences,
    "max_recurrences": args.max_factor * cfg.num_recurrences,
    "exit_max_recurrences": cfg.num_recurrences,
    "exit_lookup": args.exit_lookup,
    "min_recurrences": args.min_recurrences,
    "exit_every": args.exit_every,
    "kv_policy": "final",
    "init_scale": 1.0,
    "exit_gate": cfg.exit_gate,
  }


def open_report(path: str, setup: dict) -> dict:
  """The report at path if it was made with `setup`, else a new one; SystemExit if it was made
  with other settings."""
  if os.path.exists(path):
    with open(path) as f:
      report = json.load(f)
    if report["setup"] != setup:
      changed = sorted(k for k in setup if report["setup"].get(k) != setup[k])
      sys.exit(f"{path} was made with other settings ({', '.join(changed)}); use another --out.")
    return report
  return {"setup": setup, "fixed": {k: {} for k in LAYOUTS}, "exits": {k: {} for k in LAYOUTS}}


def load_model(args):
  """(config, ModelConfig at the trained R, params, restored step) of the checkpoint."""
  config = load_config(args.config)
  model_cfg, data_cfg = model_record.model_and_data(config, args.checkpoint)
  config.model, config.data = model_cfg, data_cfg
  cfg = from_config(model_cfg)
  params = restore.restore_params(LoopedLM(cfg), args.checkpoint, -1, "checkpoint")
  return config, cfg, params, stages.latest_step(args.checkpoint)


def subset_rows(config, rows: int):
  """(inputs, targets, segment ids or None) of the first `rows` eval rows."""
  batches = data_lib.make_eval_batches(config, process_index=0, process_count=1)
  masked = "segment_ids" in batches[0]
  inputs, targets, segments = evaluation._stack_rows(batches, masked)
  if rows > len(inputs):
    sys.exit(f"--rows={rows}: the eval set has {len(inputs)} rows.")
  return inputs[:rows], targets[:rows], None if segments is None else segments[:rows]


def measure(args, argv: list[str]) -> dict:
  """Runs every point missing from the report at --out, saving after each; returns it."""
  config, cfg, params, step = load_model(args)
  subset = subset_rows(config, args.rows)
  t = int(subset[1].shape[1])
  grids = grid_of(args.thresholds)
  if not cfg.exit_gate:
    grids.pop("gate", None)
  path = os.path.join(args.out, REPORT)
  report = open_report(path, setup_of(args, cfg, step, t, grids))
  report.update(
    date=datetime.date.today().isoformat(),
    jax_version=jax.__version__,
    device=jax.devices()[0].device_kind,
    command=command_line(argv),
    grids={k: list(v) for k, v in grids.items()},
  )
  if not cfg.exit_gate:
    report["skipped"] = {"gate": "the model has no exit gate (model.exit_gate is false)"}
  group = args.decode_rows or args.rows
  start = time.time()
  full = full_depth(cfg, params, subset, group)
  report["full_depth"] = {
    k: {"ppl": evaluation._ppl(v, t), "ce_rows": rows_of(v)} for k, v in full.items()
  }
  print(f"full depth R={cfg.num_recurrences}: {time.time() - start:.1f} s", flush=True)
  big = dataclasses.replace(cfg, num_recurrences=args.max_factor * cfg.num_recurrences)
  fn = make_sweep_fn(big, args.exit_lookup)
  for point in plan(cfg.num_recurrences, args.max_factor, grids):
    run_point(report, point, fn, params, subset, group, full, args)
    write_atomic(path, report)
  return report


def run_point(report, point, fn, params, subset, group, full, args) -> None:
  """Measures one planned point unless the report holds it. At R' = R it also records `check`:
  the largest difference of a row's CE from the full-depth reference."""
  section, layout, key, rp, criterion, threshold = point
  if key in report[section][layout]:
    return
  start = time.time()
  values = point_values(rp, criterion, threshold, args)
  ce, ran_sums = run_rows(fn, params, subset, group, values, LAYOUTS[layout])
  t = int(subset[1].shape[1])
  p = summarize(ce, ran_sums, full[layout], t, time.time() - start, section == "exits")
  report[section][layout][key] = p
  if section == "fixed" and rp == report["setup"]["num_recurrences"]:
    report.setdefault("check", {})[layout] = float(np.max(np.abs(ce - full[layout])))
  lo, hi = p["gap_vs_full_depth_ci95"]
  print(
    f"{section} {layout} {key}: ppl {p['ppl']:.4f} gap {100 * p['gap_vs_full_depth']:+.2f}% "
    f"[{100 * lo:+.2f}, {100 * hi:+.2f}] recurrences {p['mean_recurrences']:.3f} "
    f"({p['seconds']:.1f} s)",
    flush=True,
  )


def parse(argv: list[str]) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", required=True, help="the pipeline's config, e.g. configs/benice.py")
  p.add_argument("--checkpoint", required=True, help="a pipeline stage dir, e.g. RUNS/x/pretrain")
  p.add_argument("--out", required=True, help="directory of the report (depth_sweep.json)")
  p.add_argument("--rows", type=int, default=16, help="eval rows measured (the first ones)")
  p.add_argument("--decode_rows", type=int, default=0, help="rows per decode call (0: all)")
  p.add_argument("--max_factor", type=int, default=2, help="fixed R' up to this many times R")
  p.add_argument("--exit_lookup", default=adaptive.DEFAULT_LOOKUP, choices=adaptive.LOOKUPS)
  p.add_argument("--min_recurrences", type=int, default=0, help="no exit before this many")
  p.add_argument("--exit_every", type=int, default=1, help="check every this many recurrences")
  p.add_argument(
    "--thresholds",
    nargs="*",
    default=[],
    help="criterion=t1,t2,... replacing its grid (criterion= drops it)",
  )
  return p.parse_args(argv)


if __name__ == "__main__":
  measure(parse(sys.argv[1:]), sys.argv[1:])
