"""The engine's continuous-batching loop on a thread of its own, fed by HTTP handlers.

One thread drives the engine's online API (`Engine.add_request`, `step`, `abort`; the engine
owns the page pool, so the prefix cache lives as long as the server, the scheduler and every
request's state); handlers only `submit` and `cancel`, which take a lock for a list append. Each
request has a sink, a thread-safe callable that receives its events: a `Token` per generated
token, then one `Done` (sent after the step that finished it, so its pages are already free) or
one `Failed`. Time is wall time since the loop started; the engine's scheduler runs on it as it
does on the simulator's clock. A failed step is the engine's to recover from (`Engine`): it
reports the requests it gave up on, which get a 500.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from looped.engine.engine import Engine
from looped.engine.requests import Failure, Generation, GenRequest, StepOutput, TokenEvent
from looped.server.metrics import Metrics

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
  """The waiting queue holds max_waiting requests already."""


class Warming(RuntimeError):
  """The engine is still compiling its step shapes (EngineLoop warmup)."""


Token = TokenEvent  # What a sink receives per generated token.


@dataclasses.dataclass(frozen=True)
class Done:
  tokens: list[int]
  logprobs: list[float]
  text: str
  finish_reason: str  # 'length', 'stop_token' or 'stop_string'.
  positions: dict  # RequestState.positions (empty unless position_logprobs).
  cached_prompt_tokens: int
  recurrences: tuple[int, ...] = ()  # Of the call that produced each token (Generation's).
  drafted_tokens: int = 0  # Self-speculative decoding: tokens drafted, drafts kept.
  accepted_tokens: int = 0


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
    self.max_waiting = max_waiting
    self.metrics = metrics
    self._cond = threading.Condition()
    self._inbox: list[tuple[GenRequest, _Tracked]] = []
    self._cancels: list[int] = []
    self._tracked: dict[int, _Tracked] = {}
    self._stopping = False
    self._t0 = time.monotonic()
    self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
    self.error: BaseException | None = None
    self._warmup = warmup
    self.ready = threading.Event()
    self.warmup_s: float | None = None
    self.warmup_progress = "starting"
    self.warmup_shapes = 0
    self._background_total = 0  # Step shapes the background warm-up compiles,
    self._background_done = 0  # and those compiled so far.
    if not warmup:
      self.ready.set()
    self._register_gauges(metrics)

  def _register_gauges(self, metrics: Metrics) -> None:
    engine = self.engine
    metrics.histogram(
      "looped:recurrences_per_token",
      tuple(range(1, engine.model.cfg.num_recurrences + 1)),
      "Recurrences of the call that produced each generated token (test-time depth).",
    )
    metrics.gauge("vllm:num_requests_running", "Requests in the running batch.", self.num_running)
    metrics.gauge("vllm:num_requests_waiting", "Requests queued.", self.num_waiting)
    metrics.gauge(
      "vllm:kv_cache_usage_perc",
      "Fraction of KV pages held by requests (1 = full).",
      lambda: engine.pages_in_use() / engine.num_pages,
    )
    metrics.gauge("looped:kv_pages_used", "KV pages held by requests.", self.pages_in_use)
    metrics.gauge("looped:kv_pages_total", "KV pages in the pool.", lambda: engine.num_pages)
    metrics.gauge("looped:engine_steps", "Engine steps run.", lambda: self.stats.num_steps)
    metrics.gauge(
      "looped:step_shapes_compiled",
      "Step shapes compiled (the rest compile in the background; a step never compiles).",
      engine.num_compiled_shapes,
    )
    metrics.gauge(
      "looped:step_shapes_pending",
      "Step shapes the warm-up has yet to compile in the background (meanwhile steps run padded "
      "to a larger compiled shape, beside the compiles).",
      lambda: max(0, self._background_total - self._background_done),
    )
    metrics.gauge(
      "looped:engine_busy_seconds",
      "Wall time spent inside engine steps.",
      lambda: self.stats.busy_s,
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

  @property
  def stats(self):
    """The engine scheduler's counters (steps, busy time, preemptions, prefix hits)."""
    return self.engine.stats

  def num_running(self) -> int:
    return self.engine.num_running()

  def num_waiting(self) -> int:
    return len(self._inbox) + self.engine.num_waiting()

  def pending_cancels(self) -> int:
    return len(self._cancels)

  def pages_in_use(self) -> int:
    return self.engine.pages_in_use()

  def hit_rate(self) -> float:
    return self.engine.hit_rate()

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
    """Serves what was submitted, then ends the thread and the engine's background compiles."""
    with self._cond:
      self._stopping = True
      self._cond.notify()
    self._thread.join(timeout)
    self.engine.stop_compiling(timeout)

  # -- The loop thread -------------------------------------------------------------------------

  def _warm(self) -> None:
    """Compiles the shapes every step fits, then opens; the rest compile in the background
    (Engine.start_warmup), so no request waits for a compile."""
    start = time.monotonic()

    def progress(done: int, total: int) -> None:
      self.warmup_progress = f"{done} of {total} in the background"
      self._background_done = done
      if done == total:
        log.info("background compile: %d more step shapes in %.1f s", total, self.now())

    now, total = self.engine.start_warmup(progress)
    self.warmup_shapes = now
    self._background_total = total - now
    self.warmup_s = time.monotonic() - start
    log.info(
      "warm-up: %d of %d step shapes in %.1f s; the rest compile in the background",
      now,
      total,
      self.warmup_s,
    )
    self.ready.set()

  def _run(self) -> None:
    if not self.ready.is_set():
      self._warm()
    engine = self.engine
    while True:
      with self._cond:
        while not (self._inbox or self._cancels or self._stopping or engine.has_unfinished()):
          self._cond.wait()
        inbox, self._inbox = self._inbox, []
        cancels, self._cancels = self._cancels, []
        if self._stopping and not inbox and not engine.has_unfinished():
          return
      for request, tracked in inbox:
        self._tracked[request.request_id] = tracked
        try:
          engine.add_request(request)
        except ValueError as e:  # submit's checks make this unreachable.
          self._fail(Failure(request.request_id, str(e)), status=400)
      for rid in cancels:
        self._abort(rid)
      if engine.has_unfinished():
        self._deliver(engine.step(self.now()))

  def _deliver(self, out: StepOutput) -> None:
    """A step's events to their sinks, and the metrics they count."""
    for event in out.tokens:
      self._on_token(event)
    for generation in out.finished:
      self._done(generation)
    for failure in out.failed:
      if not failure.pool_lost:
        self.metrics.inc("looped:requests_failed_total")
      self._fail(failure)

  def _on_token(self, event: TokenEvent) -> None:
    tracked = self._tracked.get(event.request_id)
    if tracked is None:
      return
    now = time.monotonic()
    if tracked.last_token is None:
      self.metrics.observe("vllm:time_to_first_token_seconds", now - tracked.arrival)
    else:
      self.metrics.observe("vllm:inter_token_latency_seconds", now - tracked.last_token)
    tracked.last_token = now
    self.metrics.observe("looped:recurrences_per_token", event.recurrences)
    tracked.sink(event)

  def _done(self, g: Generation) -> None:
    tracked = self._tracked.pop(g.request_id, None)
    self.metrics.inc("vllm:request_success_total", finished_reason=_vllm_reason(g.finish_reason))
    self.metrics.inc("vllm:prompt_tokens_total", g.prompt_len)
    self.metrics.inc("vllm:generation_tokens_total", len(g.tokens))
    self.metrics.inc("vllm:prefix_cache_queries_total", g.prompt_len)
    self.metrics.inc("vllm:prefix_cache_hits_total", g.cached_prompt_tokens)
    self.metrics.inc("vllm:num_preemptions_total", g.num_preemptions)
    self.metrics.inc("vllm:spec_decode_num_drafts_total", len(g.speculative_rounds))
    self.metrics.inc("vllm:spec_decode_num_draft_tokens_total", g.drafted_tokens)
    self.metrics.inc("vllm:spec_decode_num_accepted_tokens_total", g.accepted_tokens)
    if tracked is None:
      return
    self.metrics.observe("vllm:e2e_request_latency_seconds", time.monotonic() - tracked.arrival)
    tracked.sink(
      Done(
        g.tokens,
        g.logprobs,
        g.text,
        g.finish_reason,
        g.positions,
        g.cached_prompt_tokens,
        tuple(g.recurrences),
        g.drafted_tokens,
        g.accepted_tokens,
      )
    )

  def _abort(self, rid: int) -> None:
    found = self.engine.abort(rid)
    if self._tracked.pop(rid, None) is not None and found:
      self.metrics.inc("looped:requests_aborted_total")

  def _fail(self, failure: Failure, status: int = 500) -> None:
    tracked = self._tracked.pop(failure.request_id, None)
    if tracked is not None:
      tracked.sink(Failed(status, failure.message))


def _vllm_reason(reason: str) -> str:
  return "length" if reason == "length" else "stop"
