"""The engine's continuous-batching loop on a thread of its own, fed by HTTP handlers.

One thread owns the scheduler, the page pool (so the prefix cache lives as long as the server)
and the executor; handlers only `submit` and `cancel`, which take a lock for a list append. Each
request has a sink, a thread-safe callable that receives its events: a `Token` per generated
token, then one `Done` (sent after the step that finished it, so its pages are already free) or
one `Failed`. Time is wall time since the loop started; the scheduler runs on it as it does on
the simulator's clock.

A failed step never fails the batch: the executor applies nothing of a step unless all of it
succeeds, so the loop puts the step's requests back in the queue and finds the culprit. A row
that failed on its own data names its request (RequestFailed), which alone gets a 500; any other
failure quarantines the step's requests and re-admits them one at a time (each alone with
whatever else runs), so the next failure names its culprit. Each failure fails one request at
most, so the loop always makes progress.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from looped.engine.engine import Engine
from looped.engine.executor import RequestFailed, RequestState
from looped.engine.requests import GenRequest
from looped.scheduler import pages as pages_lib
from looped.scheduler import scheduler as scheduler_lib
from looped.server.metrics import Metrics

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
  """The waiting queue holds max_waiting requests already."""


class Warming(RuntimeError):
  """The engine is still compiling its step shapes (EngineLoop warmup)."""


@dataclasses.dataclass(frozen=True)
class Token:
  token: int
  logprob: float
  top: tuple[list[int], list[float]] | None  # The position's top ids and logprobs, if recorded.
  text: str  # The request's whole generated text so far (stop strings cut).
  finish_reason: str | None
  # On the first token of a position_logprobs request: RequestState.positions of the prompt.
  prompt_positions: dict | None = None


@dataclasses.dataclass(frozen=True)
class Done:
  tokens: list[int]
  logprobs: list[float]
  text: str
  finish_reason: str  # 'length', 'stop_token' or 'stop_string'.
  positions: dict  # RequestState.positions (empty unless position_logprobs).
  cached_prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class Failed:
  status: int
  message: str


Sink = Callable[[object], None]


@dataclasses.dataclass
class _Tracked:
  sink: Sink
  arrival: float
  last_token: float | None = None


class EngineLoop:
  def __init__(self, engine: Engine, *, max_waiting: int, metrics: Metrics, warmup: bool = False):
    """max_waiting: requests queued (submitted, not yet running) beyond which submit refuses.
    warmup: the thread first compiles every step shape (Engine.warmup) and only then is `ready`;
    submit refuses (Warming) until it is, so no request waits for a compile."""
    self.engine = engine
    self.executor = engine.executor
    self.pool = pages_lib.PagePool(engine.num_pages)
    self.scheduler = scheduler_lib.Scheduler(engine.config, self.pool, self.executor)
    self.executor.states = {}
    self.executor.on_token = self._on_token
    self.max_waiting = max_waiting
    self.metrics = metrics
    self._cond = threading.Condition()
    self._inbox: list[tuple[GenRequest, _Tracked]] = []
    self._cancels: list[int] = []
    self._tracked: dict[int, _Tracked] = {}
    self._stopping = False
    self._quarantine: collections.deque[scheduler_lib.Sequence] = collections.deque()
    self._probe: int | None = None  # The quarantined request re-admitted, until a step clears it.
    self._t0 = time.monotonic()
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self.error: BaseException | None = None
    self._warmup = warmup
    self.ready = threading.Event()
    self.warmup_s: float | None = None
    self.warmup_progress = "starting"
    self.warmup_shapes = 0
    if not warmup:
      self.ready.set()
    metrics.gauge("vllm:num_requests_running", "Requests in the running batch.", self.num_running)
    metrics.gauge("vllm:num_requests_waiting", "Requests queued.", self.num_waiting)
    metrics.gauge(
      "vllm:kv_cache_usage_perc",
      "Fraction of KV pages held by requests (1 = full).",
      lambda: self.pool.num_in_use / self.pool.num_pages,
    )
    metrics.gauge("looped:kv_pages_used", "KV pages held by requests.", self.pages_in_use)
    metrics.gauge("looped:kv_pages_total", "KV pages in the pool.", lambda: self.pool.num_pages)
    stats = self.scheduler.stats
    metrics.gauge("looped:engine_steps", "Engine steps run.", lambda: stats.num_steps)
    metrics.gauge(
      "looped:engine_busy_seconds", "Wall time spent inside engine steps.", lambda: stats.busy_s
    )
    metrics.gauge(
      "vllm:gpu_prefix_cache_hit_rate",
      "Prefix-cache hit rate: cached / prompt tokens at first admissions.",
      self.hit_rate,
    )

  # -- Any thread ------------------------------------------------------------------------------

  def now(self) -> float:
    return time.monotonic() - self._t0

  def start(self) -> EngineLoop:
    self._thread.start()
    return self

  def alive(self) -> bool:
    return self._thread.is_alive() and not self._stopping

  def num_running(self) -> int:
    return len(self.scheduler.running)

  def num_waiting(self) -> int:
    return len(self._inbox) + len(self.scheduler.waiting) + len(self._quarantine)

  def pending_cancels(self) -> int:
    return len(self._cancels)

  def pages_in_use(self) -> int:
    return self.pool.num_in_use

  def hit_rate(self) -> float:
    stats = self.scheduler.stats
    return stats.first_cached_tokens / stats.first_prompt_tokens if stats.first_prompt_tokens else 0

  def submit(self, requests: list[GenRequest], sinks: list[Sink]) -> None:
    """Queues requests (all or none); raises QueueFull, or ValueError for a request the engine
    refuses (a second line of defence behind the HTTP checks: nothing unservable is queued)."""
    for request in requests:
      self.engine.check_request(request)
    if not self.ready.is_set():
      raise Warming(f"the server is warming up: compiling step shapes ({self.warmup_progress}).")
    with self._cond:
      if self._stopping:
        raise QueueFull("the server is shutting down.")
      if self.num_waiting() + len(requests) > self.max_waiting:
        raise QueueFull(f"{self.num_waiting()} requests are waiting (max_waiting).")
      arrival = self.now()
      for request, sink in zip(requests, sinks):
        self._inbox.append(
          (dataclasses.replace(request, arrival_s=arrival), _Tracked(sink, time.monotonic()))
        )
      self._cond.notify()

  def cancel(self, request_id: int) -> None:
    """Drops a request wherever it is (no-op once finished); no event follows."""
    with self._cond:
      self._cancels.append(request_id)
      self._cond.notify()

  def stop(self, timeout: float | None = None) -> None:
    """Serves what was submitted, then ends the thread."""
    with self._cond:
      self._stopping = True
      self._cond.notify()
    self._thread.join(timeout)

  # -- The loop thread -------------------------------------------------------------------------

  def _warm(self) -> None:
    start = time.monotonic()

    def progress(done: int, total: int) -> None:
      self.warmup_progress = f"{done} of {total}"
      if done == total or done % max(1, total // 4) == 0:
        log.info("warm-up: %d of %d step shapes compiled", done, total)

    self.warmup_shapes = self.engine.warmup(progress)
    self.warmup_s = time.monotonic() - start
    log.info("warm-up: %d step shapes in %.1f s", self.warmup_shapes, self.warmup_s)
    self.ready.set()

  def _has_work(self) -> bool:
    return self.scheduler.has_work() or bool(self._quarantine)

  def _run(self) -> None:
    if not self.ready.is_set():
      self._warm()
    while True:
      with self._cond:
        while not (self._inbox or self._cancels or self._stopping or self._has_work()):
          self._cond.wait()
        inbox, self._inbox = self._inbox, []
        cancels, self._cancels = self._cancels, []
        if self._stopping and not inbox and not self._has_work():
          return
      sched = self.scheduler  # Read each time: a restart (_restart) replaces it.
      for request, tracked in inbox:
        self._tracked[request.request_id] = tracked
        self.executor.add(request)
        if not sched.add_request(request):  # Protocol checks make this unreachable.
          self._fail(request.request_id, 400, "the request can never fit the KV pool.")
          sched.rejected.clear()
      for rid in cancels:
        self._abort(rid)
      self._release_probe()
      if not sched.has_work():
        continue
      try:
        sched.step(self.now())
      except Exception as e:
        self._recover(e)
        continue
      if self._probe in self.executor.last_batch:
        self._probe = None  # It ran a step: not the culprit.
      self._harvest()

  def _release_probe(self) -> None:
    """Re-admits the next quarantined request (at the head of the queue) once none is probed."""
    while self._probe is None and self._quarantine:
      seq = self._quarantine.popleft()
      if seq.request.request_id in self._tracked:  # Not cancelled meanwhile.
        self.scheduler.waiting.appendleft(seq)
        self._probe = seq.request.request_id

  def _recover(self, error: Exception) -> None:
    """After a failed step (module docstring): its requests back in the queue, the culprit
    failed alone when known, the others quarantined when not."""
    log.error("engine step failed: %s: %s", type(error).__name__, error)
    sched = self.scheduler
    batch = list(self.executor.last_batch)
    if not self.executor.pages_valid():  # Failed on the device after taking the pages.
      self._restart(f"the engine step failed on the device: {type(error).__name__}: {error}")
      return
    for rid in reversed(batch):
      sched.requeue(rid)
    culprit = None
    if isinstance(error, RequestFailed):
      culprit = error.request_id
    elif self._probe in batch or len(batch) == 1:
      culprit = self._probe if self._probe in batch else batch[0]
    if culprit is not None:
      if culprit == self._probe:
        self._probe = None
      sched.abort(culprit)
      self.metrics.inc("looped:requests_failed_total")
      self._fail(culprit, 500, f"the engine failed on this request: {error}")
      return
    for rid in batch:  # Unknown culprit: each goes back alone (_release_probe).
      seq = sched.abort(rid)
      if seq is not None:
        self._quarantine.append(seq)

  def _restart(self, message: str) -> None:
    """Fresh pages, pool and scheduler: the cached K/V every request relied on are gone, so
    every request in flight fails (none can be resumed). The new pool is in place before any
    request hears of its failure."""
    lost = list(self.scheduler.running) + list(self.scheduler.waiting) + list(self._quarantine)
    self._quarantine.clear()
    self._probe = None
    self.executor.reset_pages()
    self.pool = pages_lib.PagePool(self.engine.num_pages)
    stats = self.scheduler.stats
    self.scheduler = scheduler_lib.Scheduler(self.engine.config, self.pool, self.executor)
    self.scheduler.stats = stats
    for seq in lost:
      self._fail(seq.request.request_id, 500, message)

  def _on_token(self, state: RequestState) -> None:
    """Called by the executor after each generated token (inside the step)."""
    rid = state.request.request_id
    tracked = self._tracked.get(rid)
    if tracked is None:
      return
    now = time.monotonic()
    if tracked.last_token is None:
      self.metrics.observe("vllm:time_to_first_token_seconds", now - tracked.arrival)
    else:
      self.metrics.observe("vllm:inter_token_latency_seconds", now - tracked.last_token)
    tracked.last_token = now
    top = state.positions.get(len(state.tokens) - 2)  # The position that predicted the token.
    prompt_positions = None
    if len(state.generated) == 1 and state.positions:
      n = state.request.prompt_len - 1
      prompt_positions = {p: v for p, v in state.positions.items() if p < n}
    tracked.sink(
      Token(
        state.generated[-1],
        state.logprobs[-1],
        None if top is None else (top[1], top[2]),
        state.text,
        state.finish_reason,
        prompt_positions,
      )
    )

  def _harvest(self) -> None:
    sched = self.scheduler
    for seq in sched.finished:
      rid = seq.request.request_id
      state = self.executor.states.pop(rid)
      tracked = self._tracked.pop(rid, None)
      reason = state.finish_reason or "length"
      self.metrics.inc("vllm:request_success_total", finished_reason=_vllm_reason(reason))
      self.metrics.inc("vllm:prompt_tokens_total", seq.request.prompt_len)
      self.metrics.inc("vllm:generation_tokens_total", len(state.generated))
      self.metrics.inc("vllm:prefix_cache_queries_total", seq.request.prompt_len)
      self.metrics.inc("vllm:prefix_cache_hits_total", seq.cached_tokens)
      self.metrics.inc("vllm:num_preemptions_total", seq.num_preemptions)
      if tracked is None:
        continue
      self.metrics.observe("vllm:e2e_request_latency_seconds", time.monotonic() - tracked.arrival)
      tracked.sink(
        Done(
          list(state.generated),
          list(state.logprobs),
          state.text,
          reason,
          state.positions,
          seq.cached_tokens,
        )
      )
    sched.finished.clear()

  def _abort(self, rid: int) -> None:
    seq = self.scheduler.abort(rid)
    self.executor.states.pop(rid, None)
    if self._tracked.pop(rid, None) is not None and seq is not None:
      self.metrics.inc("looped:requests_aborted_total")

  def _fail(self, rid: int, status: int, message: str) -> None:
    self.executor.states.pop(rid, None)
    tracked = self._tracked.pop(rid, None)
    if tracked is not None:
      tracked.sink(Failed(status, message))


def _vllm_reason(reason: str) -> str:
  return "length" if reason == "length" else "stop"
