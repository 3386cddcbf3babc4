"""Serving metrics with vLLM's definitions, from the scheduler's finished requests and counters.

- hit rate: prefix-cache hit tokens / prompt tokens over first admissions; re-admissions after
  preemption (recomputing prompt + generated tokens) are reported separately;
- TTFT: first token time - arrival; TPOT: (finish - first token) / (output tokens - 1), over
  requests with more than one output token; end-to-end latency: finish - arrival;
- throughput: finished requests and output tokens per second of makespan (first arrival to last
  finish); busy fraction: share of the makespan spent executing steps (1.0 = saturated).
"""

from __future__ import annotations

from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def _distribution(values: list[float]) -> dict[str, float | None]:
  if not values:
    return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
  a = np.asarray(values, dtype=np.float64)
  out = {"mean": float(a.mean())}
  out.update({f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(a, PERCENTILES))})
  return out


def _ratio(num: float, den: float) -> float | None:
  return num / den if den else None


def summarize(scheduler: Any, page_bytes: float) -> dict[str, Any]:
  """Metrics of a finished replay."""
  done = scheduler.finished
  stats = scheduler.stats
  ttft = [s.first_token_s - s.arrival_s for s in done]
  tpot = [
    (s.finish_s - s.first_token_s) / (s.request.output_len - 1)
    for s in done
    if s.request.output_len > 1
  ]
  e2e = [s.finish_s - s.arrival_s for s in done]
  start = min((s.arrival_s for s in done), default=0.0)
  makespan = max((s.finish_s for s in done), default=0.0) - start
  output_tokens = sum(s.request.output_len for s in done)
  return {
    "num_requests": len(done) + len(scheduler.rejected),
    "num_finished": len(done),
    "num_rejected": len(scheduler.rejected),
    "hit_rate": _ratio(stats.first_cached_tokens, stats.first_prompt_tokens),
    "prompt_tokens": stats.first_prompt_tokens,
    "cached_prompt_tokens": stats.first_cached_tokens,
    "readmission_hit_rate": _ratio(stats.readmit_cached_tokens, stats.readmit_tokens),
    "readmission_tokens": stats.readmit_tokens,
    "requests_per_s": _ratio(len(done), makespan),
    "output_tokens_per_s": _ratio(output_tokens, makespan),
    "ttft_s": _distribution(ttft),
    "tpot_s": _distribution(tpot),
    "e2e_latency_s": _distribution(e2e),
    "preemptions": stats.num_preemptions,
    "preempted_requests": sum(1 for s in done if s.num_preemptions),
    "peak_pages_in_use": scheduler.pool.peak_in_use,
    "peak_kv_bytes": scheduler.pool.peak_in_use * page_bytes,
    "evictions": scheduler.pool.num_evictions,
    "makespan_s": makespan,
    "busy_fraction": _ratio(stats.busy_s, makespan),
    "num_steps": stats.num_steps,
  }
