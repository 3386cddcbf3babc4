"""Helpers the HTTP-server benchmarks share (serve_replay.py, serve_load.py): start and stop
`configs/serve.py` in a subprocess, scrape /metrics, stream one completion and take
percentiles."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from looped.server import client  # noqa: E402


def start_server(
  config: str,
  overrides: list[str],
  workdir: str,
  *,
  compilation_cache: str = "",
  timeout_s: float = 900.0,
) -> tuple[subprocess.Popen, str]:
  """Starts `python -m looped.main --config=CONFIG` with `--config.serve.X=...` style overrides
  (given whole, e.g. 'serve.share_kv=True'); waits for WORKDIR/server.json, which the server
  writes once warmed up. Returns the process and the server's URL; its log is WORKDIR/server.log."""
  command = [sys.executable, "-m", "looped.main", f"--config={config}", f"--workdir={workdir}"]
  if compilation_cache:
    command.append(f"--compilation_cache={compilation_cache}")
  command += [f"--config.{o}" for o in overrides]
  log = open(os.path.join(workdir, "server.log"), "w")
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
  path = os.path.join(workdir, "server.json")
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      proc.wait()
      with open(log.name) as f:
        tail = f.read()[-3000:]
      raise RuntimeError(f"the server did not start; the end of {log.name}:\n{tail}")
    time.sleep(0.2)
  with open(path) as f:
    return proc, json.load(f)["url"]


def stop_server(proc: subprocess.Popen, workdir: str, timeout_s: float = 600.0) -> dict:
  """SIGTERM (the server drains and exits 0); returns its WORKDIR/server_stats.json ({} when it
  wrote none)."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
  proc.wait(timeout_s)
  path = os.path.join(workdir, "server_stats.json")
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def scrape(url: str) -> dict[str, float]:
  """/metrics as {name: value}; labels dropped except on histogram buckets."""
  status, text = client.request(url + "/metrics")
  if status != 200:
    raise RuntimeError(f"/metrics answered {status}")
  out = {}
  for line in text.splitlines():
    if line and not line.startswith("#"):
      key, value = line.rsplit(" ", 1)
      out[key.split("{")[0] if "le=" not in key else key] = float(value)
  return out


def wait_for_compiles(url: str, timeout_s: float = 1800.0) -> None:
  """Returns once the server's background warm-up has compiled every step shape, so a measured
  run's steps neither share the CPU with compiles nor run padded to a larger shape (with an empty
  compilation cache a run started sooner was measured up to 2.3x slower)."""
  deadline = time.monotonic() + timeout_s
  while scrape(url)["looped:step_shapes_pending"] > 0:
    if time.monotonic() > deadline:
      raise RuntimeError(f"step shapes still compiling after {timeout_s:.0f} s")
    time.sleep(0.5)


def engine_counters(before: dict, after: dict, makespan_s: float) -> dict:
  """The server's own figures for a run, from /metrics scraped before and after it: vLLM's
  prefix-cache hit rate and preemptions, and the engine's steps and busy time."""
  delta = lambda name: after.get(name, 0.0) - before.get(name, 0.0)
  queries = delta("vllm:prefix_cache_queries_total")
  steps, busy = delta("looped:engine_steps"), delta("looped:engine_busy_seconds")
  return {
    "hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else None,
    "preemptions": delta("vllm:num_preemptions_total"),
    "prompt_tokens": delta("vllm:prompt_tokens_total"),
    "num_steps": steps,
    "busy_s": busy,
    "busy_fraction": busy / makespan_s,
    "mean_step_s": busy / max(steps, 1),
    "num_pages": after.get("looped:kv_pages_total"),
  }


def percentiles(values, qs=(50, 90)) -> dict:
  """{"p50": ..., "p90": ...} (the percentiles qs) of values; {} for none."""
  a = np.asarray(values, np.float64)
  return {f"p{q}": float(np.percentile(a, q)) for q in qs} if len(a) else {}


def stream_completion(url: str, body: dict, clock, timeout_s: float = 3600.0) -> dict:
  """Streams one completion; `clock()` gives the benchmark's time. Returns the send time, the
  time of each token's chunk (the finish chunk carries none) and the usage the server reports.
  Raises if the server refused the request or the stream ended early."""
  sent = clock()
  body = {**body, "stream_options": {"include_usage": True}}
  stream = client.Stream(url + "/v1/completions", body, timeout_s=timeout_s)
  times, usage = [], None
  try:
    for chunk in stream:
      if chunk.get("usage"):
        usage = chunk["usage"]
      if chunk.get("choices") and chunk["choices"][0]["finish_reason"] is None:
        times.append(clock())
  finally:
    stream.close()
  if stream.status != 200 or not stream.done:
    raise RuntimeError(f"{stream.status} {stream.error}")
  return {"sent": sent, "tokens": times, "usage": usage}
