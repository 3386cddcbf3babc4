"""Replays a trace through a scheduler: arrivals join the queue at step boundaries."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from looped.scheduler import scheduler as scheduler_lib


def replay(
  requests: Sequence[Any],
  scheduler: scheduler_lib.Scheduler,
  *,
  on_progress: Callable[[int], None] | None = None,
  progress_every: int = 256,
) -> float:
  """Runs until every request has finished or been rejected; returns the final time (s).

  Requests must be sorted by arrival. on_progress(num_finished_or_rejected) is called every
  `progress_every` steps and at the end.
  """
  now = 0.0
  i, n = 0, len(requests)
  calls = 0
  while i < n or scheduler.has_work():
    while i < n and requests[i].arrival_s <= now:
      scheduler.add_request(requests[i])
      i += 1
    if not scheduler.has_work():
      if i < n:
        now = requests[i].arrival_s  # Idle until the next arrival.
      continue
    now = scheduler.step(now, requests[i].arrival_s if i < n else math.inf)
    calls += 1
    if on_progress is not None and calls % progress_every == 0:
      on_progress(len(scheduler.finished) + len(scheduler.rejected))
  if on_progress is not None:
    on_progress(len(scheduler.finished) + len(scheduler.rejected))
  return now
