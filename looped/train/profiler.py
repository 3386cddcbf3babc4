"""A JAX profiler trace of chosen training steps, for TensorBoard's profile plugin.

MaxText's convention: skip the first `skip` steps of the run (the first one compiles), then
trace the next `count`. The trace goes to WORKDIR/profile (plugins/profile/<run>/ holds
<host>.xplane.pb); `tensorboard --logdir WORKDIR/profile` shows it with
tensorboard-plugin-profile installed. Each step is annotated (StepTraceAnnotation) so the
profile's step view separates them.
"""

from __future__ import annotations

import contextlib
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
        jax.profiler.start_trace(self.directory)
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
