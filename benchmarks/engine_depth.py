"""Test-time depth in the engine: what fewer recurrences per token buy (benchmarks/engine.py
--depth_sweep runs both parts; docs/engine.md, "Test-time depth", quotes them).

1. `loop_design`: one decode step of the dense model (no pages) at batch 1 and 8 after
   --depth_context tokens, shared and unshared: the scan the engine ran before (every row all R
   recurrences, unrolled) against the while loop it runs now, at R' = 1..R for every row (what
   the loop costs per recurrence, and what stopping saves), and the pieces of the alternative,
   host-driven recurrence chunks with the running rows compacted: a jitted call's dispatch and
   result wait (paid per chunk), and a recurrence's time at 1..8 rows (what compaction saves).
2. `depth_sweep`: the engine (pages, scheduler, sampling) on a decode-heavy workload (short
   prompts, --depth_new_tokens greedy tokens each) at batch 1 and 8, shared and unshared:
   generated tokens/s at fixed R' = 1..R and under an exit criterion, the mean recurrences per
   token, the speed-up over R, and beside it the ideal: 1 / ((1 - f) + f x mean / R), where f is
   the core's share of a full-depth step, fitted on the fixed-R' runs (busy time per token
   linear in R').
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import DepthParams, GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import adaptive
from looped.model.kv_cache import init_cache

PAGE = 16


def _median_ms(fn, *args, reps: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def loop_design(model, params, context: int, reps: int) -> list[dict]:
  """Part 1 (module docstring): one row per (layout, batch)."""
  cfg = model.cfg
  big_r = cfg.num_recurrences
  scan = jax.jit(lambda p, x, c: model.apply(p, x, cache=c)[0])
  loop = jax.jit(lambda p, x, c, d: model.apply(p, x, cache=c, depth=d)[0])
  rows = []
  for share in (True, False):
    for batch in (1, 2, 4, 8):
      cache = init_cache(cfg, batch, context + 8, share)
      cache = cache.replace(length_B=jnp.full((batch,), context, jnp.int32))
      x = jnp.ones((batch, 1), jnp.int32)
      row = {"layout": "shared" if share else "unshared", "batch": batch}
      if batch in (1, 8):
        row["scan_ms"] = _median_ms(scan, params, x, cache, reps=reps)
      row["while_ms"] = {
        r: _median_ms(
          loop, params, x, cache, adaptive.depth_inputs(batch, cfg.d_model, r), reps=reps
        )
        for r in range(1, big_r + 1)
      }
      if batch > 1:  # Half the rows stop after 1 recurrence, half run R: the loop runs R.
        half = adaptive.depth_inputs(batch, cfg.d_model, big_r)
        half = half.replace(recurrences_B=jnp.where(jnp.arange(batch) < batch // 2, 1, big_r))
        row["while_half_ms"] = _median_ms(loop, params, x, cache, half, reps=reps)
      rows.append(row)
  noop = jax.jit(lambda x: x + 1)
  dispatch = _median_ms(lambda x: np.asarray(noop(x)), jnp.zeros((8,), jnp.int32), reps=reps * 5)
  rows.append({"dispatch_and_wait_ms": dispatch})
  return rows


def _requests(n: int, new_tokens: int, depth: DepthParams, seed: int = 0) -> list[GenRequest]:
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    tokens = tuple(int(t) for t in rng.integers(0, 256, 16))
    sampling = SamplingParams(max_new_tokens=new_tokens)
    out.append(GenRequest(i, tokens, sampling, depth=depth))
  return out


def _settings(big_r: int, criteria: list[tuple[str, float]]) -> list[tuple[str, DepthParams]]:
  fixed = [(f"R'={r}", DepthParams(recurrences=r)) for r in range(1, big_r + 1)]
  exits = [
    (f"{c} {t:g}", DepthParams(exit_criterion=c, exit_threshold=t, min_recurrences=1))
    for c, t in criteria
  ]
  return fixed + exits


def depth_sweep(model, params, args) -> list[dict]:
  """Part 2 (module docstring): one row per (layout, batch, setting)."""
  big_r = model.cfg.num_recurrences
  criteria = [(c, float(t)) for c, t in (s.split(":") for s in args.depth_criteria)]
  rows = []
  for share in (True, False):
    for seqs in (1, 8):
      config = EngineConfig(
        share_kv=share,
        num_pages=8 * -(-(16 + args.depth_new_tokens) // PAGE) + 8,
        page_size=PAGE,
        max_num_seqs=seqs,
        max_num_batched_tokens=64,
        max_model_len=96,
        prefill_block=16,
        attention_impl="xla",
      )
      engine = Engine(model, params, config)
      for name, depth in _settings(big_r, criteria):
        requests = _requests(8, args.depth_new_tokens, depth)
        engine.generate(requests)  # Compiles every shape it meets.
        busy, depths = [], []
        for _ in range(args.throughput_reps):
          generations = engine.generate(requests)
          busy.append(engine.stats.busy_s)
          depths = [d for g in generations for d in g.recurrences]
        tokens = sum(len(g.tokens) for g in generations)
        rows.append(
          {
            "layout": "shared" if share else "unshared",
            "max_num_seqs": seqs,
            "setting": name,
            "mean_recurrences": float(np.mean(depths)),
            "tokens": tokens,
            "busy_s": float(np.median(busy)),
            "tokens_per_s": tokens / float(np.median(busy)),
          }
        )
        print(
          f"  {rows[-1]['layout']} x{seqs} {name}: {rows[-1]['tokens_per_s']:.1f} tokens/s, "
          f"mean recurrences {rows[-1]['mean_recurrences']:.2f}",
          flush=True,
        )
  return _with_ideal(rows, big_r)


def _with_ideal(rows: list[dict], big_r: int) -> list[dict]:
  """Adds each row's speed-up over its layout and batch at R, and the ideal speed-up at its
  mean depth from the core share f fitted on the fixed-R' rows (module docstring)."""
  for layout in {r["layout"] for r in rows}:
    for seqs in {r["max_num_seqs"] for r in rows}:
      group = [r for r in rows if r["layout"] == layout and r["max_num_seqs"] == seqs]
      fixed = [r for r in group if r["setting"].startswith("R'=")]
      per_token = np.asarray([r["busy_s"] / r["tokens"] for r in fixed])
      depth = np.asarray([r["mean_recurrences"] for r in fixed])
      slope, base = np.polyfit(depth, per_token, 1)
      share = slope * big_r / (base + slope * big_r)  # f: the core's share at full depth.
      full = next(r for r in fixed if r["setting"] == f"R'={big_r}")
      for r in group:
        r["core_share"] = float(share)
        r["speedup"] = r["tokens_per_s"] / full["tokens_per_s"]
        r["ideal_speedup"] = 1.0 / ((1 - share) + share * r["mean_recurrences"] / big_r)
  return rows


def print_tables(design: list[dict], sweep: list[dict], big_r: int) -> None:
  print(
    "| layout | batch | scan (R) ms | "
    + " | ".join(f"while R'={r} ms" for r in range(1, big_r + 1))
    + " |"
  )
  print("|---|---:|---:|" + "---:|" * big_r)
  for r in design:
    if "layout" not in r:
      continue
    scan = f"{r['scan_ms']:.2f}" if "scan_ms" in r else "-"
    loops = " | ".join(f"{r['while_ms'][k]:.2f}" for k in range(1, big_r + 1))
    print(f"| {r['layout']} | {r['batch']} | {scan} | {loops} |")
  dispatch = next(r["dispatch_and_wait_ms"] for r in design if "dispatch_and_wait_ms" in r)
  print(f"a jitted call's dispatch and result wait: {dispatch:.3f} ms")
  for r in design:
    if "while_half_ms" in r:
      print(f"{r['layout']} x{r['batch']}, half the rows at R'=1: {r['while_half_ms']:.2f} ms")
  print("| layout | batch | setting | mean recurrences | tokens/s | speed-up | ideal | of ideal |")
  print("|---|---:|---|---:|---:|---:|---:|---:|")
  for r in sweep:
    print(
      f"| {r['layout']} | {r['max_num_seqs']} | {r['setting']} | {r['mean_recurrences']:.2f} | "
      f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} | "
      f"{r['speedup'] / r['ideal_speedup']:.2f} |"
    )
