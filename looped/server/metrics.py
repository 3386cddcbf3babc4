"""Server metrics in Prometheus' text format, under vLLM's names where vLLM has the metric.

Written by hand (counters, gauges read at scrape time, cumulative histograms) rather than with
prometheus_client, whose process-wide registry would make two servers in one process (tests)
share series. Names without a vLLM counterpart use the `looped:` prefix.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

# vLLM's buckets for these histograms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Histogram:
  def __init__(self, buckets: Sequence[float]):
    self.buckets = tuple(buckets)
    self.counts = [0] * (len(self.buckets) + 1)  # The last one is +Inf.
    self.sum = 0.0
    self.count = 0

  def observe(self, value: float) -> None:
    self.counts[bisect.bisect_left(self.buckets, value)] += 1
    self.sum += value
    self.count += 1


def _labels(labels: dict[str, str]) -> str:
  if not labels:
    return ""
  escaped = (
    v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values()
  )
  return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped)) + "}"


def _number(value: float) -> str:
  if value == float("inf"):
    return "+Inf"
  return repr(float(value)) if isinstance(value, float) else str(value)


class Metrics:
  """Counters and histograms updated by the engine loop and the app; gauges read on scrape."""

  def __init__(self, model_name: str):
    self.base = {"model_name": model_name}
    self._lock = threading.Lock()
    self.counters: dict[tuple[str, tuple], float] = {}
    self.help: dict[str, tuple[str, str]] = {}  # Name -> (type, help).
    self.histograms: dict[str, Histogram] = {}
    self.gauges: dict[str, Callable[[], float]] = {}
    for name, text in (
      ("vllm:prompt_tokens_total", "Prompt tokens of finished requests."),
      ("vllm:generation_tokens_total", "Generated tokens."),
      ("vllm:request_success_total", "Finished requests by finish reason."),
      ("vllm:num_preemptions_total", "Preemptions (by recompute)."),
      ("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache."),
      ("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache."),
      ("looped:requests_rejected_total", "Requests refused before the engine, by reason."),
      ("looped:requests_aborted_total", "Requests cancelled (client gone) before finishing."),
      ("looped:streams_stalled_total", "Streams cancelled: their client stopped reading."),
      # Self-speculative decoding, counted as requests finish (vLLM v1's counters).
      ("vllm:spec_decode_num_drafts_total", "Speculative rounds (drafts) of finished requests."),
      ("vllm:spec_decode_num_draft_tokens_total", "Tokens drafted by speculative rounds."),
      ("vllm:spec_decode_num_accepted_tokens_total", "Drafted tokens the verifier kept."),
    ):
      self.help[name] = ("counter", text)
    for name, buckets, text in (
      ("vllm:time_to_first_token_seconds", TTFT_BUCKETS, "Time to first token."),
      ("vllm:inter_token_latency_seconds", ITL_BUCKETS, "Time between consecutive tokens."),
      ("vllm:e2e_request_latency_seconds", E2E_BUCKETS, "Arrival to finish."),
    ):
      self.help[name] = ("histogram", text)
      self.histograms[name] = Histogram(buckets)

  def histogram(self, name: str, buckets: Sequence[float], text: str) -> None:
    """Declares a histogram of the caller's own (observe fills it)."""
    with self._lock:
      self.help[name] = ("histogram", text)
      self.histograms[name] = Histogram(buckets)

  def gauge(self, name: str, text: str, read: Callable[[], float]) -> None:
    self.help[name] = ("gauge", text)
    self.gauges[name] = read

  def inc(self, name: str, value: float = 1, **labels: str) -> None:
    key = (name, tuple(sorted(labels.items())))
    with self._lock:
      self.counters[key] = self.counters.get(key, 0) + value

  def observe(self, name: str, value: float) -> None:
    with self._lock:
      self.histograms[name].observe(value)

  def counter(self, name: str, **labels: str) -> float:
    return self.counters.get((name, tuple(sorted(labels.items()))), 0)

  def render(self) -> str:
    lines = []
    with self._lock:
      for name, (kind, text) in sorted(self.help.items()):
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        if kind == "gauge":
          lines.append(f"{name}{_labels(self.base)} {_number(self.gauges[name]())}")
        elif kind == "counter":
          series = [(dict(k[1]), v) for k, v in self.counters.items() if k[0] == name]
          for labels, value in sorted(series, key=lambda s: sorted(s[0].items())) or [({}, 0)]:
            lines.append(f"{name}{_labels({**self.base, **labels})} {_number(value)}")
        else:
          h = self.histograms[name]
          total = 0
          for bound, count in zip((*h.buckets, float("inf")), h.counts):
            total += count
            le = {**self.base, "le": _number(bound)}
            lines.append(f"{name}_bucket{_labels(le)} {total}")
          lines.append(f"{name}_sum{_labels(self.base)} {_number(h.sum)}")
          lines.append(f"{name}_count{_labels(self.base)} {h.count}")
    return "\n".join(lines) + "\n"
