"""Memory mappings and resident memory per compiled engine step shape (XLA:CPU).

Each XLA:CPU executable maps its own code pages, so a process that compiles many step shapes
grows its memory-map table until the kernel's `vm.max_map_count` (65,530 by default) refuses
the next mapping and LLVM aborts the process ("Unable to allocate section memory"). This
script reproduces the growth on the served model's shape: it builds an engine on the model of
`--config` (random weights: mappings do not depend on them), compiles its step shapes one by
one, and records the process's mappings (/proc/self/maps) and RSS after each, with the XLA
flags given, so that flag sets can be compared in separate runs:

  python benchmarks/executable_maps.py --shapes 24 --out /tmp/maps_default.json
  XLA_FLAGS=--xla_cpu_parallel_codegen_split_count=1 \
      python benchmarks/executable_maps.py --shapes 24 --out /tmp/maps_split1.json

It prints a table (shapes compiled, mappings, RSS MB) and writes JSON with the per-shape growth
and the shapes `vm.max_map_count` allows at that rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from configs import benice  # noqa: E402
from looped.engine.engine import Engine, EngineConfig  # noqa: E402
from looped.model import config as model_lib  # noqa: E402
from looped.model import init_params  # noqa: E402
from looped.model.looped_lm import LoopedLM  # noqa: E402


def mappings() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def rss_mb() -> float:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def max_map_count() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except OSError:
    return None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--shapes", type=int, default=24, help="Step shapes to compile.")
  parser.add_argument("--share_kv", type=int, default=1, help="1: the shared cache layout.")
  parser.add_argument("--out", default="", help="JSON path ('' : print only).")
  args = parser.parse_args()
  cfg = model_lib.from_config(benice.get_config("").model)
  model = LoopedLM(cfg)
  params = init_params(model, jax.random.PRNGKey(0), jax.numpy.zeros((1, 8), "int32"))
  engine = Engine(
    model,
    params,
    EngineConfig(share_kv=bool(args.share_kv), num_pages=256, attention_impl="xla"),
  )
  shapes = engine.step_shapes()[: args.shapes]
  rows = [{"shapes": 0, "mappings": mappings(), "rss_mb": rss_mb(), "s": 0.0}]
  start = time.perf_counter()
  for i, shape in enumerate(shapes):
    engine.executor.warmup([shape])
    rows.append(
      {
        "shapes": i + 1,
        "shape": list(shape),
        "mappings": mappings(),
        "rss_mb": rss_mb(),
        "s": time.perf_counter() - start,
      }
    )
  grow = np.diff([r["mappings"] for r in rows])
  per_shape = float(np.median(grow)) if len(grow) else 0.0
  limit = max_map_count()
  result = {
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "jax": jax.__version__,
    "model": "configs/benice.py (default model), random weights",
    "share_kv": bool(args.share_kv),
    "reachable_shapes": len(engine.step_shapes()),
    "rows": rows,
    "mappings_per_shape_median": per_shape,
    "rss_mb_per_shape_median": float(np.median(np.diff([r["rss_mb"] for r in rows]))),
    "max_map_count": limit,
    "shapes_to_limit": None
    if not (limit and per_shape)
    else int((limit - rows[0]["mappings"]) / per_shape),
  }
  print(f"{'shapes':>6} {'mappings':>9} {'RSS MB':>8} {'s':>7}")
  for r in rows:
    print(f"{r['shapes']:>6} {r['mappings']:>9} {r['rss_mb']:>8.0f} {r['s']:>7.1f}")
  print(
    f"median per shape: {per_shape:.0f} mappings, {result['rss_mb_per_shape_median']:.1f} MB; "
    f"vm.max_map_count {limit} is reached after ~{result['shapes_to_limit']} shapes "
    f"(XLA_FLAGS={result['xla_flags']!r}); the config reaches {result['reachable_shapes']}."
  )
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
