r"""What block verification costs a shared cache: perplexity of speculative decoding's
teacher-forced path against exact shared decoding (docs/engine.md, "Self-speculative decoding").

Under KV-sharing, a speculative round's verify call reads its k tokens as block prefill reads a
block (each token reads the others' own recurrence) and writes those entries into the cache.
Teacher-forced on eval rows with every draft kept, the speculative path is block prefill with
blocks of k tokens; a rejection ends a round early, so real rounds write blocks of 1..k tokens
and the cost lies between exact shared decode (C = 1) and C = k. This script measures, on the
first --rows eval rows of a checkpoint, the CE per row of exact shared decode, of block prefill
at each C in --blocks, and of the unshared forward, and writes ppl and the gap against exact
shared decode with a paired 95% bootstrap interval over rows.

  python experiments/speculative_quality.py --config=configs/benice.py \
      --checkpoint=RUNS/default_s0/benice --out=experiments/results/speculative/default_benice
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
sys.path.insert(0, os.path.join(_REPO, "experiments"))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import test_time_depth  # noqa: E402

from looped.benice import evaluation  # noqa: E402

REPORT = "quality.json"


def measure(args) -> dict:
  config, cfg, params, step = test_time_depth.load_model(args)
  inputs, targets, segments = test_time_depth.subset_rows(config, args.rows)
  fns = evaluation.make_stats_fns(cfg)
  tokens_per_row = int(inputs.shape[1])
  exact = np.asarray(jax.jit(fns.decode)(params, inputs, targets, segments))
  unshared = np.asarray(
    jax.jit(fns.jacobi, static_argnums=4)(params, inputs, targets, segments, 0)[0][0]
  )
  block = jax.jit(fns.block, static_argnums=4)
  rows = {"exact shared decode (C=1)": exact, "unshared": unshared}
  for c in args.blocks:
    rows[f"block C={c}"] = np.asarray(block(params, inputs, targets, segments, c))
  out = {}
  for name, ce in rows.items():
    out[name] = {
      "ppl": evaluation._ppl(ce, tokens_per_row),
      "gap_vs_exact_shared": float(np.expm1((ce.sum() - exact.sum()) / (len(ce) * tokens_per_row))),
      "gap_ci95": evaluation.gap_ci95(ce, exact, tokens_per_row),
    }
    print(
      f"{name}: ppl {out[name]['ppl']:.4f}, gap {100 * out[name]['gap_vs_exact_shared']:+.2f}% "
      f"[{100 * out[name]['gap_ci95'][0]:+.2f}, {100 * out[name]['gap_ci95'][1]:+.2f}]",
      flush=True,
    )
  return {
    "setup": {
      "checkpoint": test_time_depth.portable(args.checkpoint),
      "config": args.config,
      "step": step,
      "rows": args.rows,
      "tokens_per_row": tokens_per_row,
      "date": datetime.date.today().isoformat(),
      "jax": jax.__version__,
      "command": " ".join(["python", "experiments/speculative_quality.py"] + sys.argv[1:]),
    },
    "results": out,
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--config", required=True, help="The pipeline's config, e.g. configs/benice.py:fixed."
  )
  parser.add_argument("--checkpoint", required=True, help="A stage dir (pretrain/ or benice/).")
  parser.add_argument("--rows", type=int, default=128, help="First eval rows measured.")
  parser.add_argument("--blocks", type=int, nargs="+", default=[2, 4, 8], help="Lookaheads k.")
  parser.add_argument("--out", required=True, help="Directory of the JSON report.")
  args = parser.parse_args()
  report = measure(args)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, REPORT)
  with open(path + ".tmp", "w") as f:
    json.dump(report, f, indent=1)
  os.replace(path + ".tmp", path)
  print("wrote", path)


if __name__ == "__main__":
  main()
