r"""Shared vs unshared KV layout under load, over HTTP, at one KV budget.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/load_ckpt \
      --config.train.num_steps=20 --config.model.d_model=128 --config.model.num_heads=4 \
      --config.model.num_kv_heads=2 --config.model.mlp_dim=384 --config.model.max_seq_len=768
  python benchmarks/serve_load.py --checkpoint=/tmp/load_ckpt --out=/tmp/serve_load.json
  python benchmarks/serve_load.py --checkpoint=/tmp/load_ckpt --quick   # a smoke run

The checkpoint: the default model's shape (configs/pretrain.py: d_model 128, 4 query and 2 KV
heads, P/B/C = 1/2/1, R = 4; 0.84M parameters) trained for a few steps of the smoke recipe;
speed does not depend on training. This script trains nothing.

For each layout (unshared, shared) at the same `serve.kv_budget_bytes`, --repeats times,
interleaved (U, S, U, S, ...), it starts `configs/serve.py` on the checkpoint in a subprocess
(the server compiles its step shapes before it answers; a compilation cache shared by the runs
of one invocation makes the later starts short), sends --warmup_requests requests with prefixes
of their own (they leave no page the measured requests can use), then --num_requests requests
from --clients client threads: all queued at once (--rate 0) or offered at --rate requests/s,
each sent when a client is free. A fraction --prefix_fraction of them start with one of
--num_prefixes fixed texts of --prefix_bytes bytes, followed by a random tail of --tail_bytes;
the others are random texts of --bare_bytes. Each asks for a random max_tokens in --max_tokens
with `ignore_eos` (so it streams exactly that many tokens), greedy, streamed. The request stream
is the same for every run.

Per run: client-side output tokens/s over the makespan (first send to last token), TTFT p50 and
p90 from the request's send (the time it waits in the server's queue counts; the time it waits
for a free client does not), TPOT p50, and from /metrics the server's prefix-cache hit rate (vLLM's
definition), preemptions, engine steps and time inside them, and the pool's pages. Every page must
be free at the end (the /metrics gauge after the last request, and the server's own count at
exit), else the run fails. The table gives each figure's median over the repeats and its min-max
range. The load average (1 min) is recorded before and after every run.
"""

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import serve_common  # noqa: E402

LAYOUTS = {"unshared": False, "shared": True}
# Prompt characters: ASCII, so one byte and one token each.
_TEXT = "abcdefghijklmnopqrstuvwxyz      ABCDEFGHIJ0123456789.,;:()=_-+\n"


def _text(rng: random.Random, n: int) -> str:
  return "".join(rng.choice(_TEXT) for _ in range(n))


def workload(args, seed: int, n: int) -> list[dict]:
  """The request stream: prompt text, max_tokens and (rate > 0) arrival time of each request."""
  rng = random.Random(seed)
  lo, hi = args.prefix_bytes
  n_prefixes = args.num_prefixes
  prefixes = [_text(rng, lo + (hi - lo) * i // max(n_prefixes - 1, 1)) for i in range(n_prefixes)]
  out = []
  for i in range(n):
    if rng.random() < args.prefix_fraction:
      k = rng.randrange(args.num_prefixes)
      prompt = prefixes[k] + _text(rng, rng.randint(*args.tail_bytes))
    else:
      k = None
      prompt = _text(rng, rng.randint(*args.bare_bytes))
    out.append(
      {
        "prompt": prompt,
        "prefix": k,
        "max_tokens": rng.randint(*args.max_tokens),
        "arrival": i / args.rate if args.rate > 0 else 0.0,
      }
    )
  return out


def send_all(url: str, requests: list[dict], clients: int) -> list[dict]:
  """Streams every request from `clients` threads; a request is sent at its arrival time or when
  a client frees up, whichever is later. Times on one clock from the first arrival."""
  results = [None] * len(requests)
  start = time.monotonic() + 0.2
  clock = lambda: time.monotonic() - start

  def one(i, r):
    body = {
      "prompt": r["prompt"],
      "max_tokens": r["max_tokens"],
      "temperature": 0,
      "ignore_eos": True,
    }
    got = serve_common.stream_completion(url, body, clock)
    got["completion_tokens"] = got.pop("usage")["completion_tokens"]
    if got["completion_tokens"] != r["max_tokens"] or len(got["tokens"]) != r["max_tokens"]:
      raise RuntimeError(
        f"request {i}: {len(got['tokens'])} token chunks, usage "
        f"{got['completion_tokens']}, asked {r['max_tokens']} with ignore_eos"
      )
    results[i] = {**got, "arrival": r["arrival"]}

  with ThreadPoolExecutor(clients) as pool:
    futures = []
    for i, r in enumerate(requests):
      wait = start + r["arrival"] - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      futures.append(pool.submit(one, i, r))
    for f in futures:
      f.result()
  return results


class PageSampler:
  """Polls /metrics once a second while the requests run: the most pages held at once."""

  def __init__(self, url: str, period_s: float = 1.0):
    self.url, self.period_s = url, period_s
    self.peak_pages_used = 0.0
    self.peak_waiting = 0.0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.wait(self.period_s):
      try:
        m = serve_common.scrape(self.url)
      except (OSError, RuntimeError):
        continue
      self.peak_pages_used = max(self.peak_pages_used, m.get("looped:kv_pages_used", 0.0))
      self.peak_waiting = max(self.peak_waiting, m.get("vllm:num_requests_waiting", 0.0))

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()


def summarize(results: list[dict], before: dict, after: dict) -> dict:
  """One run's figures from the client's times and the /metrics counters before and after."""
  first = min(r["sent"] for r in results)
  makespan = max(r["tokens"][-1] for r in results) - first
  outputs = sum(r["completion_tokens"] for r in results)
  tpot = [
    (r["tokens"][-1] - r["tokens"][0]) / (len(r["tokens"]) - 1)
    for r in results
    if len(r["tokens"]) > 1
  ]
  return {
    "output_tokens_per_s": outputs / makespan,
    "ttft_s": serve_common.percentiles([r["tokens"][0] - r["sent"] for r in results]),
    "tpot_s": serve_common.percentiles(tpot),
    "e2e_s": serve_common.percentiles([r["tokens"][-1] - r["sent"] for r in results]),
    "output_tokens": outputs,
    "makespan_s": makespan,
    **serve_common.engine_counters(before, after, makespan),
  }


def run_once(args, layout: str, requests, warmup, cache_dir: str) -> dict:
  share = LAYOUTS[layout]
  overrides = [
    f"serve.checkpoint={args.checkpoint}",
    f"serve.share_kv={share}",
    f"serve.kv_budget_bytes={args.kv_budget_bytes}",
    f"serve.page_size={args.page_size}",
    f"serve.max_num_seqs={args.max_num_seqs}",
    f"serve.max_num_batched_tokens={args.max_num_batched_tokens}",
    f"serve.prefill_block={args.prefill_block}",
    f"serve.max_waiting={max(args.num_requests, args.warmup_requests)}",
    f"serve.row_buckets={tuple(args.row_buckets)}",
    f"serve.token_buckets={tuple(args.token_buckets)}",
    f"serve.column_buckets={tuple(args.column_buckets)}",
  ]
  with tempfile.TemporaryDirectory() as workdir:
    started = time.monotonic()
    proc, url = serve_common.start_server(
      "configs/serve.py", overrides, workdir, compilation_cache=cache_dir
    )
    try:
      start_s = time.monotonic() - started
      if warmup:
        send_all(url, warmup, args.clients)
      serve_common.wait_for_compiles(url)
      load_before = os.getloadavg()[0]
      before = serve_common.scrape(url)
      with PageSampler(url) as sampler:
        results = send_all(url, requests, args.clients)
      after = serve_common.scrape(url)
      load_after = os.getloadavg()[0]
    except BaseException:
      serve_common.stop_server(proc, workdir)
      print(open(os.path.join(workdir, "server.log")).read()[-4000:], file=sys.stderr)
      raise
    stats = serve_common.stop_server(proc, workdir)
    with open(os.path.join(workdir, "server.log")) as f:
      warm_line = next((line.strip() for line in f if "warm-up:" in line and " in " in line), "")
  held = after.get("looped:kv_pages_used")
  if held != 0 or stats.get("pages_in_use_at_end") != 0:
    raise RuntimeError(
      f"{layout}: pages held at the end: /metrics {held}, at exit "
      f"{stats.get('pages_in_use_at_end')}"
    )
  out = summarize(results, before, after)
  out.update(
    {
      "layout": layout,
      "pages_used_at_end": held,
      "pages_in_use_at_exit": stats["pages_in_use_at_end"],
      "peak_pages_used": sampler.peak_pages_used,
      "peak_waiting": sampler.peak_waiting,
      "load_average_before": load_before,
      "load_average_after": load_after,
      "server_start_s": start_s,
      "server_warmup": warm_line,
    }
  )
  return out


ROWS = (
  # (label, key, format); key: a summary field, or (field, percentile).
  ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
  ("TTFT p50 (s)", ("ttft_s", "p50"), "{:.1f}"),
  ("TTFT p90 (s)", ("ttft_s", "p90"), "{:.1f}"),
  ("TPOT p50 (s)", ("tpot_s", "p50"), "{:.3f}"),
  ("makespan (s)", "makespan_s", "{:.0f}"),
  ("prefix-cache hit rate", "hit_rate", "{:.2f}"),
  ("preemptions", "preemptions", "{:.0f}"),
  ("KV pages in the pool", "num_pages", "{:.0f}"),
  ("peak pages held", "peak_pages_used", "{:.0f}"),
  ("prompt tokens admitted", "prompt_tokens", "{:.0f}"),
  ("engine steps", "num_steps", "{:.0f}"),
  ("mean step (ms)", "mean_step_s", "{:.1f}", 1e3),
  ("engine busy fraction", "busy_fraction", "{:.2f}"),
  ("load average (1 min)", "load_average_before", "{:.1f}"),
)


def _value(run: dict, key):
  return run[key[0]][key[1]] if isinstance(key, tuple) else run[key]


def aggregate(runs: list[dict]) -> dict:
  """Per layout and figure: median, min and max over the repeats."""
  out = {}
  for layout in LAYOUTS:
    mine = [r for r in runs if r["layout"] == layout]
    if not mine:
      continue
    figures = {}
    for row in ROWS:
      key = row[1]
      values = [_value(r, key) for r in mine]
      if any(v is None for v in values):
        continue
      name = ".".join(key) if isinstance(key, tuple) else key
      figures[name] = {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
      }
    out[layout] = figures
  return out


def table(summary: dict) -> str:
  layouts = list(summary)
  lines = [
    "| figure | " + " | ".join(f"{layout} median [min-max]" for layout in layouts) + " |",
    "|---|" + "---:|" * len(layouts),
  ]
  for row in ROWS:
    label, key, fmt = row[:3]
    scale = row[3] if len(row) > 3 else 1.0
    name = ".".join(key) if isinstance(key, tuple) else key
    cells = []
    for layout in layouts:
      f = summary[layout].get(name)
      if f is None:
        cells.append("-")
        continue
      med, lo, hi = (fmt.format(scale * f[k]) for k in ("median", "min", "max"))
      cells.append(med if lo == hi else f"{med} [{lo}-{hi}]")
    lines.append(f"| {label} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def verdict(summary: dict) -> str:
  """Whether the shared server's medians are at least as good as the unshared one's."""
  if not {"shared", "unshared"} <= set(summary):
    return ""
  s, u = summary["shared"], summary["unshared"]
  tps = s["output_tokens_per_s"]["median"] >= u["output_tokens_per_s"]["median"]
  p50 = s["ttft_s.p50"]["median"] <= u["ttft_s.p50"]["median"]
  p90 = s["ttft_s.p90"]["median"] <= u["ttft_s.p90"]["median"]
  return (
    f"shared output tokens/s >= unshared: {tps} "
    f"({s['output_tokens_per_s']['median']:.1f} vs {u['output_tokens_per_s']['median']:.1f}); "
    f"TTFT p50 <=: {p50} ({s['ttft_s.p50']['median']:.1f} vs {u['ttft_s.p50']['median']:.1f} s); "
    f"TTFT p90 <=: {p90} ({s['ttft_s.p90']['median']:.1f} vs {u['ttft_s.p90']['median']:.1f} s)"
  )


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="Trainer workdir (module docstring).")
  parser.add_argument("--num_requests", type=int, default=300)
  parser.add_argument("--clients", type=int, default=48, help="Concurrent client threads.")
  parser.add_argument("--repeats", type=int, default=3, help="Runs per layout, interleaved.")
  parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
  parser.add_argument("--rate", type=float, default=0.0, help="Requests/s offered (0: at once).")
  parser.add_argument("--warmup_requests", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--num_prefixes", type=int, default=5)
  parser.add_argument("--prefix_fraction", type=float, default=0.7)
  parser.add_argument("--prefix_bytes", type=int, nargs=2, default=[300, 600], help="Min, max.")
  parser.add_argument("--tail_bytes", type=int, nargs=2, default=[8, 64])
  parser.add_argument("--bare_bytes", type=int, nargs=2, default=[32, 256])
  parser.add_argument("--max_tokens", type=int, nargs=2, default=[8, 32], help="Min, max.")
  # 6.6 MB: 80 pages of 16 tokens unshared (5,120 B/token), 201 shared (2,048 B/token).
  parser.add_argument("--kv_budget_bytes", type=float, default=6.6e6)
  parser.add_argument("--page_size", type=int, default=16)
  parser.add_argument("--max_num_seqs", type=int, default=8)
  parser.add_argument("--max_num_batched_tokens", type=int, default=64)
  parser.add_argument("--prefill_block", type=int, default=32)
  # Few step shapes, so each server start compiles quickly (the server's default, powers of
  # two, is 179 shapes for this model and these limits).
  parser.add_argument("--row_buckets", type=int, nargs="+", default=[2, 8])
  parser.add_argument("--token_buckets", type=int, nargs="+", default=[8, 32])
  parser.add_argument("--column_buckets", type=int, nargs="+", default=[16, 32])
  parser.add_argument(
    "--compilation_cache",
    default="",
    help="Persistent compilation cache dir ('': a fresh one for this invocation's runs).",
  )
  parser.add_argument(
    "--quick", action="store_true", help="Smoke run: 24 requests, 8 clients, 1 repeat."
  )
  parser.add_argument("--out", default="", help="Write the results as JSON here.")
  args = parser.parse_args(argv)
  if args.quick:
    args.num_requests, args.clients, args.repeats, args.warmup_requests = 24, 8, 1, 4
  return args


def main():
  args = parse_args()
  requests = workload(args, args.seed, args.num_requests)
  warmup = workload(args, args.seed + 1, args.warmup_requests)
  runs = []
  with tempfile.TemporaryDirectory() as fresh_cache:
    cache = args.compilation_cache or fresh_cache
    for rep in range(args.repeats):
      for layout in args.layouts:
        t = time.monotonic()
        run = run_once(args, layout, requests, warmup, cache)
        run["repeat"] = rep
        runs.append(run)
        print(
          f"{layout} #{rep}: {run['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
          f"{run['ttft_s']['p50']:.1f} p90 {run['ttft_s']['p90']:.1f} s, hit "
          f"{run['hit_rate']:.2f}, {run['preemptions']:.0f} preemptions, "
          f"{run['num_pages']:.0f} pages (peak {run['peak_pages_used']:.0f}), "
          f"{run['num_steps']:.0f} steps of {1e3 * run['mean_step_s']:.1f} ms, load "
          f"{run['load_average_before']:.1f}, {time.monotonic() - t:.0f} s with start",
          flush=True,
        )
  summary = aggregate(runs)
  text = table(summary)
  print(text)
  line = verdict(summary)
  if line:
    print(line)
  if args.out:
    import jax

    with open(args.out, "w") as f:
      json.dump(
        {
          "args": vars(args),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "jax": jax.__version__,
          "cpu_count": os.cpu_count(),
          "stream": {
            "num_requests": len(requests),
            "with_prefix": sum(r["prefix"] is not None for r in requests),
            "mean_prompt_bytes": statistics.mean(len(r["prompt"]) for r in requests),
            "mean_max_tokens": statistics.mean(r["max_tokens"] for r in requests),
          },
          "runs": runs,
          "summary": summary,
          "table": text,
          "verdict": line,
        },
        f,
        indent=1,
      )


if __name__ == "__main__":
  main()
