r"""Live replay of a request trace against the HTTP server, next to the simulator's prediction.

  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/replay_ckpt \
      --config.train.num_steps=20 --config.model.max_seq_len=256
  python benchmarks/serve_replay.py --checkpoint=/tmp/replay_ckpt --out=/tmp/serve_replay.json
  # Multi-turn sessions on a model trained at a 1024-token context, a sweep (docs/server.md):
  python -m looped.main --config=configs/benice.py:ctx1024 --workdir=/tmp/ctx1024
  python benchmarks/serve_replay.py --checkpoint=/tmp/ctx1024/benice --trace=sessions \
      --kv_budget_bytes 1.5e6 3e6 6e6 --kv_formats bf16 nvfp4 --repeats=3 \
      --no-engine_alone --out=/tmp/serve_sweep.json

The stream: the first --num_requests requests of a Mooncake trace (--trace: a JSONL path or
the bundled `mooncake_conversation`), lengths scaled by --block_tokens / 512 (a Mooncake block is
512 tokens), prompts truncated to --max_prompt_tokens and outputs to --max_output_tokens; or, with
--trace=sessions, multi-turn sessions from looped/sim/sessions.py (--sessions: a JSON object of
config.sessions fields over this script's defaults), whose later turns resend the whole history,
in tokens and blocks of the generator's block_size, unscaled. Prompts are synthesised from the
hash ids as the simulator keys pages: block j of a prompt is block_size token ids drawn from a
generator seeded by its hash id, so requests that share leading blocks share those tokens and hit
the same prefix-cache pages. `ignore_eos` keeps every output at its trace length, as the
simulator assumes.

The model: the checkpoint's record (a trainer workdir's model_config.json, a pipeline stage
dir's stage_config.json) when it has one, served by configs/serve.py; else configs/serve.py:smoke's
model at --max_model_len.

The sweep: for each repeat, KV budget (--kv_budget_bytes), page format (--kv_formats; '' raw)
and layout (unshared, shared), in that nesting, so a drift in the machine's load reaches every
configuration alike, a fresh server (cold prefix cache) on the checkpoint in a subprocess. A
warm-up pass (different hash salt, so it leaves no reusable pages) compiles the engine's step
shapes; the measured pass reports the server's prefix-cache hit rate (its /metrics counters,
vLLM's definition: first admissions), requests and output tokens per second over the makespan
(first arrival to last token), TTFT and TPOT percentiles from the client's clock (TTFT counts
from the request's trace arrival, so time spent waiting for a free client counts too), and
preemptions; a run whose server still holds a page at the end fails. Beside each configuration:
the simulator on the same request stream, page pool and scheduler limits, priced by the
engine-calibrated CPU profile (--hardware, default cpu_2core). With --engine_alone, the same
stream on Engine.generate in this process (no HTTP). Prints, per run, the table of the three,
then the sweep's table (median [min-max] over repeats) and writes JSON with --out. Each finished
run is also appended to OUT.runs.jsonl: rerun with the same flags, a stopped sweep resumes
after its last finished run (more repeats, budgets or formats extend it).
"""

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks import serve_common  # noqa: E402
from configs import serve as serve_config  # noqa: E402
from looped import kv_quant  # noqa: E402
from looped.checkpoints import model_record  # noqa: E402
from looped.engine.padding import Padding  # noqa: E402
from looped.model.cache_layout import KVLayout  # noqa: E402
from looped.scheduler import pages as pages_lib  # noqa: E402
from looped.scheduler import replay, scheduler  # noqa: E402
from looped.sim import engine_cost, hardware, sessions, shape, traces  # noqa: E402
from looped.sim import metrics as sim_metrics  # noqa: E402
from looped.sim.config import SessionsConfig  # noqa: E402

LAYOUTS = {"unshared": False, "shared": True}
MOONCAKE_BLOCK = traces.MOONCAKE_BLOCK_SIZE
BYTE_IDS = 256  # The bytes tokenizer: ids 0..255 are bytes, 256 is EOS (never in a prompt).


# --trace=sessions: the generator's fields this script changes: a model of <= 1024 positions, a
# minute of arrivals (about 190 requests at 3.3 per second: more than the 2-core CPU engine keeps
# up with unshared at a few MB of KV). --sessions overrides any config.sessions field.
SESSION_DEFAULTS = {
  "num_sessions": 48,
  "session_rate_per_s": 1.5,
  "min_turns": 2,
  "max_turns": 6,
  "shared_system_tokens": 128,
  "min_context_tokens": 64,
  "max_context_tokens": 384,
  "min_input_tokens": 16,
  "max_input_tokens": 96,
  "min_output_tokens": 8,
  "max_output_tokens": 32,
  "min_think_s": 2.0,
  "max_think_s": 8.0,
  "max_prompt_tokens": 1024,
  "block_size": 16,
}


def session_config(args) -> SessionsConfig:
  """SESSION_DEFAULTS under --sessions (a JSON object of config.sessions fields)."""
  try:
    given = json.loads(args.sessions or "{}")
  except json.JSONDecodeError as e:
    raise SystemExit(f"--sessions is not a JSON object: {e.msg}") from None
  names = {f.name for f in dataclasses.fields(SessionsConfig)}
  if not isinstance(given, dict) or set(given) - names:
    raise SystemExit(
      f"--sessions: unknown fields {sorted(set(given) - names)}; known: {sorted(names)}"
    )
  cfg = SessionsConfig(**{**SESSION_DEFAULTS, **given})
  sessions.check(cfg, "--sessions")
  return cfg


def scaled_requests(args) -> list[traces.Request]:
  """The replayed stream (module docstring): sessions, or the Mooncake trace's first requests
  with lengths and times scaled."""
  if args.trace == "sessions":
    out = sessions.generate(session_config(args))[: args.num_requests]
    too_long = [r for r in out if r.prompt_len + r.output_len > args.max_model_len]
    if too_long:
      raise SystemExit(
        f"--sessions: request {too_long[0].request_id} needs {too_long[0].prompt_len} + "
        f"{too_long[0].output_len} tokens, beyond the model's {args.max_model_len}; lower "
        "max_prompt_tokens."
      )
    return out
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


def model_config(args):
  """(config name, model ConfigDict): the checkpoint's recorded model under configs/serve.py, or
  configs/serve.py:smoke's at --max_model_len for a workdir without a record."""
  if model_record.read(args.checkpoint) is not None:
    model, _ = model_record.model_and_data(serve_config.get_config(""), args.checkpoint)
    return "configs/serve.py", model
  model = serve_config.get_config("smoke").model
  model.max_seq_len = args.max_model_len
  return "configs/serve.py:smoke", model


def start_server(args, share_kv: bool, kv_format: str, budget: float, workdir: str):
  config, _ = model_config(args)
  overrides = [] if config == "configs/serve.py" else [f"model.max_seq_len={args.max_model_len}"]
  return serve_common.start_server(
    config,
    overrides
    + [
      f"serve.checkpoint={args.checkpoint}",
      f"serve.share_kv={share_kv}",
      f"serve.kv_format={kv_format}",
      f"serve.kv_budget_bytes={budget}",
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
    compilation_cache=args.compilation_cache,
    timeout_s=900,
  )


scrape = serve_common.scrape
QS = (50, 90, 99)  # Percentiles of TTFT and TPOT reported.


def _percentiles(values) -> dict:
  return serve_common.percentiles(values, QS)


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


def measured_summary(results, before: dict, after: dict) -> dict:
  """One run's figures: the client's times (TTFT from the request's arrival in the trace, so
  waiting for a free client counts) and the server's counters."""
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
    "requests_per_s": len(results) / makespan,
    "output_tokens_per_s": outputs / makespan,
    "ttft_s": _percentiles(ttft),
    "tpot_s": _percentiles(tpot),
    "client_wait_s": _percentiles([r["sent"] - r["arrival"] for r in results]),
    "makespan_s": makespan,
    **serve_common.engine_counters(before, after, makespan),
  }


def _pricer(args, share_kv: bool, kv_format: str) -> engine_cost.EngineCostExecutor:
  """The simulator's pricing of the engine's padded steps: the profile, the server's buckets."""
  model_shape = shape.ModelShape.from_config(model_config(args)[1])
  hw = hardware.load(args.hardware, args.hardware_json)
  padding = Padding.create(
    args.page_size,
    tuple(args.row_buckets),
    tuple(args.token_buckets),
    tuple(args.column_buckets),
    args.max_model_len,
  )
  return engine_cost.EngineCostExecutor(
    model_shape, hw, padding, KVLayout(share_kv, kv_format or None), weight_format="fp32"
  )


def simulate(args, requests, share_kv: bool, kv_format: str, num_pages: int) -> dict:
  """The simulator on the same stream, pool size and limits, priced by the engine profile."""
  config = scheduler.SchedulerConfig(
    args.page_size,
    args.max_num_batched_tokens,
    args.max_num_seqs,
    args.max_model_len,
    prefill_block=args.prefill_block,
    shared_blocks=share_kv,
  )
  executor = _PaddingTally(_pricer(args, share_kv, kv_format))
  sched = scheduler.Scheduler(config, pages_lib.PagePool(num_pages), executor)
  replay.replay(requests, sched)
  run = sim_metrics.summarize(sched, page_bytes=0.0)
  return {
    "hit_rate": run["hit_rate"],
    "requests_per_s": run["requests_per_s"],
    "output_tokens_per_s": run["output_tokens_per_s"],
    "ttft_s": {f"p{q}": run["ttft_s"][f"p{q}"] for q in QS},
    "tpot_s": {f"p{q}": run["tpot_s"][f"p{q}"] for q in QS},
    "preemptions": run["preemptions"],
    "makespan_s": run["makespan_s"],
    "busy_fraction": run["busy_fraction"],
    "mean_step_s": sched.stats.busy_s / max(sched.stats.num_steps, 1),
    "num_steps": sched.stats.num_steps,
    "ideal_lru_hit_rate": traces.ideal_hit_rate(requests, num_pages * args.page_size),
    **executor.ratios(),
  }


class _PaddingTally:
  """Passes steps to the engine's pricing and counts what its padded calls compute against
  what the batch needs: token positions (rows x new tokens) and attended slots (rows x the
  dense slots each reads), padding included over the batch's own."""

  def __init__(self, inner: engine_cost.EngineCostExecutor):
    self.inner = inner
    self.tokens = self.needed_tokens = self.slots = self.needed_slots = 0

  def execute(self, batch) -> float:
    p = self.inner.padding.shape(batch.num_new_tokens, batch.num_context_tokens)
    page = self.inner.padding.page_size
    self.tokens += p.computed
    self.needed_tokens += sum(batch.num_new_tokens)
    self.slots += sum(c.rows * c.tokens * (c.columns * page) for c in p.calls)
    self.needed_slots += sum(
      q * (c + q) for q, c in zip(batch.num_new_tokens, batch.num_context_tokens)
    )
    return self.inner.execute(batch)

  def ratios(self) -> dict:
    """Computed / needed: new-token positions, and query x key pairs of attention."""
    return {
      "padded_token_ratio": self.tokens / max(self.needed_tokens, 1),
      "padded_attention_ratio": self.slots / max(self.needed_slots, 1),
    }


def engine_alone(args, requests, warmup, share_kv: bool, kv_format: str, num_pages: int) -> dict:
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

  model = LoopedLM(model_lib.from_config(model_config(args)[1]))
  params = restore.restore_params(model, args.checkpoint, -1, "checkpoint")

  def run(stream, salt):
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=share_kv,
        kv_format=kv_format or None,
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
  start = time.perf_counter()
  engine, gens = run(requests, salt=2)
  wall = time.perf_counter() - start
  stats = engine.scheduler.stats
  makespan = max(r.arrival_s + g.latency_s for r, g in zip(requests, gens))
  steps = max(stats.num_steps, 1)
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
    "mean_step_s": stats.busy_s / steps,
    "num_steps": stats.num_steps,
    # The engine's clock is its steps' model calls; the rest of its wall time is host work the
    # simulator's clock leaves out (scheduling, building inputs, applying results).
    "host_s_per_step": (wall - stats.busy_s) / steps,
    **priced_steps(_pricer(args, share_kv, kv_format), engine.executor.step_log),
  }


def priced_steps(pricer: engine_cost.EngineCostExecutor, step_log: list[dict]) -> dict:
  """Each logged step's model calls (executor.step_log: padded rows, tokens, page columns)
  priced as the simulator prices them, against their measured time: the cost model's error on
  the shapes a live run made, apart from any difference in the schedule. A step is rebuilt as
  rows of its calls' padded shapes, which pad to themselves (checked)."""
  page = pricer.padding.page_size
  priced, measured = [], []
  for step in step_log:
    new, context = [], []
    for rows, tokens, columns in step["calls"]:
      new += [tokens] * rows
      context += [columns * page - tokens] * rows
    batch = scheduler.StepBatch([None] * len(new), new, context, len(new))
    shape = pricer.padding.shape(new, context)
    if [(c.rows, c.tokens, c.columns) for c in shape.calls] != [tuple(c) for c in step["calls"]]:
      raise ValueError(f"step calls {step['calls']} do not pad to themselves: {shape.calls}")
    priced.append(pricer.execute(batch))
    measured.append(step["s"])
  priced, measured = np.asarray(priced), np.asarray(measured)
  return {
    "priced_step_s": float(priced.mean()) if len(priced) else float("nan"),
    "step_over_priced_median": float(np.median(measured / priced)) if len(priced) else float("nan"),
    "step_over_priced_total": float(measured.sum() / priced.sum()) if len(priced) else float("nan"),
  }


KINDS = ("measured", "engine", "simulated")  # Over HTTP; engine alone; simulator.


def table(runs: dict) -> str:
  """One run's measured / engine / simulated columns per layout."""
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


# The sweep table's figures: (column, how to read it from a measured or simulated summary, format).
FIGURES = (
  ("hit rate", lambda m: m["hit_rate"], "{:.3f}"),
  ("requests/s", lambda m: m["requests_per_s"], "{:.2f}"),
  ("output tok/s", lambda m: m["output_tokens_per_s"], "{:.1f}"),
  ("TTFT p50 (s)", lambda m: m["ttft_s"]["p50"], "{:.2f}"),
  ("TTFT p90 (s)", lambda m: m["ttft_s"]["p90"], "{:.2f}"),
  ("TTFT p99 (s)", lambda m: m["ttft_s"]["p99"], "{:.2f}"),
  ("TPOT p50 (s)", lambda m: m["tpot_s"]["p50"], "{:.3f}"),
  ("TPOT p90 (s)", lambda m: m["tpot_s"]["p90"], "{:.3f}"),
  ("preemptions", lambda m: m["preemptions"], "{:.0f}"),
  ("mean step (ms)", lambda m: 1e3 * m["mean_step_s"], "{:.1f}"),
)
# Figures the simulator's prediction is compared on (measured / simulated in the table): the
# three of the acceptance, and the engine's mean step, which separates the cost model's error
# from the scheduling's (a step priced x% high makes every queue longer).
PREDICTED = ("output tok/s", "TTFT p50 (s)", "TTFT p90 (s)", "mean step (ms)")


def _spread(values, fmt: str) -> str:
  """median [min-max], or the one value."""
  a = np.asarray(values, np.float64)
  med = fmt.format(float(np.median(a)))
  if len(a) == 1 or np.ptp(a) == 0:
    return med
  return f"{med} [{fmt.format(float(a.min()))}-{fmt.format(float(a.max()))}]"


def sweep_table(configs: list[dict]) -> str:
  """One row per (budget, format, layout): each figure's median [min-max] over the repeats, the
  simulator's prediction and measured / simulated (median over repeats)."""
  head = ["budget (MB)", "format", "layout", "pages", "runs"] + [name for name, _, _ in FIGURES]
  head += [f"sim {name}" for name in PREDICTED] + [f"measured / sim {n}" for n in PREDICTED]
  lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
  for c in configs:
    cells = [f"{c['budget'] / 1e6:g}", c["kv_format"] or "raw", c["layout"], str(c["num_pages"])]
    cells.append(str(len(c["measured"])))
    for _, get, fmt in FIGURES:
      cells.append(_spread([get(m) for m in c["measured"]], fmt))
    figures = {name: (get, fmt) for name, get, fmt in FIGURES}
    for name in PREDICTED:
      get, fmt = figures[name]
      cells.append(fmt.format(get(c["simulated"])))
    for name in PREDICTED:
      get, _ = figures[name]
      cells.append(f"{np.median([get(m) for m in c['measured']]) / get(c['simulated']):.2f}")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def prediction_errors(configs: list[dict]) -> dict:
  """Per PREDICTED figure, over every measured run: the median of measured / simulated, the
  median of |measured / simulated - 1| and the share of runs within 15% of the prediction."""
  figures = {name: get for name, get, _ in FIGURES}
  out = {}
  for name in PREDICTED:
    get = figures[name]
    ratios = np.asarray(
      [get(m) / get(c["simulated"]) for c in configs for m in c["measured"]], np.float64
    )
    errors = np.abs(ratios - 1)
    out[name] = {
      "median_ratio": float(np.median(ratios)),
      "median_abs_error": float(np.median(errors)),
      "within_15pct": float(np.mean(errors <= 0.15)),
      "runs": len(ratios),
    }
  return out


def prediction_line(errors: dict) -> str:
  return "simulated vs measured, over runs: " + "; ".join(
    f"{name}: median measured/sim {e['median_ratio']:.2f}, median |error| "
    f"{e['median_abs_error']:.0%}, {e['within_15pct']:.0%} of {e['runs']} runs within 15%"
    for name, e in errors.items()
  )


def shared_vs_unshared(configs: list[dict]) -> str:
  """Per (budget, format): shared's change over unshared on the paper's three figures, medians."""
  by = {(c["budget"], c["kv_format"], c["layout"]): c for c in configs}
  med = lambda c, get: float(np.median([get(m) for m in c["measured"]]))
  lines = [
    "| budget (MB) | format | hit rate unshared -> shared | change | output tok/s | TTFT p90 |",
    "|---|---|---:|---:|---:|---:|",
  ]
  for (budget, fmt, layout), c in by.items():
    if layout != "shared" or (budget, fmt, "unshared") not in by:
      continue
    u = by[(budget, fmt, "unshared")]
    hits = med(u, lambda m: m["hit_rate"]), med(c, lambda m: m["hit_rate"])
    hit = f"{hits[1] / hits[0] - 1:+.1%}" if hits[0] else "n/a"
    tput = med(c, lambda m: m["output_tokens_per_s"]) / med(u, lambda m: m["output_tokens_per_s"])
    p90 = med(c, lambda m: m["ttft_s"]["p90"]) / med(u, lambda m: m["ttft_s"]["p90"])
    lines.append(
      f"| {budget / 1e6:g} | {fmt or 'raw'} | {hits[0]:.3f} -> {hits[1]:.3f} | {hit} | "
      f"{tput - 1:+.1%} | {p90 - 1:+.1%} |"
    )
  lines.append("(the paper, simulated: hit rate +31.4%, throughput +23.6%, TTFT p90 -83.6%)")
  return "\n".join(lines)


def run_once(args, requests, warmup, share: bool, kv_format: str, budget: float) -> dict:
  """One fresh server: warm-up pass, measured pass; fails if a page is held at the end."""
  with tempfile.TemporaryDirectory() as workdir:
    proc, url = start_server(args, share, kv_format, budget, workdir)
    try:
      if warmup:
        replay_http(url, warmup, salt=1, clients=args.clients)
      serve_common.wait_for_compiles(url)
      load = os.getloadavg()[0]
      before = scrape(url)
      started = time.monotonic()
      results = replay_http(url, requests, salt=2, clients=args.clients)
      wall = time.monotonic() - started
      after = scrape(url)
    except BaseException:
      serve_common.stop_server(proc, workdir)
      print(open(os.path.join(workdir, "server.log")).read()[-4000:], file=sys.stderr)
      raise
    stats = serve_common.stop_server(proc, workdir)
  held, at_exit = after.get("looped:kv_pages_used"), stats.get("pages_in_use_at_end")
  if held != 0 or at_exit != 0:
    raise RuntimeError(f"pages held at the end: /metrics {held}, at exit {at_exit}")
  measured = measured_summary(results, before, after)
  measured.update(wall_s=wall, load_average=load, pages_used_at_end=held, pages_at_exit=at_exit)
  return {"measured": measured, "requests": results}


def parse_args(argv=None) -> argparse.Namespace:
  """The flags, checked; --max_model_len resolved from the checkpoint's record."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--checkpoint", required=True, help="Trainer workdir or stage dir (module docstring)."
  )
  parser.add_argument(
    "--trace", default="mooncake_conversation", help="Mooncake JSONL, alias, or 'sessions'."
  )
  parser.add_argument("--sessions", default="", help="--trace=sessions: JSON of its fields.")
  parser.add_argument("--num_requests", type=int, default=200, help="Requests replayed at most.")
  parser.add_argument("--warmup_requests", type=int, default=100, help="Compile pass (0: none).")
  parser.add_argument("--time_scale", type=float, default=0.5, help="Multiplies arrival times.")
  parser.add_argument("--block_tokens", type=int, default=4, help="Tokens per 512-token block.")
  parser.add_argument("--max_prompt_tokens", type=int, default=192)
  parser.add_argument("--max_output_tokens", type=int, default=16)
  parser.add_argument(
    "--max_model_len", type=int, default=0, help="0: the record's max_seq_len (smoke: 256)."
  )
  parser.add_argument("--kv_budget_bytes", type=float, nargs="+", default=[1.2e6])
  parser.add_argument("--kv_formats", nargs="+", default=[""], help="'' raw, or looped.kv_quant.")
  parser.add_argument("--repeats", type=int, default=1, help="Runs of each configuration.")
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
  parser.add_argument("--compilation_cache", default="", help="Servers' persistent JAX cache.")
  parser.add_argument("--out", default="", help="Write the results as JSON here.")
  args = parser.parse_args(argv)
  bad = [f for f in args.kv_formats if f and f not in kv_quant.FORMATS]
  if bad:
    parser.error(f"--kv_formats: unknown {bad}; known: '' (raw) and {kv_quant.FORMATS}.")
  if args.repeats < 1 or any(b <= 0 for b in args.kv_budget_bytes):
    parser.error("--repeats and every --kv_budget_bytes must be positive.")
  if not os.path.isdir(args.checkpoint):
    parser.error(f"--checkpoint={args.checkpoint}: no such directory.")
  recorded = model_config(args)
  if recorded[0] == "configs/serve.py":  # The record's context; a flag may only agree with it.
    if args.max_model_len not in (0, recorded[1].max_seq_len):
      parser.error(
        f"--max_model_len={args.max_model_len}, but the checkpoint's model has max_seq_len = "
        f"{recorded[1].max_seq_len}."
      )
    args.max_model_len = recorded[1].max_seq_len
  args.max_model_len = args.max_model_len or 256
  return args


# Flags that do not change what a run measures (a run's key holds its budget, format and
# layout): a journal made under other values still resumes, and a sweep can be extended.
_NOT_MEASURED = (
  "out",
  "repeats",
  "kv_budget_bytes",
  "kv_formats",
  "layouts",
  "compilation_cache",
  "hardware",
  "hardware_json",
)


def code_hash() -> str:
  """sha256 over the served code (looped/ and configs/, every .py by path and content): runs
  measured on another version of the engine are not mixed into one sweep."""
  digest = hashlib.sha256()
  for top in ("looped", "configs"):
    for path in sorted(glob.glob(os.path.join(_REPO, top, "**", "*.py"), recursive=True)):
      digest.update(os.path.relpath(path, _REPO).encode() + b"\0")
      with open(path, "rb") as f:
        digest.update(f.read() + b"\0")
  return digest.hexdigest()[:16]


class Journal:
  """OUT.runs.jsonl: one line per finished run, so a sweep that is stopped resumes where it
  stopped. Its first line holds the flags that define what is measured and the served code's
  hash; a journal written under other flags or code is refused (naming the first difference)
  rather than mixed in."""

  def __init__(self, out: str, args):
    self.path = f"{out}.runs.jsonl" if out else ""
    self.done: dict[tuple, dict] = {}
    flags = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_MEASURED}
    flags["code"] = code_hash()
    if not self.path:
      return
    if os.path.exists(self.path):
      with open(self.path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
      recorded = lines[0]["flags"] if lines else flags
      for k in sorted(set(recorded) | set(flags)):
        if recorded.get(k) != flags.get(k):
          what = f"--{k}={recorded.get(k)!r}, not {flags.get(k)!r}"
          if k == "code":
            what = f"another version of looped/ and configs/ (code {recorded.get(k)})"
          raise SystemExit(
            f"{self.path} holds runs made with {what}: pass another --out, or delete it to "
            "start over."
          )
      for line in lines[1:]:
        self.done[tuple(line["key"])] = line["run"]
      print(f"resuming: {len(self.done)} runs already in {self.path}", flush=True)
    else:
      self._append({"flags": flags})

  def _append(self, record: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")
      f.flush()
      os.fsync(f.fileno())

  def record(self, key: tuple, run: dict) -> None:
    self.done[key] = run
    if self.path:
      self._append({"key": list(key), "run": run})


def main():
  args = parse_args()
  requests = scaled_requests(args)
  warmup = requests[: args.warmup_requests]
  print(
    f"stream: {len(requests)} requests over {requests[-1].arrival_s:.0f} s, mean prompt "
    f"{np.mean([r.prompt_len for r in requests]):.0f} tokens, mean output "
    f"{np.mean([r.output_len for r in requests]):.1f}; model max_seq_len {args.max_model_len}",
    flush=True,
  )
  journal = Journal(args.out, args)
  configs = {}  # (budget, format, layout) -> its runs and the simulator's prediction.
  runs = []
  for rep in range(args.repeats):
    for budget in args.kv_budget_bytes:
      for fmt in args.kv_formats:
        group = {}
        for layout in args.layouts:
          share = LAYOUTS[layout]
          key = (rep, budget, fmt, layout)
          run = journal.done.get(key)
          if run is None:
            run = run_once(args, requests, warmup, share, fmt, budget)
            if args.engine_alone:
              pages = int(run["measured"]["num_pages"])
              run["engine"] = engine_alone(args, requests, warmup, share, fmt, pages)
            journal.record(key, run)
          measured = run["measured"]
          pages = int(measured["num_pages"])
          if key[1:] not in configs:
            configs[key[1:]] = {
              "budget": budget,
              "kv_format": fmt,
              "layout": layout,
              "num_pages": pages,
              "measured": [],
              "simulated": simulate(args, requests, share, fmt, pages),
            }
          configs[key[1:]]["measured"].append(measured)
          group[layout] = {"measured": measured, "simulated": configs[key[1:]]["simulated"]}
          if "engine" in run:
            group[layout]["engine"] = run["engine"]
          runs.append({"repeat": rep, "budget": budget, "kv_format": fmt, "layout": layout, **run})
          print(
            f"repeat {rep + 1}/{args.repeats}, {budget / 1e6:g} MB, {fmt or 'raw'}, {layout}: "
            f"{pages} pages, hit rate {measured['hit_rate']:.3f}, "
            f"{measured['output_tokens_per_s']:.1f} output tok/s, TTFT p90 "
            f"{measured['ttft_s']['p90']:.2f} s, {measured['preemptions']:.0f} preemptions, "
            f"{measured['wall_s']:.0f} s",
            flush=True,
          )
        print(table(group), flush=True)
  sweep = sweep_table(list(configs.values()))
  versus = shared_vs_unshared(list(configs.values()))
  errors = prediction_errors(list(configs.values()))
  print(sweep)
  print(prediction_line(errors))
  print(versus)
  if args.out:
    with open(args.out + ".tmp", "w") as f:
      json.dump(
        {
          "args": vars(args),
          "stream": {
            "num_requests": len(requests),
            "duration_s": requests[-1].arrival_s,
            "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests),
            "mean_output_tokens": sum(r.output_len for r in requests) / len(requests),
          },
          "configs": list(configs.values()),
          "runs": runs,
          "table": sweep,
          "prediction_errors": errors,
          "shared_vs_unshared": versus,
        },
        f,
        indent=1,
      )
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
  main()
