"""Self-speculative decoding in the engine: decode tokens/s with and without it
(benchmarks/engine.py --speculative_sweep runs this; docs/engine.md, "Self-speculative
decoding", quotes it).

On a trained checkpoint (--checkpoint with --variant naming its configs/benice.py variants),
prompts are the first --spec_prompt_tokens tokens of the first eval rows; each request
generates --spec_new_tokens greedy tokens. For each layout (shared, unshared) and batch (the
engine's max_num_seqs 1 and 8, the 8 requests arriving at once): plain decoding, then every
(draft recurrences r, lookahead k) of --spec_drafts x --spec_lookahead, each timed over
--throughput_reps runs after one that compiles (median busy time; the settings take turns run
by run, so a drift in the machine's load hits them alike). Per setting: generated
tokens/s and its speed-up over plain decoding, the acceptance rate (drafts kept / drafted), the
tokens a round emits on average, and how far the output agrees with plain decoding (requests
whose tokens are identical, and tokens before each request's first difference): identical by
construction unshared, measured under sharing, where verification reads its block as block
prefill does.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.engine.speculative import SpeculativeParams

PAGE = 16


def prompts(config, count: int, length: int) -> list[tuple[int, ...]]:
  """The first `length` tokens of the first `count` eval rows."""
  from looped.data import pipeline as data_lib

  rows = data_lib.eval_rows(config)
  if len(rows) < count or rows.shape[1] < length:
    raise ValueError(f"the eval set has {rows.shape} rows x tokens: fewer than {count} x {length}")
  return [tuple(int(t) for t in row[:length]) for row in rows[:count]]


def _engine(model, params, share: bool, seqs: int, max_len: int, max_k: int) -> Engine:
  config = EngineConfig(
    share_kv=share,
    num_pages=8 * -(-max_len // PAGE) + 8,
    page_size=PAGE,
    max_num_seqs=seqs,
    max_num_batched_tokens=64,
    max_model_len=max_len,
    prefill_block=32,
    attention_impl="xla",
    max_speculative_tokens=max_k,
  )
  return Engine(model, params, config)


def _interleaved(engine: Engine, workloads: list, reps: int):
  """Per workload: (generations, median busy seconds). Each runs once to compile, then the
  workloads take turns, rep after rep, so a drift in the machine's load hits them alike."""
  outs = [engine.generate(w) for w in workloads]
  busy = [[] for _ in workloads]
  for _ in range(reps):
    for i, w in enumerate(workloads):
      outs[i] = engine.generate(w)
      busy[i].append(engine.stats.busy_s)
  return [(o, float(np.median(b))) for o, b in zip(outs, busy)]


def _agreement(plain, spec) -> dict:
  same_prefix = []
  for p, s in zip(plain, spec):
    diff = [i for i, (a, b) in enumerate(zip(p.tokens, s.tokens)) if a != b]
    same_prefix.append(diff[0] if diff else len(p.tokens))
  tokens = sum(len(p.tokens) for p in plain)
  return {
    "identical_requests": sum(p.tokens == s.tokens for p, s in zip(plain, spec)),
    "tokens_before_first_difference": int(sum(same_prefix)),
    "agreement": sum(same_prefix) / tokens,
  }


def _row(name, out, busy, plain_tps, plain_out, summary) -> dict:
  tokens = sum(len(g.tokens) for g in out)
  rounds = summary["speculative_rounds"]
  emitted = sum(sum(g.speculative_rounds) for g in out)
  row = {
    "setting": name,
    "tokens": tokens,
    "busy_s": busy,
    "tokens_per_s": tokens / busy,
    "speedup": (tokens / busy) / plain_tps if plain_tps else 1.0,
    "acceptance_rate": summary["acceptance_rate"],
    "tokens_per_round": emitted / rounds if rounds else None,
    "rounds": rounds,
  }
  if plain_out is not None:
    row.update(_agreement(plain_out, out))
  return row


def sweep(model, params, config, args) -> list[dict]:
  """One row per (layout, batch, setting): the module docstring's figures."""
  texts = prompts(config, 8, args.spec_prompt_tokens)
  max_len = args.spec_prompt_tokens + args.spec_new_tokens
  sp = SamplingParams(max_new_tokens=args.spec_new_tokens)
  plain_reqs = [GenRequest(i, t, sp) for i, t in enumerate(texts)]
  settings = [(r, k) for r in args.spec_drafts for k in args.spec_lookahead]
  workloads = [plain_reqs] + [
    [
      dataclasses.replace(q, speculative=SpeculativeParams(recurrences=r, tokens=k))
      for q in plain_reqs
    ]
    for r, k in settings
  ]
  rows = []
  for share in (False, True):
    for seqs in (1, 8):
      engine = _engine(model, params, share, seqs, max_len, max(args.spec_lookahead))
      runs = _interleaved(engine, workloads, args.throughput_reps)
      (plain, busy), summaries = runs[0], [engine.summary(o) for o, _ in runs]
      base = _row("plain", plain, busy, None, None, summaries[0])
      out_rows = [base]
      for (r, k), (out, busy), summary in zip(settings, runs[1:], summaries[1:]):
        row = _row(f"r={r} k={k}", out, busy, base["tokens_per_s"], plain, summary)
        out_rows.append(row)
      for row in out_rows:
        row.update(layout="shared" if share else "unshared", max_num_seqs=seqs)
        _print_row(row)
      rows += out_rows
  return rows


def _print_row(r: dict) -> None:
  extra = ""
  if r["setting"] != "plain":
    extra = (
      f", acceptance {r['acceptance_rate']:.2f}, {r['tokens_per_round']:.2f} tokens/round, "
      f"identical {r['identical_requests']}/8, agreement {r['agreement']:.3f}"
    )
  print(
    f"  {r['layout']} x{r['max_num_seqs']} {r['setting']}: {r['tokens_per_s']:.1f} tokens/s "
    f"(x{r['speedup']:.2f}){extra}",
    flush=True,
  )


def print_table(rows: list[dict]) -> None:
  print(
    "| layout | batch | setting | tokens/s | speed-up | acceptance | tokens/round | "
    "identical requests | agreement |"
  )
  print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    if r["setting"] == "plain":
      tail = "- | - | - | - |"
    else:
      tail = (
        f"{r['acceptance_rate']:.2f} | {r['tokens_per_round']:.2f} | "
        f"{r['identical_requests']}/8 | {r['agreement']:.3f} |"
      )
    print(
      f"| {r['layout']} | {r['max_num_seqs']} | {r['setting']} | {r['tokens_per_s']:.1f} | "
      f"{r['speedup']:.2f} | {tail}"
    )
