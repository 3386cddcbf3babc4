r"""Generation engine on this machine: throughput, step times, and the simulator's cost model
calibrated on them.

  taskset -c 1 python benchmarks/engine.py --out=/tmp/engine_bench.json \
      --hardware_out=/tmp/cpu_hw.json
  python benchmarks/engine.py --requests=8 --reps=3 --grid_layouts unshared   # quicker
  python benchmarks/engine.py --skip_grid --block_sweep 16 32 64 --out=/tmp/engine_tput.json
  python benchmarks/engine.py --skip_grid --before=50d9b9d --out=/tmp/engine_before_after.json

Model: configs/pretrain.py's default (d 128, P/B/C = 1/2/1, R = 4, 4 query / 2 KV heads of 32),
or with --variant the model of configs/benice.py with those variants (the shape a pipeline
trains and a server serves, e.g. `ctx1024,fixed`: P/B/C = 0/2/0); random weights (speed does
not depend on them), float32, KV pages of 16 tokens.

1. Throughput (tokens/s over the steps' wall time, each workload run once to compile and then
   timed --throughput_reps times: median busy time, per-step median) of two workloads, batched
   (max_num_seqs 8) vs one request at a time (max_num_seqs 1), shared vs unshared at the same
   KV budget: "mixed" (the docs/results.md table: a shared 32-token prefix plus 16-48 own
   tokens, --new_tokens greedy tokens, all arriving at once, --budget_bytes) and
   "prefill_heavy" (160-224-token prompts, 4 new tokens, a budget with room for all). Beside
   generated tokens/s: the engine's tokens/s (prompt and decode tokens the steps computed), as
   a fraction of the model's batched parallel forward measured in the same run (what this
   machine computes for the model when nothing is paged), and the padding waste (tokens the
   padded calls compute / tokens needed, median over steps). --block_sweep repeats the shared
   batched runs at other prefill blocks.
2. Step times over a grid of batch shapes (rows x new tokens per row x context per row) for each
   layout in --grid_layouts (shared or not, raw pages or a KV format; every chunk one call,
   padded to powers of two, as the fit prices it). Skipped with --skip_grid.
   One pass compiles every shape; then --reps passes, each over all shapes of all layouts in a
   fresh random order, so slow drift in the machine's load hits every shape alike; the median
   per shape is kept. XLA runs one thread (XLA_FLAGS, unless set), for a run pinned to one core.
3. Fit of the cost model to the grid, in four forms: what is priced (the scheduler's batch,
   cost_model.py, or the engine's padded step, engine_cost.py, with a seconds-per-dequantized-
   value term for each KV format in the grid) x how compute and memory time combine (max or
   sum). The fit minimises the squared relative error on the fit shapes; a third
   of each layout's grid, interleaved (index sum of rows, tokens, context = 1 mod 3, so every
   value and no corner is held out), is held out. The profile written with --hardware_out (and
   the replay) is the engine/sum form, chosen before measuring: on a CPU the terms add, and the
   engine computes its padded step.
4. Replay: the scheduler with the fitted engine pricing on workload 1's requests (the schedule
   does not depend on time, all requests arrive at once, so the steps are the engine's), predicted
   vs measured busy time and the median per-step error.
5. Before and after (--before=REV): the engine of an earlier commit on the "mixed" workload, in
   the same run: that commit's tree (`git archive`, so the clone needs its history) runs its own
   benchmarks/engine.py in a subprocess with these workload flags, --before_runs times, the first
   before this engine's throughput and the others after it, so a drift in the machine's load
   shows as a spread between them. 50d9b9d is the engine before block prefill and split calls
   (shared chunks token by token, every step padded to rows x its longest chunk).
6. Test-time depth (--depth_sweep, benchmarks/engine_depth.py): the step's recurrence loop
   against the alternatives, and tokens/s against mean recurrences per token at batch 1 and 8,
   shared and unshared, beside the ideal speed-up.
7. Self-speculative decoding (--speculative_sweep --checkpoint=STAGE_DIR [--variant=...],
   benchmarks/engine_speculative.py): on a trained model and eval-text prompts, decode tokens/s
   with and without speculation at batch 1 and 8, shared and unshared, over draft depths and
   lookaheads, with the acceptance rate, tokens per round and agreement with plain decoding.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from scipy import optimize

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
# One XLA thread: pinned to one core (taskset), XLA's default thread pool makes large ops wait for
# threads that share that core (a 1-row step after 150 tokens took 9.0 ms instead of 5.5).
os.environ.setdefault(
  "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks import engine_depth, engine_speculative  # noqa: E402
from configs import benice, pretrain  # noqa: E402
from looped.checkpoints import model_record, restore  # noqa: E402
from looped.engine import padding  # noqa: E402
from looped.engine.engine import Engine, EngineConfig, pages_for_budget  # noqa: E402
from looped.engine.executor import ModelExecutor, powers_of_two  # noqa: E402
from looped.engine.requests import GenRequest  # noqa: E402
from looped.engine.sampling import SamplingParams  # noqa: E402
from looped.model import config as model_lib  # noqa: E402
from looped.model import init_params  # noqa: E402
from looped.model.cache_layout import KVLayout  # noqa: E402
from looped.model.looped_lm import LoopedLM  # noqa: E402
from looped.scheduler import pages, replay, scheduler  # noqa: E402
from looped.sim import cost_model, engine_cost, hardware, shape  # noqa: E402

PAGE = 16
LAYOUTS = {
  "unshared": (False, None),
  "shared": (True, None),
  "unshared_bf16": (False, "bf16"),
  "shared_bf16": (True, "bf16"),
  "unshared_fp8": (False, "fp8"),
  "shared_fp8": (True, "fp8"),
  "unshared_nvfp4": (False, "nvfp4"),
  "shared_nvfp4": (True, "nvfp4"),
}
GRID_LAYOUTS = ["unshared", "shared", "unshared_fp8"]  # --grid_layouts' default.
FORMS = (("batch", "max"), ("batch", "sum"), ("engine", "max"), ("engine", "sum"))
CHOSEN = ("engine", "sum")


def _requests(n, new_tokens, seed=0):
  rng = np.random.default_rng(seed)
  prefix = list(rng.integers(0, 256, 32))
  out = []
  for i in range(n):
    own = list(rng.integers(0, 256, rng.integers(16, 49)))
    tokens = tuple(int(t) for t in prefix + own)
    out.append(GenRequest(i, tokens, SamplingParams(max_new_tokens=new_tokens)))
  return out


def _prefill_heavy(n, seed=0):
  """Long prompts (160-224 tokens, a shared 32-token prefix), 4 new tokens each."""
  rng = np.random.default_rng(seed)
  prefix = list(rng.integers(0, 256, 32))
  out = []
  for i in range(n):
    own = list(rng.integers(0, 256, rng.integers(128, 193)))
    tokens = tuple(int(t) for t in prefix + own)
    out.append(GenRequest(i, tokens, SamplingParams(max_new_tokens=4)))
  return out


def forward_limit(model, params, args) -> dict:
  """Tokens/s of the model's batched parallel forward (8 rows of 128 tokens, logits included):
  what this machine computes for this model when nothing is paged, padded or scheduled."""
  fwd = jax.jit(lambda p, t: model.apply(p, t)[0])
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (8, 128)), jnp.int32)
  jax.block_until_ready(fwd(params, tokens))
  times = []
  for _ in range(args.throughput_reps * 3):
    start = time.perf_counter()
    jax.block_until_ready(fwd(params, tokens))
    times.append(time.perf_counter() - start)
  s = float(np.median(times))
  return {"rows": 8, "tokens": 128, "s": s, "tokens_per_s": 8 * 128 / s}


def throughput(model, params, workloads, args):
  """workloads: {name: (requests, KV budget in bytes)}."""
  rows = []
  for workload, (requests, budget) in workloads.items():
    for share in (False, True):
      rows += _throughput_layout(model, params, workload, requests, share, budget, args)
  return rows


def block_sweep(model, params, workloads, args):
  """Shared batched throughput of each workload at each prefill block in --block_sweep."""
  rows = []
  block = args.prefill_block
  for c in args.block_sweep:
    args.prefill_block = c
    for workload, (requests, budget) in workloads.items():
      for r in _throughput_layout(model, params, workload, requests, True, budget, args, (8,)):
        rows.append({**r, "prefill_block": c})
  args.prefill_block = block
  return rows


def _throughput_layout(model, params, workload, requests, share, budget, args, seat_counts=None):
  rows = []
  num_pages = pages_for_budget(model, budget, KVLayout(share, page_size=PAGE), args.max_num_seqs)
  for seqs in seat_counts or (args.max_num_seqs, 1):
    if True:
      engine = Engine(
        model,
        params,
        EngineConfig(
          share_kv=share,
          num_pages=num_pages,
          page_size=PAGE,
          max_num_batched_tokens=args.max_num_batched_tokens,
          max_num_seqs=seqs,
          prefill_block=args.prefill_block,
          max_model_len=args.max_model_len,
        ),
      )
      assert engine.executor.padding == _padding(args, seqs)  # What the replay prices.
      engine.generate(requests)  # Compiles every bucket this workload meets.
      busy, steps = [], []  # The schedule is the same every time: steps pair up across reps.
      for _ in range(args.throughput_reps):
        start = time.perf_counter()
        gens = engine.generate(requests)
        wall = time.perf_counter() - start
        s = engine.summary(gens)
        busy.append(s["busy_s"])
        log = engine.executor.step_log[-s["num_steps"] :]
        steps.append([e["s"] for e in log])
      s["busy_s"] = float(np.median(busy))
      s["tokens_per_s"] = s["generated_tokens"] / s["busy_s"]
      computed = sum(e["tokens"] for e in log)  # Prefill and decode tokens the steps needed.
      rows.append(
        {
          "workload": workload,
          "layout": "shared" if share else "unshared",
          "max_num_seqs": seqs,
          "num_pages": num_pages,
          "tokens": s["generated_tokens"],
          "busy_s": s["busy_s"],
          "wall_s": wall,
          "tokens_per_s": s["tokens_per_s"],
          "steps": s["num_steps"],
          "preemptions": s["preemptions"],
          "hit_rate": s["hit_rate"],
          "peak_pages": s["peak_pages_in_use"],
          "engine_tokens": computed,
          "engine_tokens_per_s": computed / s["busy_s"],
          "padding_waste": float(np.median([e["computed"] / e["tokens"] for e in log])),
          "busy_s_reps": busy,
          "step_s": [float(x) for x in np.median(np.asarray(steps), axis=0)],
        }
      )
      print(
        f"  {workload} {rows[-1]['layout']:8} seqs {seqs}: {s['tokens_per_s']:7.1f} tok/s, "
        f"{s['num_steps']} steps, {s['preemptions']} preemptions, hit {s['hit_rate']:.2f}, "
        f"waste {rows[-1]['padding_waste']:.2f}",
        flush=True,
      )
  return rows


def before_run(rev: str, args, index: int) -> list[dict]:
  """Throughput rows of the mixed workload measured by commit `rev`'s own engine benchmark."""
  commit = subprocess.run(
    ["git", "-C", _REPO, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
    capture_output=True,
    text=True,
  )
  if commit.returncode:
    raise SystemExit(f"--before={rev}: no such commit in {_REPO} (a shallow clone lacks history).")
  with tempfile.TemporaryDirectory() as tree:
    archive = subprocess.run(["git", "-C", _REPO, "archive", rev], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
    out = os.path.join(tree, "before.json")
    # Its grid cannot be skipped: the smallest one it fits (two shapes, one pass).
    flags = ["--grid_layouts", "unshared", "--grid_rows", "1", "--grid_tokens", "1", "6"]
    flags += ["--grid_context", "0", "--reps", "1", "--out", out]
    for name in ("requests", "new_tokens", "budget_bytes", "max_num_seqs"):
      flags += [f"--{name}", str(getattr(args, name))]
    for name in ("max_num_batched_tokens", "max_model_len", "throughput_reps"):
      flags += [f"--{name}", str(getattr(args, name))]
    env = {**os.environ, "PYTHONPATH": tree}  # Its own looped, ahead of the installed one.
    print(f"before ({rev}, run {index + 1}/{args.before_runs}):", flush=True)
    start = time.perf_counter()
    subprocess.run(
      [sys.executable, os.path.join(tree, "benchmarks", "engine.py"), *flags],
      env=env,
      cwd=tree,
      check=True,
    )
    with open(out) as f:
      rows = json.load(f)["throughput"]
  for r in rows:
    r.update(revision=rev, run=index, wall_s_total=time.perf_counter() - start)
  return rows


def report_before_after(before: list[dict], after: list[dict]) -> list[dict]:
  """Prints and returns, per layout and seat count, the mixed workload's tokens/s before (each
  run) and now, and the ratios the engine's acceptance reads."""
  now = {(r["layout"], r["max_num_seqs"]): r for r in after if r["workload"] == "mixed"}
  runs = sorted({r["run"] for r in before})
  head = " | ".join(f"before run {i + 1}" for i in runs)
  print(
    f"| layout | max_num_seqs | {head} | now | now / before (median) | steps before | steps now "
    "| padding waste now |"
  )
  print("|---|---:|" + "---:|" * (len(runs) + 5))
  table = []
  for key, r in now.items():
    old = [b for b in before if (b["layout"], b["max_num_seqs"]) == key]
    old_tps = [b["tokens_per_s"] for b in sorted(old, key=lambda b: b["run"])]
    ratio = r["tokens_per_s"] / float(np.median(old_tps))
    row = {
      "layout": key[0],
      "max_num_seqs": key[1],
      "before_tokens_per_s": old_tps,
      "tokens_per_s": r["tokens_per_s"],
      "ratio_to_before_median": ratio,
      "steps_before": [b["steps"] for b in old],
      "steps": r["steps"],
      "padding_waste": r["padding_waste"],
    }
    table.append(row)
    cells = " | ".join(f"{x:.1f}" for x in old_tps)
    print(
      f"| {key[0]} | {key[1]} | {cells} | {r['tokens_per_s']:.1f} | {ratio:.2f}x | "
      f"{'/'.join(str(s) for s in row['steps_before'])} | {r['steps']} | "
      f"{r['padding_waste']:.2f} |"
    )
  batched = {k[0]: v for k, v in now.items() if k[1] > 1}
  if {"shared", "unshared"} <= set(batched):
    print(
      f"shared batched / unshared batched now: "
      f"{batched['shared']['tokens_per_s'] / batched['unshared']['tokens_per_s']:.2f}x"
    )
  return table


def _grid_padding(args):
  """The grid's buckets (powers of two), which its pricing must pad to as well."""
  return padding.Padding.create(
    PAGE,
    powers_of_two(args.max_num_seqs),
    powers_of_two(args.max_num_batched_tokens),
    powers_of_two(-(-args.max_model_len // PAGE)),
    args.max_model_len,
  )


def _grid_shapes(args):
  """(rows, new tokens, context, one-token rows beside them, held out) for every grid point:
  with --grid_mixed, each chunk shape also with as many decoding rows beside it (two calls)."""
  out = []
  for i, b in enumerate(args.grid_rows):
    for j, q in enumerate(args.grid_tokens):
      for k, c in enumerate(args.grid_context):
        if c + q <= args.max_model_len:
          held = (i + j + k) % 3 == 1
          out.append((b, q, c, 0, held))
          if args.grid_mixed and q > 1:
            out.append((b, q, c, b, not held))
  return out


def step_grid(model, params, args):
  """Median step time per (layout, shape), repetitions interleaved in a random order."""
  items = []
  rng = np.random.default_rng(1)
  rid = 0
  per_row = -(-args.max_model_len // PAGE)  # Each row its own pages.
  for layout in args.grid_layouts:
    share, fmt = LAYOUTS[layout]
    executor = ModelExecutor(
      model,
      params,
      num_pages=args.pool_pages or 2 * args.max_num_seqs * per_row,
      layout=KVLayout(share, fmt, page_size=PAGE),
      padding=_grid_padding(args),
    )
    for b, q, c, d, held in _grid_shapes(args):
      seqs = []
      for i in range(b + d):
        n = c + (q if i < b else 1)
        tokens = tuple(int(t) for t in rng.integers(0, 256, n))
        request = GenRequest(rid, tokens, SamplingParams(max_new_tokens=1))
        rid += 1
        executor.add(request)
        seq = scheduler.Sequence(request, 0.0, num_tokens=n, num_computed=c)
        first = i * per_row % max(executor.scratch_page - per_row, 1)  # Within a small pool.
        seq.pages = list(range(first, first + -(-n // PAGE)))
        seqs.append(seq)
      row = {"layout": layout, "rows": b, "new_tokens": q, "context": c, "held_out": held}
      if d:
        row["decode_rows"] = d
      items.append((row, executor, _batch(row, seqs), []))
  start = time.perf_counter()
  for _, executor, batch, _ in items:  # Compiles every bucket.
    executor.execute(batch)
  print(f"  compiled {len(items)} shapes in {time.perf_counter() - start:.0f} s", flush=True)
  for rep in range(args.reps):
    start = time.perf_counter()
    for k in rng.permutation(len(items)):
      _, executor, batch, times = items[k]
      times.append(executor.execute(batch))
    print(f"  pass {rep + 1}/{args.reps}: {time.perf_counter() - start:.1f} s", flush=True)
  rows = []
  for row, _, _, times in items:
    row["s"] = float(np.median(times))
    row["spread"] = float((np.max(times) - np.min(times)) / row["s"])
    row["times_s"] = [float(t) for t in times]
    rows.append(row)
  return rows


def _batch(row, seqs=None):
  """The grid point's StepBatch: rows x new tokens at the context, then any decoding rows."""
  b, d, c = row["rows"], row.get("decode_rows", 0), row["context"]
  new = [row["new_tokens"]] * b + [1] * d
  return scheduler.StepBatch(seqs or [None] * (b + d), new, [c] * (b + d), b + d)


def _scheduler_config(args, max_num_seqs, share):
  """The Engine's scheduling rules for these limits."""
  return scheduler.SchedulerConfig(
    PAGE,
    args.max_num_batched_tokens,
    max_num_seqs,
    args.max_model_len,
    prefill_block=args.prefill_block,
    shared_blocks=share,
  )


def _padding(args, max_num_seqs):
  """The Engine's default buckets for these scheduler limits."""
  return padding.Padding.engine_default(_scheduler_config(args, max_num_seqs, False))


def _engine_pricer(model_shape, hw, layout, args, max_num_seqs=None):
  share, fmt = LAYOUTS[layout]
  pad = _padding(args, max_num_seqs or args.max_num_seqs)
  return engine_cost.EngineCostExecutor(
    model_shape, hw, pad, KVLayout(share, fmt), weight_format="fp32"
  )


def _formats(layouts) -> list[str]:
  """The KV formats among these layouts, in LAYOUTS' order: one dequantizing term each."""
  return list(dict.fromkeys(LAYOUTS[lay][1] for lay in layouts if LAYOUTS[lay][1]))


def features(model_shape, rows, pricing, args):
  """[1, model calls, FLOPs, bytes, values dequantized per format...] per measured step, as the
  given pricing counts them (the batch roofline has no per-call or dequantizing term)."""
  unit = hardware.Hardware("unit", 1.0, 1.0, 1.0, 0.0, "")
  formats = _formats(args.grid_layouts)
  out = []
  for r in rows:
    share, fmt = LAYOUTS[r["layout"]]
    dequant = [0.0] * len(formats)
    if pricing == "batch":
      ex = cost_model.CostModelExecutor(
        model_shape, unit, KVLayout(share, fmt or "bf16"), weight_format="fp32"
      )
      flops, moved = ex.terms(_batch(r))
      calls = 0
    else:
      ex = engine_cost.EngineCostExecutor(
        model_shape, unit, _grid_padding(args), KVLayout(share, fmt)
      )
      flops, moved, calls = ex.terms(_batch(r))
      if fmt:
        dequant[formats.index(fmt)] = ex.dequantized_values(_batch(r))
    out.append([1.0, calls, flops, moved, *dequant])
  return np.asarray(out)


def _nnls_rel(x, y):
  """Non-negative coefficients minimising sum(((x @ c) - y) / y)^2."""
  coef, _ = optimize.nnls(x / y[:, None], np.ones_like(y))
  return coef


_ADDED = [0, 1]  # Columns that add outside the roofline: step and call overhead (then dequant).


def fit_form(x, y, combine):
  """Coefficients (step overhead, call overhead, 1/peak, 1/bandwidth, seconds per dequantized
  value of each format), least relative error."""
  if combine == "sum":
    return _nnls_rel(x, y)
  added = _ADDED + list(range(4, x.shape[1]))
  best = (np.inf, None)  # max: grid over (peak, bandwidth), the added terms by NNLS on the rest.
  for inv_f in 1.0 / np.logspace(8, 13, 101):
    for inv_b in 1.0 / np.logspace(8, 12, 81):
      roof = np.maximum(x[:, 2] * inv_f, x[:, 3] * inv_b)
      rest = y - roof
      over, _ = optimize.nnls(x[:, added] / y[:, None], rest / y)
      err = np.sum(((x[:, added] @ over + roof) - y) ** 2 / y**2)
      if err < best[0]:
        best = (err, np.concatenate([over[:2], [inv_f, inv_b], over[2:]]))
  return best[1]


def predict(x, coef, combine):
  compute, memory = x[:, 2] * coef[2], x[:, 3] * coef[3]
  roof = compute + memory if combine == "sum" else np.maximum(compute, memory)
  return coef[0] + x[:, 1] * coef[1] + roof + x[:, 4:] @ coef[4:]


def _errors(rel, mask):
  """Median and max relative error over the masked shapes (NaN where there are none)."""
  if not mask.any():
    return {"median": float("nan"), "max": float("nan")}
  return {"median": float(np.median(rel[mask])), "max": float(np.max(rel[mask]))}


def fit(model_shape, rows, args):
  """Every form fitted on the fit shapes; errors on fit and held-out shapes, per layout too."""
  y = np.asarray([r["s"] for r in rows])
  held = np.asarray([r["held_out"] for r in rows])
  layouts = np.asarray([r["layout"] for r in rows])
  out = {}
  for pricing, combine in FORMS:
    x = features(model_shape, rows, pricing, args)
    coef = fit_form(x[~held], y[~held], combine)
    pred = predict(x, coef, combine)
    rel = np.abs(pred - y) / y
    name = f"{pricing}/{combine}"
    out[name] = {
      "step_overhead_s": float(coef[0]),
      "call_overhead_s": float(coef[1]),
      "peak_flops": 1 / max(float(coef[2]), 1e-30),  # 1e30: the term was fitted to zero.
      "mem_bandwidth": 1 / max(float(coef[3]), 1e-30),
      "dequant_s_per_value": dict(zip(_formats(args.grid_layouts), map(float, coef[4:]))),
      "fit": _errors(rel, ~held),
      "held_out": _errors(rel, held),
      "per_layout": {
        lay: {
          "fit": _errors(rel, ~held & (layouts == lay)),
          "held_out": _errors(rel, held & (layouts == lay)),
        }
        for lay in args.grid_layouts
      },
    }
    if (pricing, combine) == CHOSEN:
      for r, p in zip(rows, pred):
        r["predicted_s"] = float(p)
  return out


def fitted_profile(form):
  return dataclasses.replace(
    hardware.PROFILES["cpu_2core"],
    name="cpu_fitted",
    peak_flops=form["peak_flops"],
    mem_bandwidth=form["mem_bandwidth"],
    step_overhead_s=form["step_overhead_s"],
    call_overhead_s=form["call_overhead_s"],
    dequant_s_per_value=form["dequant_s_per_value"],
    combine="sum",
    pricing="engine",
    source="fitted by benchmarks/engine.py",
  )


class _Recorder:
  def __init__(self, inner):
    self.inner, self.times = inner, []

  def execute(self, batch):
    self.times.append(self.inner.execute(batch))
    return self.times[-1]


def replay_check(model_shape, hw, requests, run, args):
  """The simulator's scheduler, priced by the fitted engine model, on the measured workload."""
  pricer = _Recorder(_engine_pricer(model_shape, hw, run["layout"], args, run["max_num_seqs"]))
  share = LAYOUTS[run["layout"]][0]
  sched = scheduler.Scheduler(
    _scheduler_config(args, run["max_num_seqs"], share), pages.PagePool(run["num_pages"]), pricer
  )
  replay.replay(requests, sched)
  out = {
    "layout": run["layout"],
    "max_num_seqs": run["max_num_seqs"],
    "predicted_busy_s": sched.stats.busy_s,
    "measured_busy_s": run["busy_s"],
    "steps": sched.stats.num_steps,
    "measured_steps": run["steps"],
  }
  if len(pricer.times) == len(run["step_s"]):  # Same schedule: compare step by step.
    pred, meas = np.asarray(pricer.times), np.asarray(run["step_s"])
    out["median_step_rel_err"] = float(np.median(np.abs(pred - meas) / meas))
  return out


def _report_fit(model_shape, results, args):
  """Fits the cost model to the grid, prints the fits and the grid; returns the chosen
  profile."""
  results["fits"] = fit(model_shape, results["grid"], args)
  print("| priced | combine | fit median | fit max | held-out median | held-out max |")
  print("|---|---|---:|---:|---:|---:|")
  for name, f in results["fits"].items():
    print(
      f"| {name.replace('/', ' | ')} | {f['fit']['median']:.1%} | {f['fit']['max']:.1%} | "
      f"{f['held_out']['median']:.1%} | {f['held_out']['max']:.1%} |"
    )
  chosen = results["fits"]["/".join(CHOSEN)]
  hw = fitted_profile(chosen)
  print(
    f"engine/sum: step overhead {hw.step_overhead_s * 1e3:.2f} ms, per call "
    f"{hw.call_overhead_s * 1e3:.3f} ms, peak {hw.peak_flops:.3g} FLOP/s, bandwidth "
    f"{hw.mem_bandwidth:.3g} B/s"
    + "".join(f", {k} dequant {v * 1e9:.3g} ns/value" for k, v in hw.dequant_s_per_value.items()),
    flush=True,
  )
  for lay, e in chosen["per_layout"].items():
    print(
      f"  {lay}: fit median {e['fit']['median']:.1%} (max {e['fit']['max']:.1%}), held-out "
      f"median {e['held_out']['median']:.1%} (max {e['held_out']['max']:.1%})"
    )
  print("| layout | rows | new tokens | context | measured ms | predicted ms | spread | held out |")
  print("|---|---:|---:|---:|---:|---:|---:|---|")
  for r in results["grid"]:
    rows = f"{r['rows']} + {r['decode_rows']} x 1" if r.get("decode_rows") else r["rows"]
    print(
      f"| {r['layout']} | {rows} | {r['new_tokens']} | {r['context']} | "
      f"{r['s'] * 1e3:.2f} | {r['predicted_s'] * 1e3:.2f} | {r['spread']:.0%} | "
      f"{'yes' if r['held_out'] else ''} |"
    )
  if args.hardware_out:
    keys = ("peak_flops", "mem_bandwidth", "step_overhead_s", "call_overhead_s")
    profile = {k: getattr(hw, k) for k in keys}
    profile["dequant_s_per_value"] = dict(hw.dequant_s_per_value)
    with open(args.hardware_out, "w") as f:
      json.dump(profile, f)
  return hw


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=24)
  parser.add_argument("--budget_bytes", type=float, default=1.0e6, help="KV budget, both layouts.")
  parser.add_argument("--max_num_seqs", type=int, default=8)
  parser.add_argument("--max_num_batched_tokens", type=int, default=64)
  parser.add_argument("--max_model_len", type=int, default=256)
  parser.add_argument("--prefill_block", type=int, default=32, help="Engine prefill block.")
  parser.add_argument("--heavy_requests", type=int, default=16, help="Prefill-heavy workload.")
  parser.add_argument(
    "--block_sweep", type=int, nargs="*", default=[], help="Shared batched runs at these blocks."
  )
  parser.add_argument(
    "--heavy_budget_bytes", type=float, default=16e6, help="Its KV budget: room for all."
  )
  parser.add_argument("--grid_layouts", nargs="+", default=GRID_LAYOUTS, choices=list(LAYOUTS))
  parser.add_argument("--grid_rows", type=int, nargs="+", default=[1, 3, 5, 8])
  parser.add_argument("--grid_tokens", type=int, nargs="+", default=[1, 6, 24, 64])
  parser.add_argument("--grid_context", type=int, nargs="+", default=[0, 40, 150])
  parser.add_argument(
    "--pool_pages",
    type=int,
    default=0,
    help="The grid's pool size in pages (0: room for every row's own pages); a step's time "
    "should not depend on it.",
  )
  parser.add_argument(
    "--grid_mixed",
    action="store_true",
    help="Also time each chunk shape with as many one-token rows beside it (a two-call step).",
  )
  parser.add_argument("--reps", type=int, default=7)
  parser.add_argument("--throughput_reps", type=int, default=5, help="Timed runs (median).")
  parser.add_argument("--skip_throughput", action="store_true")
  parser.add_argument("--skip_grid", action="store_true", help="Throughput only (no fit).")
  parser.add_argument(
    "--before", default="", help="Also measure this commit's engine on the mixed workload."
  )
  parser.add_argument("--before_runs", type=int, default=2, help="Its runs: 1 before, rest after.")
  parser.add_argument(
    "--depth_sweep", action="store_true", help="Only part 6: test-time depth (engine_depth.py)."
  )
  parser.add_argument("--depth_context", type=int, default=200, help="Its loop steps' context.")
  parser.add_argument("--depth_new_tokens", type=int, default=48, help="Its tokens per request.")
  parser.add_argument(
    "--depth_criteria",
    nargs="*",
    default=["entropy-diff:0.01", "entropy-diff:0.1", "kl:0.05"],
    help="Its exit settings, criterion:threshold.",
  )
  parser.add_argument(
    "--speculative_sweep",
    action="store_true",
    help="Only part 7: self-speculative decoding (engine_speculative.py); needs --checkpoint.",
  )
  parser.add_argument(
    "--checkpoint", default="", help="Trained params (a stage dir) instead of random ones."
  )
  parser.add_argument("--spec_prompt_tokens", type=int, default=32, help="Its prompt length.")
  parser.add_argument("--spec_new_tokens", type=int, default=64, help="Its tokens per request.")
  parser.add_argument("--spec_drafts", type=int, nargs="+", default=[1, 2], help="Its r values.")
  parser.add_argument("--spec_lookahead", type=int, nargs="+", default=[2, 4, 8], help="Its k.")
  parser.add_argument("--out", default="", help="Write the results as JSON here.")
  parser.add_argument("--hardware_out", default="", help="Write the fitted profile (JSON) here.")
  parser.add_argument(
    "--refit",
    default="",
    help="No measurement: refit the grid of this --out JSON (its --grid_layouts rows) and "
    "replay its throughput runs with the new fit.",
  )
  parser.add_argument(
    "--variant",
    default="",
    help="Time configs/benice.py's model with these variants (e.g. ctx1024,fixed) instead of "
    "configs/pretrain.py's default.",
  )
  args = parser.parse_args()

  config = benice.get_config(args.variant) if args.variant else pretrain.get_config()
  if args.checkpoint:  # The checkpoint's own model (its record), at its own max_seq_len.
    config.model, config.data = model_record.model_and_data(config, args.checkpoint)
  else:
    config.model.max_seq_len = args.max_model_len
  cfg = model_lib.from_config(config.model)
  model = LoopedLM(cfg)
  params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  if args.checkpoint:
    params = restore.restore_params(model, args.checkpoint, -1, "checkpoint")
  model_shape = shape.ModelShape.from_config(dataclasses.asdict(cfg))
  requests = _requests(args.requests, args.new_tokens)
  results = {"device": str(jax.devices()[0]), "args": vars(args)}
  print(
    f"device {results['device']}; KV bytes/token shared "
    f"{KVLayout(True, None).bytes_per_token(cfg):.0f}, unshared "
    f"{KVLayout(False, None).bytes_per_token(cfg):.0f}; load average "
    f"{os.getloadavg()[0]:.1f}",
    flush=True,
  )
  if args.depth_sweep:
    return _depth(model, params, results, args)
  if args.speculative_sweep:
    if not args.checkpoint:
      parser.error("--speculative_sweep measures a trained model: give --checkpoint.")
    results["speculative_sweep"] = rows = engine_speculative.sweep(model, params, config, args)
    engine_speculative.print_table(rows)
    return _write(results, args)
  if args.before and (args.skip_throughput or args.refit):
    parser.error("--before compares throughput: drop --skip_throughput / --refit.")
  if args.before and args.before_runs < 1:
    parser.error("--before_runs must be >= 1.")
  before = before_run(args.before, args, 0) if args.before else []
  hw = None
  if args.refit:  # No measurement: the grid of an earlier run, restricted to --grid_layouts.
    with open(args.refit) as f:
      earlier = json.load(f)
    results["grid"] = [r for r in earlier["grid"] if r["layout"] in args.grid_layouts]
    args.skip_throughput = True
  elif not args.skip_grid:
    print(f"step grid ({', '.join(args.grid_layouts)}):", flush=True)
    results["grid"] = step_grid(model, params, args)
  if "grid" in results:
    hw = _report_fit(model_shape, results, args)
  runs = None
  if not args.skip_throughput:
    results["forward_limit"] = forward_limit(model, params, args)
    print(f"batched parallel forward: {results['forward_limit']['tokens_per_s']:.0f} tokens/s")
    print("throughput:", flush=True)
    workloads = {
      "mixed": (requests, args.budget_bytes),
      "prefill_heavy": (_prefill_heavy(args.heavy_requests), args.heavy_budget_bytes),
    }
    runs = throughput(model, params, workloads, args)
    if args.block_sweep:
      results["block_sweep"] = block_sweep(model, params, workloads, args)
      print("| prefill block | workload | tokens/s | engine tokens/s | padding waste | steps |")
      print("|---:|---|---:|---:|---:|---:|")
      for r in results["block_sweep"]:
        print(
          f"| {r['prefill_block']} | {r['workload']} | {r['tokens_per_s']:.1f} | "
          f"{r['engine_tokens_per_s']:.0f} | {r['padding_waste']:.2f} | {r['steps']} |"
        )
  elif args.refit and "throughput" in earlier:  # Replays the earlier run's measurements.
    runs = earlier["throughput"]
  if runs is not None:
    results["throughput"] = runs
    limit = results.get("forward_limit", {}).get("tokens_per_s")
    print(
      "| workload | layout | max_num_seqs | pages | tokens/s | engine tokens/s | of forward | "
      "padding waste | steps | preemptions | hit rate |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in runs:
      share = f"{r['engine_tokens_per_s'] / limit:.2f}" if limit else "n/a"
      print(
        f"| {r.get('workload', 'mixed')} | {r['layout']} | {r['max_num_seqs']} | "
        f"{r['num_pages']} | {r['tokens_per_s']:.1f} | {r.get('engine_tokens_per_s', 0):.0f} | "
        f"{share} | {r.get('padding_waste', 0):.2f} | {r['steps']} | {r['preemptions']} | "
        f"{r['hit_rate']:.2f} |"
      )
  if args.before:
    for i in range(1, args.before_runs):
      before += before_run(args.before, args, i)
    results["before"] = before
    results["before_after"] = report_before_after(before, runs)
  if runs is not None and hw is not None:
    mixed = [r for r in runs if r.get("workload", "mixed") == "mixed"]
    results["replay"] = [replay_check(model_shape, hw, requests, r, args) for r in mixed]
    print("| replay | max_num_seqs | predicted busy s | measured busy s | error | step median |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results["replay"]:
      err = r["predicted_busy_s"] / r["measured_busy_s"] - 1
      step = r.get("median_step_rel_err")
      print(
        f"| {r['layout']} | {r['max_num_seqs']} | {r['predicted_busy_s']:.3f} | "
        f"{r['measured_busy_s']:.3f} | {err:+.0%} | "
        f"{'n/a' if step is None else f'{step:.0%}'} |"
      )
  results["load_average_end"] = os.getloadavg()[0]
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


def _depth(model, params, results, args) -> None:
  """Part 6 alone (module docstring)."""
  print("recurrence loop:", flush=True)
  results["depth_loop"] = engine_depth.loop_design(model, params, args.depth_context, args.reps)
  print("depth sweep:", flush=True)
  results["depth_sweep"] = engine_depth.depth_sweep(model, params, args)
  engine_depth.print_tables(
    results["depth_loop"], results["depth_sweep"], model.cfg.num_recurrences
  )
  _write(results, args)


def _write(results, args) -> None:
  results["load_average_end"] = os.getloadavg()[0]
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
