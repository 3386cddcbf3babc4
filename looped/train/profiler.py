"""A JAX profiler trace of chosen training steps, for TensorBoard's profile plugin.

MaxText's convention: skip the first `skip` steps of the run (the first one compiles), then
trace the next `count`. The trace goes to WORKDIR/profile (plugins/profile/<run>/ holds
<host>.xplane.pb); `tensorboard --logdir WORKDIR/profile` shows it with
tensorboard-plugin-profile installed. Each step is annotated (StepTraceAnnotation) so the
profile's step view separates them. The same directory gets the trace as Perfetto JSON
(perfetto_trace.json.gz), which `top_ops` reads without TensorBoard: the ops that took the
most time, e.g. for a run's note.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import os

import jax
from absl import logging


class Profiler:
  """Starts the trace before the first chosen step, stops it after the last one's compute."""

  def __init__(self, workdir: str, first_step: int, skip: int, count: int):
    """first_step: the run's first step number (the resumed step + 1)."""
    self.directory = os.path.join(workdir, "profile")
    self.start = first_step + skip
    self.stop = self.start + count  # Exclusive.
    self.active = False

  def step(self, step: int, state) -> contextlib.AbstractContextManager:
    """A context around step `step`'s call; `state` is the state going into it (waited on
    before the trace starts, so earlier steps stay out of it)."""
    if self.start <= step < self.stop:
      if not self.active:
        jax.block_until_ready(state)
        jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
        self.active = True
        logging.info("Profiling steps %d to %d into %s", self.start, self.stop - 1, self.directory)
      return jax.profiler.StepTraceAnnotation("train", step_num=step)
    return contextlib.nullcontext()

  def after(self, step: int, outputs) -> None:
    """Ends the trace after the last chosen step (or the run's last step), once `outputs`
    (that step's results) are computed."""
    if self.active and step >= self.stop - 1:
      self.close(outputs)

  def close(self, outputs=None) -> None:
    if self.active:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      self.active = False


def top_ops(directory: str, n: int = 10) -> list[dict]:
  """The n ops with the most time in the newest Perfetto trace under `directory`: each
  {'name', 'ms' (summed over the traced steps), 'share' (of all the counted ops' time)}.

  Where the trace has a device (GPU, TPU) its 'XLA Ops' lines are counted (or, without them,
  its lines other than whole modules and steps, e.g. GPU streams); else the host's events less
  the profiler's and Python's own ('$' names), which nest, so shares there overlap.
  """
  paths = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"No perfetto_trace.json.gz under {directory!r}.")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      processes[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e["tid"])] = e["args"]["name"]
  devices = {pid for pid, name in processes.items() if name.startswith("/device:")}
  lines = {key: name for key, name in threads.items() if key[0] in devices}
  ops = {key for key, name in lines.items() if name == "XLA Ops"}
  if not ops:
    ops = {key for key, name in lines.items() if name not in ("XLA Modules", "Steps")}
  total = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or e.get("name", "").startswith("$"):
      continue
    if devices and (e["pid"], e.get("tid")) not in ops:
      continue
    total[e["name"]] += e.get("dur", 0.0)  # Microseconds.
  whole = sum(total.values()) or 1.0
  return [{"name": name, "ms": us / 1e3, "share": us / whole} for name, us in total.most_common(n)]
