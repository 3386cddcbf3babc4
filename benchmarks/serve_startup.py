"""Time to ready of the README's serve command, cold then restarted, and whether it survives.

Starts `python -m looped.main --config=configs/serve.py` on a checkpoint N times in a row,
each a fresh process: the first with an empty compilation cache (a directory of its own), the
others reusing it. For each start it records the seconds until `/health` answers 200, the
seconds of a first completion (16 tokens), the process's peak memory mappings and RSS (read
from /proc every 0.2 s) and its exit status after SIGTERM (0: it drained and stopped; 134 is
an abort). It prints a table and writes JSON:

  python benchmarks/serve_startup.py --checkpoint=/tmp/benice/benice --starts=5 \
      --out=/tmp/serve_startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from looped.server import client  # noqa: E402

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _watch(pid: int, peak: dict, stop: threading.Event) -> None:
  """Peak mappings and RSS (MB) of a process, every 0.2 s until stop."""
  while not stop.is_set():
    try:
      with open(f"/proc/{pid}/maps") as f:
        peak["mappings"] = max(peak.get("mappings", 0), sum(1 for _ in f))
      with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
      peak["rss_mb"] = max(peak.get("rss_mb", 0.0), rss)
    except (OSError, ValueError):
      pass
    stop.wait(0.2)


def start_once(args, cache: str, index: int) -> dict:
  workdir = tempfile.mkdtemp(prefix=f"serve_startup_{index}_")
  command = [
    sys.executable,
    "-m",
    "looped.main",
    "--config=configs/serve.py",
    f"--workdir={workdir}",
    f"--compilation_cache={cache}",
    f"--config.serve.checkpoint={args.checkpoint}",
    f"--config.serve.share_kv={args.share_kv}",
  ]
  log = open(os.path.join(workdir, "server.log"), "w")
  start = time.monotonic()
  proc = subprocess.Popen(command, cwd=_REPO, stdout=log, stderr=subprocess.STDOUT)
  peak, stop = {}, threading.Event()
  watcher = threading.Thread(target=_watch, args=(proc.pid, peak, stop), daemon=True)
  watcher.start()
  row = {"start": index, "cache": "empty" if index == 0 else "kept"}
  info = os.path.join(workdir, "server.json")
  try:
    while not os.path.exists(info):
      if proc.poll() is not None or time.monotonic() - start > args.timeout_s:
        raise RuntimeError(f"no server.json (exit {proc.poll()}); log: {log.name}")
      time.sleep(0.1)
    with open(info) as f:
      url = json.load(f)["url"]
    while client.request(url + "/health", timeout_s=5)[0] != 200:
      time.sleep(0.1)
    row["ready_s"] = time.monotonic() - start
    t = time.monotonic()
    body = {"prompt": "def main(", "max_tokens": 16, "temperature": 0}
    status, out = client.request(url + "/v1/completions", "POST", body, timeout_s=120)
    row["first_completion_s"] = time.monotonic() - t
    row["first_completion_status"] = status
    _, metrics = client.request(url + "/metrics")
    row["compiled_at_first_completion"] = _gauge(metrics, "looped:step_shapes_compiled")
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      row["exit"] = proc.wait(args.timeout_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      row["exit"] = "killed"
    stop.set()
    log.close()
  row.update(peak_mappings=peak.get("mappings"), peak_rss_mb=peak.get("rss_mb"), log=log.name)
  return row


def _gauge(text, name: str) -> float | None:
  for line in str(text).splitlines():
    if line.startswith(name + " ") or line.startswith(name + "{"):
      return float(line.rsplit(" ", 1)[1])
  return None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--checkpoint", required=True, help="serve.checkpoint (a BeNice! stage).")
  parser.add_argument("--share_kv", default="True", help="serve.share_kv.")
  parser.add_argument("--starts", type=int, default=5, help="Starts in a row (first cold).")
  parser.add_argument("--timeout_s", type=float, default=600.0, help="Per start, at most.")
  parser.add_argument("--out", default="", help="JSON path ('': print only).")
  args = parser.parse_args()
  cache = tempfile.mkdtemp(prefix="serve_startup_xla_")  # Empty: the first start is cold.
  rows = [start_once(args, cache, i) for i in range(args.starts)]
  print(
    f"{'start':>5} {'cache':>6} {'ready s':>8} {'1st completion s':>16} {'maps':>7} "
    f"{'RSS MB':>7} {'exit':>5}"
  )
  for r in rows:
    print(
      f"{r['start']:>5} {r['cache']:>6} {r.get('ready_s', float('nan')):>8.1f} "
      f"{r.get('first_completion_s', float('nan')):>16.2f} {r.get('peak_mappings') or 0:>7} "
      f"{r.get('peak_rss_mb') or 0:>7.0f} {r['exit']!s:>5}"
    )
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"command_args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
