r"""Speed of the serving simulator: replays a whole trace at one KV budget.

  python benchmarks/serve_sim.py --out=/tmp/serve_sim_bench.json
  python benchmarks/serve_sim.py --budget_gb=32 --layout=unshared --profile
  python benchmarks/serve_sim.py --config=hybrid --prefill_block=32 --max_requests=1000

Uses the paper-size model of configs/serve_sim.py on the H200 profile and, by default, the Mooncake
conversation trace (12,031 requests) bundled with the package (alias `mooncake_conversation`).
Prints a table (wall seconds, simulated steps, the run's metrics) and writes JSON with --out.
"""

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from configs import serve_sim  # noqa: E402
from looped.model.cache_layout import KVLayout  # noqa: E402
from looped.scheduler import scheduler  # noqa: E402
from looped.sim import hardware, simulate, traces  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--trace", default="mooncake_conversation", help="Mooncake JSONL trace or bundled alias."
  )
  parser.add_argument("--budget_gb", type=float, default=64.0, help="KV budget in GB (1e9).")
  parser.add_argument("--layout", choices=("shared", "unshared"), default="shared")
  parser.add_argument("--kv_format", default="bf16")
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--time_scale", type=float, default=1.0)
  parser.add_argument(
    "--prefill_block",
    type=int,
    default=0,
    help="Prefill block as the engine runs it (sim.prefill_block; 0: none, as measured).",
  )
  parser.add_argument("--config", default="", help="configs/serve_sim.py variants, e.g. 'mla'.")
  parser.add_argument("--max_requests", type=int, default=0, help="First N requests (0: all).")
  parser.add_argument("--out", default="", help="Write the results as JSON here.")
  parser.add_argument("--profile", action="store_true", help="Print the top cProfile entries.")
  args = parser.parse_args()

  config = serve_sim.get_config(args.config)
  shape = simulate.model_shape(config)
  sched_config = scheduler.SchedulerConfig(
    page_size=args.page_size,
    max_num_batched_tokens=config.sim.max_num_batched_tokens,
    max_num_seqs=config.sim.max_num_seqs,
    max_model_len=config.model.max_seq_len,
    prefill_block=args.prefill_block or None,
  )
  start = time.perf_counter()
  requests = traces.load_mooncake(
    args.trace, time_scale=args.time_scale, max_requests=args.max_requests
  )
  load_s = time.perf_counter() - start

  def replay():
    return simulate.simulate_one(
      requests,
      shape,
      hardware.load(config.sim.hardware),
      budget=args.budget_gb * 1e9,
      layout=KVLayout(args.layout == "shared", args.kv_format),
      config=sched_config,
      label="replay",
    )

  profiler = cProfile.Profile() if args.profile else None
  start_cpu = time.process_time()
  run = profiler.runcall(replay) if profiler else replay()
  replay_s = run["sim_wall_s"]  # The replay alone, without the ideal-LRU reference pass.
  replay_cpu_s = time.process_time() - start_cpu

  rows = [
    ("requests", f"{len(requests)}"),
    ("trace load (s)", f"{load_s:.2f}"),
    ("replay wall (s)", f"{replay_s:.2f}"),
    ("CPU incl. ideal-LRU pass (s)", f"{replay_cpu_s:.2f}"),
    ("simulated steps", f"{run['num_steps']}"),
    ("steps / wall s", f"{run['num_steps'] / replay_s:.0f}"),
    ("layout / format / budget", f"{args.layout} / {args.kv_format} / {args.budget_gb:g} GB"),
    ("hit rate (ideal LRU)", f"{run['hit_rate']:.4f} ({run['ideal_lru_hit_rate']:.4f})"),
    ("requests / s (simulated)", f"{run['requests_per_s']:.3f}"),
    ("output tokens / s", f"{run['output_tokens_per_s']:.0f}"),
    ("TTFT p90 (s)", f"{run['ttft_s']['p90']:.2f}"),
    ("preemptions", f"{run['preemptions']}"),
  ]
  width = max(len(k) for k, _ in rows)
  print(f"| {'metric':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
  for key, value in rows:
    print(f"| {key:<{width}} | {value} |")
  if profiler:
    pstats.Stats(profiler).sort_stats("tottime").print_stats(15)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
        {
          "args": vars(args),
          "load_s": load_s,
          "replay_s": replay_s,
          "replay_cpu_s": replay_cpu_s,
          "run": run,
        },
        f,
        indent=2,
      )


if __name__ == "__main__":
  main()
