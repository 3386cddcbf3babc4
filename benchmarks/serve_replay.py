r"""Live replay of a Mooncake trace against the HTTP server, next to the simulator's prediction.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/replay_ckpt \
      --config.train.num_steps=20 --config.model.max_seq_len=256
  python benchmarks/serve_replay.py --checkpoint=/tmp/replay_ckpt --out=/tmp/serve_replay.json

For each layout (unshared, shared) at the same KV budget it starts `configs/serve.py` on the
checkpoint in a subprocess, replays the first --num_requests requests of the trace over HTTP
(streamed completions, at the trace's arrival times multiplied by --time_scale, at most
--clients in flight) and measures what a client sees. Prompts are synthesised from the trace's
hash ids as the simulator keys pages: block j of a prompt is --block_tokens token ids drawn from
a generator seeded by its hash id, so requests that share leading blocks share those tokens and
hit the same prefix-cache pages. Lengths are scaled by --block_tokens / 512 (a Mooncake block is
512 tokens), prompts truncated to --max_prompt_tokens and outputs to --max_output_tokens;
`ignore_eos` keeps every output at its trace length, as the simulator assumes.

A warm-up pass (different hash salt, so it leaves no reusable pages) first compiles the
engine's step shapes. The measured pass then reports the server's prefix-cache hit rate (its
/metrics counters, vLLM's definition: first admissions), requests and output tokens per second
over the makespan (first arrival to last token), TTFT and TPOT percentiles from the client's
clock (TTFT counts from the request's trace arrival, so time spent waiting for a free client
counts too). Beside it: the simulator on the same request stream, page pool and scheduler
limits, priced by the engine-calibrated CPU profile (--hardware, default cpu_2core). Prints a
table and writes JSON with --out.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import serve_common  # noqa: E402
from configs import serve as serve_config  # noqa: E402
from looped.engine.padding import Padding  # noqa: E402
from looped.scheduler import pages as pages_lib  # noqa: E402
from looped.scheduler import replay, scheduler  # noqa: E402
from looped.sim import engine_cost, hardware, shape, traces  # noqa: E402
from looped.sim import metrics as sim_metrics  # noqa: E402

LAYOUTS = {"unshared": False, "shared": True}
MOONCAKE_BLOCK = traces.MOONCAKE_BLOCK_SIZE
BYTE_IDS = 256  # The bytes tokenizer: ids 0..255 are bytes, 256 is EOS (never in a prompt).


def scaled_requests(args) -> list[traces.Request]:
  """The trace's first requests with lengths and times scaled (module docstring)."""
  raw = traces.load_mooncake(args.trace, time_scale=args.time_scale, max_requests=args.num_requests)
  out = []
  for r in raw:
    prompt = min(-(-r.prompt_len * args.block_tokens // MOONCAKE_BLOCK), args.max_prompt_tokens)
    output = min(
      max(1, round(r.output_len * args.block_tokens / MOONCAKE_BLOCK)), args.max_output_tokens
    )
    blocks = -(-prompt // args.block_tokens)
    out.append(
      traces.Request(
        r.request_id,
        r.arrival_s - raw[0].arrival_s,
        prompt,
        output,
        r.block_hashes[:blocks],
        block_size=args.block_tokens,
      )
    )
  return out


def prompt_tokens(request: traces.Request, salt: int) -> list[int]:
  """Token ids of a prompt: block j is a function of (salt, hash id j) alone."""
  tokens = []
  for h in request.block_hashes:
    rng = random.Random(f"{salt}:{h}")
    tokens += [rng.randrange(BYTE_IDS) for _ in range(request.block_size)]
  return tokens[: request.prompt_len]


def start_server(args, share_kv: bool, workdir: str) -> tuple[subprocess.Popen, str]:
  return serve_common.start_server(
    "configs/serve.py:smoke",
    [
      f"serve.checkpoint={args.checkpoint}",
      f"model.max_seq_len={args.max_model_len}",
      f"serve.share_kv={share_kv}",
      f"serve.kv_budget_bytes={args.kv_budget_bytes}",
      f"serve.page_size={args.page_size}",
      f"serve.max_num_seqs={args.max_num_seqs}",
      f"serve.max_num_batched_tokens={args.max_num_batched_tokens}",
      f"serve.prefill_block={args.prefill_block}",
      f"serve.max_waiting={args.num_requests}",
      f"serve.row_buckets={tuple(args.row_buckets)}",
      f"serve.token_buckets={tuple(args.token_buckets)}",
      f"serve.column_buckets={tuple(args.column_buckets)}",
    ],
    workdir,
    timeout_s=600,
  )


scrape = serve_common.scrape
_percentiles = serve_common.percentiles


def replay_http(url: str, requests, salt: int, clients: int) -> list[dict]:
  """Sends each request at its arrival time (or when a client frees up); per request: arrival,
  send, token times (client clock, seconds since the replay started)."""
  results = [None] * len(requests)
  start = time.monotonic() + 0.5

  def one(i, r):
    body = {
      "prompt": prompt_tokens(r, salt),
      "max_tokens": r.output_len,
      "temperature": 0,
      "ignore_eos": True,
    }
    try:
      got = serve_common.stream_completion(url, body, lambda: time.monotonic() - start)
    except RuntimeError as e:
      raise RuntimeError(f"request {r.request_id}: {e}") from e
    # The finish chunk follows the last token's chunk; it carries no token of its own.
    results[i] = {
      "arrival": r.arrival_s,
      "sent": got["sent"],
      "tokens": got["tokens"],
      "output_len": r.output_len,
    }

  with ThreadPoolExecutor(clients) as pool:
    futures = []
    for i, r in enumerate(requests):
      wait = start + r.arrival_s - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      futures.append(pool.submit(one, i, r))
    for f in futures:
      f.result()
  return results


def _percentiles(values) -> dict:
  a = np.asarray(values, np.float64)
  return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))} if len(a) else {}


def measured_summary(results, before: dict, after: dict) -> dict:
  delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)
  queries = delta("vllm:prefix_cache_queries_total")
  makespan = max(r["tokens"][-1] for r in results) - min(r["arrival"] for r in results)
  outputs = sum(r["output_len"] for r in results)
  ttft = [r["tokens"][0] - r["arrival"] for r in results]
  tpot = [
    (r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1)
    for r in results
    if len(r["tokens"]) > 1
  ]
  for r in results:
    if len(r["tokens"]) != r["output_len"]:
      raise RuntimeError(f"a request streamed {len(r['tokens'])} of {r['output_len']} tokens")
  return {
    "hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else None,
    "requests_per_s": len(results) / makespan,
    "output_tokens_per_s": outputs / makespan,
    "ttft_s": _percentiles(ttft),
    "tpot_s": _percentiles(tpot),
    "client_wait_s": _percentiles([r["sent"] - r["arrival"] for r in results]),
    "preemptions": delta("vllm:num_preemptions_total"),
    "makespan_s": makespan,
    "busy_fraction": delta("looped:engine_busy_seconds") / makespan,
    "mean_step_s": delta("looped:engine_busy_seconds") / max(delta("looped:engine_steps"), 1),
    "num_steps": delta("looped:engine_steps"),
    "num_pages": after.get("looped:kv_pages_total"),
  }


def simulate(args, requests, share_kv: bool, num_pages: int) -> dict:
  """The simulator on the same stream, pool size and limits, priced by the engine profile."""
  model = serve_config.get_config("smoke").model
  model.max_seq_len = args.max_model_len
  model_shape = shape.ModelShape.from_config(model)
  hw = hardware.load(args.hardware, args.hardware_json)
  config = scheduler.SchedulerConfig(
    args.page_size,
    args.max_num_batched_tokens,
    args.max_num_seqs,
    args.max_model_len,
    prefill_block=args.prefill_block,
    shared_blocks=share_kv,
  )
  padding = Padding.create(
    args.page_size,
    tuple(args.row_buckets),
    tuple(args.token_buckets),
    tuple(args.column_buckets),
    args.max_model_len,
  )
  executor = engine_cost.EngineCostExecutor(
    model_shape, hw, padding, share_kv=share_kv, kv_format=None, weight_format="fp32"
  )
  sched = scheduler.Scheduler(config, pages_lib.PagePool(num_pages), executor)
  replay.replay(requests, sched)
  run = sim_metrics.summarize(sched, page_bytes=0.0)
  return {
    "hit_rate": run["hit_rate"],
    "requests_per_s": run["requests_per_s"],
    "output_tokens_per_s": run["output_tokens_per_s"],
    "ttft_s": {k: run["ttft_s"][k] for k in ("p50", "p90")},
    "tpot_s": {k: run["tpot_s"][k] for k in ("p50", "p90")},
    "preemptions": run["preemptions"],
    "makespan_s": run["makespan_s"],
    "busy_fraction": run["busy_fraction"],
    "mean_step_s": sched.stats.busy_s / max(sched.stats.num_steps, 1),
    "num_steps": sched.stats.num_steps,
    "ideal_lru_hit_rate": traces.ideal_hit_rate(requests, num_pages * args.page_size),
  }


def engine_alone(args, requests, warmup, share_kv: bool, num_pages: int) -> dict:
  """The same stream on the engine in this process, without HTTP: Engine.generate, whose clock
  is its measured step wall time (arrivals are admitted at step boundaries, as in the
  simulator). Separates the engine's own speed from the server's overhead."""
  from looped.checkpoints import restore
  from looped.data.tokenizers import BytesTokenizer
  from looped.engine.engine import Engine, EngineConfig
  from looped.engine.requests import GenRequest
  from looped.engine.sampling import SamplingParams
  from looped.model import config as model_lib
  from looped.model.looped_lm import LoopedLM

  model_cfg = serve_config.get_config("smoke").model
  model_cfg.max_seq_len = args.max_model_len
  model = LoopedLM(model_lib.from_config(model_cfg))
  params = restore.restore_params(model, args.checkpoint, -1, "checkpoint")

  def run(stream, salt):
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=share_kv,
        num_pages=num_pages,
        page_size=args.page_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        prefill_block=args.prefill_block,
        row_buckets=tuple(args.row_buckets),
        token_buckets=tuple(args.token_buckets),
        column_buckets=tuple(args.column_buckets),
      ),
      decode=BytesTokenizer().decode,
    )
    gens = engine.generate(
      [
        GenRequest(
          r.request_id,
          tuple(prompt_tokens(r, salt)),
          SamplingParams(max_new_tokens=r.output_len),
          arrival_s=r.arrival_s,
        )
        for r in stream
      ]
    )
    return engine, gens

  if warmup:
    run(warmup, salt=3)  # Compiles the step shapes.
  engine, gens = run(requests, salt=2)
  stats = engine.scheduler.stats
  makespan = max(r.arrival_s + g.latency_s for r, g in zip(requests, gens))
  return {
    "hit_rate": stats.first_cached_tokens / stats.first_prompt_tokens,
    "requests_per_s": len(gens) / makespan,
    "output_tokens_per_s": sum(len(g.tokens) for g in gens) / makespan,
    "ttft_s": _percentiles([g.ttft_s for g in gens]),
    "tpot_s": _percentiles(
      [(g.latency_s - g.ttft_s) / (len(g.tokens) - 1) for g in gens if len(g.tokens) > 1]
    ),
    "preemptions": stats.num_preemptions,
    "makespan_s": makespan,
    "busy_fraction": stats.busy_s / makespan,
    "mean_step_s": stats.busy_s / max(stats.num_steps, 1),
    "num_steps": stats.num_steps,
  }


KINDS = ("measured", "engine", "simulated")  # Over HTTP; engine alone; simulator.


def table(runs: dict) -> str:
  rows = [
    ("hit rate", lambda m: f"{m['hit_rate']:.3f}"),
    ("requests/s", lambda m: f"{m['requests_per_s']:.2f}"),
    ("output tok/s", lambda m: f"{m['output_tokens_per_s']:.1f}"),
    ("TTFT p50 (s)", lambda m: f"{m['ttft_s']['p50']:.3f}"),
    ("TTFT p90 (s)", lambda m: f"{m['ttft_s']['p90']:.3f}"),
    ("TPOT p50 (s)", lambda m: f"{m['tpot_s']['p50']:.4f}"),
    ("TPOT p90 (s)", lambda m: f"{m['tpot_s']['p90']:.4f}"),
    ("preemptions", lambda m: f"{m['preemptions']:.0f}"),
    ("makespan (s)", lambda m: f"{m['makespan_s']:.1f}"),
    ("engine busy fraction", lambda m: f"{m['busy_fraction']:.2f}"),
    ("engine steps", lambda m: f"{m['num_steps']:.0f}"),
    ("mean step (ms)", lambda m: f"{1e3 * m['mean_step_s']:.1f}"),
  ]
  kinds = [k for k in KINDS if all(k in run for run in runs.values())]
  header = "| metric | " + " | ".join(f"{layout} {kind}" for layout in runs for kind in kinds)
  lines = [header + " |", "|---|" + "---:|" * (len(kinds) * len(runs))]
  for name, cell in rows:
    cells = [cell(runs[layout][kind]) for layout in runs for kind in kinds]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--checkpoint", required=True, help="Trainer workdir of configs/pretrain.py:smoke."
  )
  parser.add_argument("--trace", default="mooncake_conversation", help="Mooncake JSONL or alias.")
  parser.add_argument("--num_requests", type=int, default=200)
  parser.add_argument("--warmup_requests", type=int, default=100, help="Compile pass (0: none).")
  parser.add_argument("--time_scale", type=float, default=0.5, help="Multiplies arrival times.")
  parser.add_argument("--block_tokens", type=int, default=4, help="Tokens per 512-token block.")
  parser.add_argument("--max_prompt_tokens", type=int, default=192)
  parser.add_argument("--max_output_tokens", type=int, default=16)
  parser.add_argument("--max_model_len", type=int, default=256, help="The model's max_seq_len.")
  parser.add_argument("--kv_budget_bytes", type=float, default=1.2e6)
  parser.add_argument("--page_size", type=int, default=4)
  parser.add_argument("--max_num_seqs", type=int, default=8)
  parser.add_argument("--prefill_block", type=int, default=32, help="serve.prefill_block.")
  parser.add_argument("--max_num_batched_tokens", type=int, default=64)
  # Few step shapes, so the warm-up pass compiles them all (the server's default is powers of
  # two: dozens of shapes, each compiled the first time a step needs it).
  parser.add_argument("--row_buckets", type=int, nargs="+", default=[8])
  parser.add_argument("--token_buckets", type=int, nargs="+", default=[1, 16, 64])
  parser.add_argument("--column_buckets", type=int, nargs="+", default=[64])
  parser.add_argument("--clients", type=int, default=32, help="Requests in flight at most.")
  parser.add_argument("--hardware", default="cpu_2core", help="Simulator profile.")
  parser.add_argument("--hardware_json", default="", help="Profile fields to override (JSON).")
  parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
  parser.add_argument(
    "--engine_alone",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="Also replay the stream on the engine in this process, without HTTP.",
  )
  parser.add_argument("--out", default="", help="Write the results as JSON here.")
  args = parser.parse_args()

  requests = scaled_requests(args)
  warmup = requests[: args.warmup_requests]
  runs = {}
  for layout in args.layouts:
    share = LAYOUTS[layout]
    with tempfile.TemporaryDirectory() as workdir:
      proc, url = start_server(args, share, workdir)
      try:
        if warmup:
          replay_http(url, warmup, salt=1, clients=args.clients)
        before = scrape(url)
        started = time.monotonic()
        results = replay_http(url, requests, salt=2, clients=args.clients)
        wall = time.monotonic() - started
        after = scrape(url)
      finally:
        serve_common.stop_server(proc, workdir)
    measured = {**measured_summary(results, before, after), "wall_s": wall}
    pages = int(measured["num_pages"])
    runs[layout] = {
      "measured": measured,
      "simulated": simulate(args, requests, share, pages),
      "requests": results,
    }
    if args.engine_alone:
      runs[layout]["engine"] = engine_alone(args, requests, warmup, share, pages)
    print(f"{layout}: measured {measured['hit_rate']:.3f} hit rate, {wall:.0f} s", flush=True)
  text = table(runs)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(
        {
          "args": vars(args),
          "stream": {
            "num_requests": len(requests),
            "duration_s": requests[-1].arrival_s,
            "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests),
            "mean_output_tokens": sum(r.output_len for r in requests) / len(requests),
          },
          "runs": runs,
          "table": text,
        },
        f,
        indent=1,
      )


if __name__ == "__main__":
  main()
