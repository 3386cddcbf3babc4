r"""Generation engine on this machine: throughput, step times, and the simulator's cost model
calibrated on them.

  python benchmarks/engine.py --out=/tmp/engine_bench.json
  python benchmarks/engine.py --requests=8 --reps=3          # quicker

Model: configs/pretrain.py's default (d 128, P/B/C = 1/2/1, R = 4, 4 query / 2 KV heads of 32),
random weights (speed does not depend on them), float32, raw K/V pages of 16 tokens.

1. Throughput (tokens/s over the steps' wall time, each workload run once to compile and then
   timed): the same requests (a shared 32-token prefix plus 16-48 own tokens, greedy, fixed
   output length, all arriving at once) batched (max_num_seqs 8) vs one request at a time
   (max_num_seqs 1), shared vs unshared at the same KV budget.
2. Step times of the unshared layout (parallel prefill) over a grid of batch shapes (rows x new
   tokens per row x context per row), median of --reps runs after a compiling one.
3. Fit of looped/serving/cost_model.py's roofline (peak FLOP/s, bandwidth, step overhead: the
   `hardware` fields) to two thirds of the grid; median relative error on the held-out third
   (a random third, fixed seed).
   The fitted profile is written with --hardware_out (usable as sim.hardware_json), and the
   simulator replays workload 1's batched unshared run with it: predicted vs measured busy time.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from configs import pretrain  # noqa: E402
from looped.engine import paged_cache  # noqa: E402
from looped.engine.engine import Engine, pages_for_budget  # noqa: E402
from looped.engine.executor import ModelExecutor, powers_of_two  # noqa: E402
from looped.engine.requests import GenRequest  # noqa: E402
from looped.engine.sampling import SamplingParams  # noqa: E402
from looped.model import config as model_lib  # noqa: E402
from looped.model import init_params  # noqa: E402
from looped.model.looped_lm import LoopedLM  # noqa: E402
from looped.serving import cost_model, hardware, pages, replay, scheduler, shape  # noqa: E402

PAGE = 16


def _requests(n, new_tokens, seed=0):
  rng = np.random.default_rng(seed)
  prefix = list(rng.integers(0, 256, 32))
  out = []
  for i in range(n):
    own = list(rng.integers(0, 256, rng.integers(16, 49)))
    tokens = tuple(int(t) for t in prefix + own)
    out.append(GenRequest(i, tokens, SamplingParams(max_new_tokens=new_tokens)))
  return out


def throughput(model, params, requests, budget, args):
  rows = []
  for share in (False, True):
    num_pages = pages_for_budget(model, budget, PAGE, share, None)
    for seqs in (args.max_num_seqs, 1):
      engine = Engine(
        model,
        params,
        share_kv=share,
        num_pages=num_pages,
        page_size=PAGE,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=seqs,
        max_model_len=args.max_model_len,
      )
      engine.generate(requests)  # Compiles every bucket this workload meets.
      start = time.perf_counter()
      gens = engine.generate(requests)
      wall = time.perf_counter() - start
      s = engine.summary(gens)
      rows.append(
        {
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
        }
      )
      print(
        f"  {rows[-1]['layout']:8} seqs {seqs}: {s['tokens_per_s']:7.1f} tok/s, "
        f"{s['num_steps']} steps, {s['preemptions']} preemptions, hit {s['hit_rate']:.2f}",
        flush=True,
      )
  return rows


def step_grid(model, params, args):
  cfg = model.cfg
  executor = ModelExecutor(
    model,
    params,
    num_pages=256,
    page_size=PAGE,
    share_kv=False,
    kv_format=None,
    max_model_len=args.max_model_len,
    row_buckets=powers_of_two(args.max_num_seqs),
    token_buckets=powers_of_two(args.max_num_batched_tokens),
    column_buckets=powers_of_two(-(-args.max_model_len // PAGE)),
  )
  rng = np.random.default_rng(1)
  rows = []
  rid = 0
  for b in args.grid_rows:
    for q in args.grid_tokens:
      for c in args.grid_context:
        if b * q > args.max_num_batched_tokens * args.max_num_seqs or c + q > args.max_model_len:
          continue
        seqs = []
        for i in range(b):
          tokens = tuple(int(t) for t in rng.integers(0, 256, c + q))
          request = GenRequest(rid, tokens, SamplingParams(max_new_tokens=1))
          rid += 1
          executor.add(request)
          seq = scheduler.Sequence(request, 0.0, num_tokens=c + q, num_computed=c)
          seq.pages = list(range(i * 16, i * 16 + -(-(c + q) // PAGE)))
          seqs.append(seq)
        batch = scheduler.StepBatch(seqs, [q] * b, [c] * b, b)
        times = [executor.execute(batch) for _ in range(args.reps + 1)][1:]
        rows.append({"rows": b, "new_tokens": q, "context": c, "s": float(np.median(times))})
        print(f"  rows {b} x new {q:3d} after {c:3d}: {rows[-1]['s'] * 1e3:8.2f} ms", flush=True)
  del cfg
  return rows


def _terms(model_shape, rows):
  """FLOPs and bytes the cost model counts for each measured batch (unit hardware)."""
  flops_hw = hardware.Hardware("f", 1.0, 1e300, 1.0, 0.0, "")
  bytes_hw = hardware.Hardware("b", 1e300, 1.0, 1.0, 0.0, "")
  out = []
  for r in rows:
    fake = [None] * r["rows"]
    batch = scheduler.StepBatch(
      fake, [r["new_tokens"]] * r["rows"], [r["context"]] * r["rows"], r["rows"]
    )
    terms = []
    for hw in (flops_hw, bytes_hw):
      ex = cost_model.CostModelExecutor(
        model_shape, hw, share_kv=False, kv_format="bf16", weight_format="fp32"
      )
      terms.append(ex.execute(batch))
    out.append(terms)
  return np.asarray(out)


def fit(model_shape, rows):
  """Grid search in log space for (peak FLOP/s, bandwidth, overhead), least squared log error
  on the training shapes; returns the profile and train/held-out errors."""
  terms = _terms(model_shape, rows)
  measured = np.asarray([r["s"] for r in rows])
  # A random third (fixed seed) is held out, so every rows/tokens/context value is in both sets.
  held = np.zeros(len(rows), bool)
  held[np.random.default_rng(0).permutation(len(rows))[: len(rows) // 3]] = True
  train = ~held
  peaks = np.logspace(8, 13, 61)
  bws = np.logspace(8, 12, 49)
  overheads = np.concatenate([[0.0], np.logspace(-5, -1, 41)])
  f, by = terms[:, 0], terms[:, 1]
  best = (np.inf, None)
  for ov in overheads:
    pred = (
      np.maximum(f[None, None, :] / peaks[:, None, None], by[None, None, :] / bws[None, :, None])
      + ov
    )
    err = np.sum(np.log(pred[..., train] / measured[train]) ** 2, axis=-1)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    if err[i, j] < best[0]:
      best = (err[i, j], (peaks[i], bws[j], ov))
  peak, bw, ov = best[1]
  pred = np.maximum(f / peak, by / bw) + ov
  rel = np.abs(pred - measured) / measured
  hw = hardware.Hardware(
    "cpu_fitted", float(peak), float(bw), 0.0, float(ov), "fitted by benchmarks/engine.py"
  )
  for r, p, h in zip(rows, pred, held):
    r["predicted_s"] = float(p)
    r["held_out"] = bool(h)
  return hw, float(np.median(rel[train])), float(np.median(rel[held]))


def replay_check(model, model_shape, hw, requests, budget, args, measured_busy):
  num_pages = pages_for_budget(model, budget, PAGE, False, None)
  sched = scheduler.Scheduler(
    scheduler.SchedulerConfig(
      PAGE, args.max_num_batched_tokens, args.max_num_seqs, args.max_model_len
    ),
    pages.PagePool(num_pages),
    cost_model.CostModelExecutor(
      model_shape, hw, share_kv=False, kv_format="bf16", weight_format="fp32"
    ),
  )
  replay.replay(requests, sched)
  return {
    "predicted_busy_s": sched.stats.busy_s,
    "measured_busy_s": measured_busy,
    "steps": sched.stats.num_steps,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=16)
  parser.add_argument("--new_tokens", type=int, default=24)
  parser.add_argument("--budget_bytes", type=float, default=1.0e6, help="KV budget, both layouts.")
  parser.add_argument("--max_num_seqs", type=int, default=8)
  parser.add_argument("--max_num_batched_tokens", type=int, default=64)
  parser.add_argument("--max_model_len", type=int, default=256)
  parser.add_argument("--grid_rows", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--grid_tokens", type=int, nargs="+", default=[1, 8, 32, 64])
  parser.add_argument("--grid_context", type=int, nargs="+", default=[0, 48, 176])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--skip_throughput", action="store_true")
  parser.add_argument("--out", default="", help="Write the results as JSON here.")
  parser.add_argument("--hardware_out", default="", help="Write the fitted profile (JSON) here.")
  args = parser.parse_args()

  config = pretrain.get_config()
  config.model.max_seq_len = args.max_model_len
  cfg = model_lib.from_config(config.model)
  model = LoopedLM(cfg)
  params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  model_shape = shape.ModelShape.from_config(dataclasses.asdict(cfg))
  requests = _requests(args.requests, args.new_tokens)
  results = {"device": str(jax.devices()[0]), "args": vars(args)}
  print(
    f"device {results['device']}; KV bytes/token shared "
    f"{paged_cache.bytes_per_token(cfg, True, None):.0f}, unshared "
    f"{paged_cache.bytes_per_token(cfg, False, None):.0f}",
    flush=True,
  )
  if not args.skip_throughput:
    print("throughput:", flush=True)
    results["throughput"] = throughput(model, params, requests, args.budget_bytes, args)
  print("step grid (unshared, parallel prefill):", flush=True)
  results["grid"] = step_grid(model, params, args)
  hw, train_err, held_err = fit(model_shape, results["grid"])
  results["fit"] = {
    "hardware": dataclasses.asdict(hw),
    "median_rel_err_train": train_err,
    "median_rel_err_held_out": held_err,
  }
  print(
    f"fit: peak {hw.peak_flops:.3g} FLOP/s, bandwidth {hw.mem_bandwidth:.3g} B/s, "
    f"overhead {hw.step_overhead_s * 1e3:.2f} ms; median |rel err| train {train_err:.1%}, "
    f"held-out {held_err:.1%}",
    flush=True,
  )
  print("| rows | new tokens | context | measured ms | predicted ms | held out |")
  print("|---:|---:|---:|---:|---:|---|")
  for r in results["grid"]:
    print(
      f"| {r['rows']} | {r['new_tokens']} | {r['context']} | {r['s'] * 1e3:.2f} | "
      f"{r['predicted_s'] * 1e3:.2f} | {'yes' if r['held_out'] else ''} |"
    )
  if "throughput" in results:
    batched = next(
      r
      for r in results["throughput"]
      if r["layout"] == "unshared" and r["max_num_seqs"] == args.max_num_seqs
    )
    results["replay"] = replay_check(
      model, model_shape, hw, requests, args.budget_bytes, args, batched["busy_s"]
    )
    print(
      f"replay of the batched unshared run with the fitted model: predicted "
      f"{results['replay']['predicted_busy_s']:.2f} s, measured "
      f"{results['replay']['measured_busy_s']:.2f} s",
      flush=True,
    )
    print("| layout | max_num_seqs | pages | tokens/s | steps | preemptions | hit rate |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results["throughput"]:
      print(
        f"| {r['layout']} | {r['max_num_seqs']} | {r['num_pages']} | "
        f"{r['tokens_per_s']:.1f} | {r['steps']} | {r['preemptions']} | {r['hit_rate']:.2f} |"
      )
  if args.hardware_out:
    with open(args.hardware_out, "w") as f:
      json.dump({k: getattr(hw, k) for k in ("peak_flops", "mem_bandwidth", "step_overhead_s")}, f)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
