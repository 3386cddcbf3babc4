"""Generation on the serving scheduler: page pool, prefix cache, continuous batching, the model.

An `EngineConfig` holds what an engine serves with (layout, budget, limits, padded shapes).
`Engine.generate` queues requests (by arrival time), lets looped.scheduler.scheduler decide every
step (admission, chunked prefill, prefix-cache hits, preemption by recompute) exactly as the
simulator does, and runs each step on the model through `ModelExecutor`. Time is the engine's
clock: measured step wall time by default, or the duration another executor prices the same
batch at (`clock`, e.g. the simulator's cost model), which makes the schedule, and so the
hit rate, identical to the simulator's for the same requests.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from looped.engine import padding as padding_lib
from looped.engine import paged_cache, step_table
from looped.engine.config import ATTENTION_IMPLS
from looped.engine.executor import ModelExecutor, RequestFailed, RequestState
from looped.engine.mesh import EngineMesh
from looped.engine.requests import (
  DepthParams,
  Failure,
  Generation,
  GenRequest,
  StepOutput,
  TokenEvent,
)
from looped.engine.speculative import SpeculativeParams
from looped.model import adaptive, mixers
from looped.model import kv_policy as kv_policy_lib
from looped.model.cache_layout import KVLayout
from looped.model.looped_lm import LoopedLM
from looped.scheduler import pages as pages_lib
from looped.scheduler import scheduler as scheduler_lib
from pallas_kernels import platform

log = logging.getLogger(__name__)


def pages_for_budget(
  model: LoopedLM, budget_bytes: float, layout: KVLayout, max_num_seqs: int
) -> int:
  """Pages a KV budget holds in the layout once it holds the state slots of max_num_seqs
  requests (models with KDA layers; 0 bytes otherwise)."""
  return layout.pages_for_budget(model.cfg, budget_bytes, max_num_seqs)


# The gen and serve configs' default prefill block (their comments say why).
DEFAULT_PREFILL_BLOCK = 32


# Smallest page on which 'auto' picks the kernel on GPU: a page tile is a dot operand, and
# Triton's dot wants at least 16 rows (paged_decode pads queries and own tokens, not pages).
MIN_GPU_KERNEL_PAGE = 16


def _power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def attention_impl(
  requested: str, mesh_shape: tuple[int, ...], page_size: int = 16, head_dim: int = 128
) -> str:
  """The attention an engine's calls run (EngineConfig.attention_impl resolved): 'auto' is
  'pallas' on TPU, and on GPU when a page tile [page_size, head_dim] is one Triton takes (both
  powers of two, page_size >= MIN_GPU_KERNEL_PAGE), with a one-device mesh; else 'xla'.
  ValueError on a value not in ATTENTION_IMPLS, or 'pallas' on a mesh of several devices (the
  kernel is not partitioned)."""
  if requested not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl = {requested!r}: expected one of {ATTENTION_IMPLS}.")
  one_device = max(mesh_shape) == 1
  if requested == "pallas" and not one_device:
    raise ValueError(
      f"attention_impl = 'pallas' runs on one device; mesh_shape = {tuple(mesh_shape)} needs "
      "'xla' (or 'auto')."
    )
  if requested == "auto":
    device = platform.platform()
    tiles = page_size >= MIN_GPU_KERNEL_PAGE and _power_of_two(page_size * head_dim)
    kernel = device == "tpu" or (device == "gpu" and tiles)
    return "pallas" if one_device and kernel else "xla"
  return requested


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """What an Engine serves with: the cache layout and budget, the scheduler's limits and the
  padded shapes it compiles. Plain values, so one config can be logged, compared and reused."""

  # Cache only the final recurrence's core K/V (docs/design.md §3): fewer bytes per token.
  share_kv: bool
  # KV pages in the pool: the memory budget (pages_for_budget converts a byte budget). A model
  # with KDA layers also holds max_num_seqs state slots (paged_cache.bytes_per_sequence each).
  num_pages: int
  # Format the cached K/V are stored in (looped.kv_quant; None: raw compute-dtype arrays).
  kv_format: str | None = None
  # Under share_kv, which cached recurrence each recurrence reads for earlier tokens
  # (looped/model/kv_policy.py; docs/design.md §3): the pages keep its cached recurrences.
  kv_policy: str = "final"
  # Tokens per page: the unit of allocation and of prefix-cache hits.
  page_size: int = 16
  # Tokens one step computes over all rows; longer prompts are prefilled in chunks.
  max_num_batched_tokens: int = 64
  # Requests one step holds (batch rows); more wait in the queue.
  max_num_seqs: int = 8
  # Longest prompt + output a request may have (None: the model's max_seq_len).
  max_model_len: int | None = None
  # Prefill block (docs/design.md §3): chunks never cross a multiple of it; under sharing a
  # block is one call whose tokens read each other's own recurrences; 1 is exact shared decode.
  # At most max_num_batched_tokens (None: the largest multiple of page_size up to
  # DEFAULT_PREFILL_BLOCK, or the page size).
  prefill_block: int | None = None
  # Padded row counts of a call, one compilation each (None: padding.geometric up to
  # max_num_seqs).
  row_buckets: tuple[int, ...] | None = None
  # Padded chunk lengths of the multi-token call (None: padding.geometric up to the longest
  # chunk, min(prefill_block, max_num_batched_tokens)).
  token_buckets: tuple[int, ...] | None = None
  # Padded page-table widths; a call attends over column_bucket * page_size slots
  # (None: powers of two up to max_model_len's page-table width).
  column_buckets: tuple[int, ...] | None = None
  # Keep every computed position's logits per request (tests compare them with a reference).
  record_logits: bool = False
  # Check the page pool's and scheduler's invariants every step (tests; slower).
  check_invariants: bool = False
  # k > 0 lets requests with position_logprobs record each position's next-token logprob and
  # top k (ModelExecutor).
  top_logprobs: int = 0
  # Device mesh (data, fsdp, tensor) over the first devices (looped.engine.mesh): params split
  # by mesh_rules, the page pool over KV heads where they divide; (1, 1, 1): one device.
  mesh_shape: tuple[int, int, int] = (1, 1, 1)
  # Logical axis -> mesh axes, as config.mesh_rules (configs/pretrain.py:mesh_rules); needed by
  # a mesh of more than one device.
  mesh_rules: tuple = ()
  # How a step's GQA layers read the pages: 'pallas' through pallas_kernels.paged_decode (no
  # dense gather; interpret mode on CPU), 'xla' from a dense gather, 'auto' the kernel on TPU
  # and GPU (page tiles Triton takes: attention_impl) with a one-device mesh, else XLA
  # (docs/engine.md).
  attention_impl: str = "auto"
  # Steps take each request's depth settings as data (GenRequest.depth; docs/design.md §3,
  # "Depth at test time"): its recurrences, exit criterion, ... in a while loop over
  # recurrences that ends when every row has exited. False: every token runs the model's R in
  # the scan, and requests asking for other settings are refused.
  adaptive_depth: bool = True
  # The most recurrences a request may ask for, the loop's static length (None: the model's R).
  # Above R the unshared layout pages this many core copies per token.
  max_recurrences: int | None = None
  # Unshared: what a token's later recurrences read of an earlier token that exited before
  # them (looped.model.adaptive.LOOKUPS; 'latest': its last K/V).
  exit_lookup: str = adaptive.DEFAULT_LOOKUP
  # The depth settings of a request that gives none (GenRequest.depth None).
  depth: DepthParams = DepthParams()
  # Self-speculative decoding (looped/engine/speculative.py) of a request that gives none
  # (GenRequest.speculative None; recurrences 0: off), the verify call's passes (1: 'block';
  # n: Jacobi passes, KV-sharing only) and the most tokens a request may draft per round.
  speculative: SpeculativeParams = SpeculativeParams()
  speculative_verify: int = 1
  max_speculative_tokens: int = 8

  @property
  def layout(self) -> KVLayout:
    """The pages' KVLayout: sharing, format, KV policy and page size as one value."""
    return KVLayout(self.share_kv, self.kv_format, self.kv_policy, self.page_size)


class Engine:
  """The paged generation engine as an online library: `add_request`, `step`, `abort`,
  `has_unfinished` (vLLM's LLMEngine calls), with the page pool, the scheduler and every
  request's state its own. `generate` (offline, on the engine's clock) and the server's loop
  (wall time, looped/server/engine_loop.py) are thin drivers of these calls.

  A failed step never fails the batch: the executor applies nothing of a step unless all of it
  succeeds, so the step's requests go back in the queue and the engine finds the culprit. A row
  that failed on its own data names its request (RequestFailed), which alone fails; any other
  failure quarantines the step's requests and re-admits them one at a time (each alone with
  whatever else runs), so the next failure names its culprit; a step that failed after the
  device took the pages rebuilds the pool and fails every request in flight (`Failure`). Each
  failure fails one request at least, so the engine always makes progress.
  """

  def __init__(
    self,
    model: LoopedLM,
    params,
    config: EngineConfig,
    *,
    clock: scheduler_lib.Executor | None = None,
    decode: Callable[[Sequence[int]], str] | None = None,
  ):
    """config: what to serve with (EngineConfig). clock: an executor whose priced duration of a
    step is the engine's time instead of the measured wall time (e.g. the simulator's cost
    model). decode: token ids -> text, for each request's generated text."""
    c = config
    self.trained_recurrences = model.cfg.num_recurrences
    model = _depth_model(model, c)
    _check_config(model, c)
    self.attention_impl = attention_impl(
      c.attention_impl, c.mesh_shape, c.page_size, model.cfg.head_dim
    )
    self.model = model
    self.engine_config = config
    self.max_model_len = c.max_model_len or model.cfg.max_seq_len
    stateful = paged_cache.has_state(model.cfg)
    self.num_slots = c.max_num_seqs if stateful else 0  # One state slot per running request.
    self.config = _scheduler_config(c, self.max_model_len, stateful)
    padding = _padding(c, self.config, self.max_model_len)
    speculative = len(padding.row_buckets) * len(padding.column_buckets)
    speculative = speculative if _speculates(c) and c.speculative.enabled else 0
    _check_shape_count(padding, self.config, self.max_model_len, speculative)
    self.num_pages = c.num_pages
    self.check_invariants = c.check_invariants
    self.mesh = EngineMesh.create(model.cfg, tuple(c.mesh_shape), c.mesh_rules)
    self.executor = ModelExecutor(
      model,
      params,
      num_pages=c.num_pages,
      layout=c.layout,
      num_slots=self.num_slots,
      padding=padding,
      clock=clock,
      record_logits=c.record_logits,
      decode=decode,
      top_logprobs=c.top_logprobs,
      mesh=self.mesh,
      attention_impl=self.attention_impl,
      exit_lookup=c.exit_lookup if c.adaptive_depth else None,
      trained_recurrences=self.trained_recurrences,
      speculative_passes=c.speculative_verify if _speculates(c) else 0,
      max_lookahead=c.max_speculative_tokens,
    )
    self.executor.on_token = self._on_token
    self.page_bytes = c.layout.page_bytes(model.cfg)
    self.slot_bytes = c.layout.bytes_per_sequence(model.cfg)
    self.results: dict[int, Generation] = {}  # The last generate call's, by request id.
    self.compile_thread: threading.Thread | None = None  # start_warmup's background compiles.
    self._stop_compiling = threading.Event()
    self._events: list[TokenEvent] = []  # The running step's tokens.
    self.reset()

  def reset(self, keep_stats: bool = False) -> None:
    """A fresh page pool and scheduler: no request, no cached prefix (the stats kept or not)."""
    stats = self.scheduler.stats if keep_stats else None
    self.pool = pages_lib.PagePool(self.num_pages, debug=self.check_invariants)
    self.scheduler = scheduler_lib.Scheduler(
      self.config, self.pool, self.executor, check_invariants=self.check_invariants
    )
    if stats is not None:
      self.scheduler.stats = stats
    self.executor.states = {}
    self._quarantine: collections.deque[scheduler_lib.Sequence] = collections.deque()
    self._probe: int | None = None  # The quarantined request re-admitted, until a step clears it.

  @property
  def pool_bytes(self) -> float:
    """Bytes of the KV pool: pages, and state slots of models with KDA layers (scratch page and
    slot excluded); what pages_for_budget fits into a budget."""
    return self.num_pages * self.page_bytes + self.num_slots * self.slot_bytes

  def step_shapes(self) -> list[tuple[int, int, int]]:
    """Every padded call shape the scheduler's batches can produce (one compilation each)."""
    c = self.config
    return self.executor.padding.reachable(
      c.max_num_seqs, c.max_num_batched_tokens, self.max_model_len, padding_lib.longest_chunk(c)
    )

  def speculative_shapes(self) -> list[tuple[int, int, int]]:
    """The speculative calls' shapes for the engine's default lookahead when it speculates by
    default (EngineConfig.speculative): every row and column bucket. A request asking another
    lookahead compiles its shapes on first use."""
    c, executor = self.engine_config, self.executor
    if executor.spec_steps is None or not c.speculative.enabled or c.speculative.tokens < 2:
      return []
    k = padding_lib.bucket(c.speculative.tokens, executor.lookahead_buckets)
    rows = [r for r in executor.padding.row_buckets if r <= max(c.max_num_seqs, 1)]
    rows = sorted(set(rows + [padding_lib.bucket(c.max_num_seqs, executor.padding.row_buckets)]))
    return [(r, k, col) for r in rows for col in executor.padding.column_buckets]

  def warmup(self, on_shape: Callable | None = None) -> int:
    """Compiles every step shape now (step_shapes, speculative_shapes), so that no request
    waits for a compile; returns how many. on_shape(done, total) follows progress."""
    shapes, spec = self.step_shapes(), self.speculative_shapes()
    self.executor.warmup(shapes, on_shape)
    self.executor.warmup_speculative(spec, on_shape)
    return len(shapes) + len(spec)

  def num_compiled_shapes(self) -> int:
    """Step shapes compiled and alive (what a strict step may run in)."""
    return len(self.executor.steps.shapes())

  def start_warmup(self, on_shape: Callable | None = None) -> tuple[int, int]:
    """Ready in the time of a few compiles, and still no step ever compiles: compiles the
    largest shapes now (cover_shapes: every call fits one of them), makes the steps strict
    (each runs in the smallest compiled shape that holds it) and compiles the other shapes in
    a background thread, smallest first, until done or `stop_compiling`. Returns (shapes
    compiled now, shapes in all); on_shape(done, total) follows the background compiles."""
    shapes, spec = self.step_shapes(), self.speculative_shapes()
    cover, spec_cover = cover_shapes(shapes), spec[-1:]  # The widest speculative call.
    self.executor.warmup(cover)
    self.executor.warmup_speculative(spec_cover)
    self.executor.strict = True
    size = lambda s: (s[1][0] * s[1][1] * s[1][2], s)
    rest = [(False, s) for s in set(shapes) - set(cover)]
    rest = sorted(rest + [(True, s) for s in spec[:-1]], key=size)
    self._stop_compiling.clear()
    stop = self._stop_compiling

    def compile_rest() -> None:
      try:
        for i, (speculative, shape) in enumerate(rest):
          if stop.is_set():
            return
          if speculative:
            self.executor.warmup_speculative([shape])
          else:
            self.executor.warmup([shape])
          if on_shape is not None:
            on_shape(i + 1, len(rest))
      except Exception as e:  # noqa: BLE001  The steps still run in the shapes compiled.
        log.error("background compile stopped: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=compile_rest, name="engine-compile", daemon=True)
    self.compile_thread = thread
    thread.start()
    # A daemon thread still inside XLA when the interpreter finalizes aborts the process
    # ("FATAL: exception not rethrown"): at exit, the compile in flight ends and no other starts.
    atexit.register(_stop_at_exit, weakref.ref(self))
    return len(cover) + len(spec_cover), len(shapes) + len(spec)

  def stop_compiling(self, timeout: float | None = None) -> None:
    """Ends start_warmup's background compiles: the one in flight finishes, no other starts."""
    self._stop_compiling.set()
    thread = self.compile_thread
    if thread is not None and thread is not threading.current_thread():
      thread.join(timeout)

  def check_request(self, request: GenRequest) -> None:
    """Raises ValueError naming what makes a request unservable (before any compute)."""
    rid = request.request_id
    if not request.prompt_tokens:
      raise ValueError(f"request {rid}: the prompt is empty.")
    vocab = self.model.cfg.vocab_size
    if min(request.prompt_tokens) < 0 or max(request.prompt_tokens) >= vocab:
      raise ValueError(f"request {rid}: prompt token ids must lie in [0, {vocab}).")
    request.sampling.check(vocab)
    self._speculative_of(request, self._depth_of(request))
    total = request.prompt_len + request.output_len
    if total > self.max_model_len:
      raise ValueError(
        f"request {rid}: prompt ({request.prompt_len}) + max_new_tokens ({request.output_len}) "
        f"= {total} exceeds max_model_len {self.max_model_len}."
      )
    need = -(-(total - 1) // self.config.page_size)
    if need > self.num_pages:
      raise ValueError(
        f"request {rid}: needs {need} KV pages at its longest, the budget holds {self.num_pages}."
      )

  # -- The online API --------------------------------------------------------------------------

  def add_request(self, request: GenRequest) -> None:
    """Queues a request (its arrival_s on the caller's clock); ValueError if unservable or if
    its id is in flight already."""
    self.check_request(request)
    depth = self._depth_of(request)
    request = dataclasses.replace(
      request, depth=depth, speculative=self._speculative_of(request, depth)
    )
    rid = request.request_id
    if rid in self.executor.states:
      raise ValueError(f"request {rid}: a request with this id is in flight.")
    if not self.scheduler.add_request(request):  # check_request makes this unreachable.
      self.scheduler.rejected.clear()
      raise ValueError(f"request {rid}: can never fit the KV pool.")
    self.executor.add(request)

  def abort(self, request_id: int) -> bool:
    """Drops a request wherever it is, its pages freed; False if it was not in flight."""
    seq = self.scheduler.abort(request_id)
    for i, held in enumerate(self._quarantine):
      if held.request.request_id == request_id:
        del self._quarantine[i]
        seq = held
        break
    if self._probe == request_id:
      self._probe = None
    self.executor.states.pop(request_id, None)
    return seq is not None

  def _depth_of(self, request: GenRequest) -> DepthParams:
    """The request's depth settings, checked, or the engine's default; recurrences 0 stands
    for the trained R (so requests at the model's own depth share prefix pages)."""
    c = self.engine_config
    depth = request.depth or c.depth
    try:
      depth.check(self.model.cfg.num_recurrences, self.model.cfg.exit_gate)
    except ValueError as e:
      raise ValueError(f"request {request.request_id}: {e}") from None
    if depth.recurrences == self.trained_recurrences:
      depth = dataclasses.replace(depth, recurrences=0)
    if not c.adaptive_depth and (depth.page_key() or depth.continuous_compute):
      raise ValueError(
        f"request {request.request_id}: this engine runs every token at the model's depth "
        "(EngineConfig.adaptive_depth is off); it takes no recurrences or exit settings."
      )
    return depth

  def _speculative_of(self, request: GenRequest, depth: DepthParams) -> SpeculativeParams:
    """The request's speculation, checked, or the engine's default (docs/engine.md)."""
    c = self.engine_config
    spec = request.speculative or c.speculative
    rid = request.request_id
    try:
      spec.check(depth.recurrences or self.trained_recurrences, c.max_speculative_tokens)
    except ValueError as e:
      raise ValueError(f"request {rid}: {e}") from None
    if spec.enabled and self.executor.spec_steps is None:
      raise ValueError(
        f"request {rid}: this engine does not speculate (it needs adaptive_depth and one device)."
      )
    if spec.enabled and (depth.exits or depth.continuous_compute):
      raise ValueError(
        f"request {rid}: speculative decoding drafts and verifies at fixed depths; it takes no "
        "exit criterion or continuous compute."
      )
    return spec

  @property
  def stats(self) -> scheduler_lib.SchedulerStats:
    """The scheduler's counters: steps, busy time, preemptions, prefix hits."""
    return self.scheduler.stats

  def has_unfinished(self) -> bool:
    return self.scheduler.has_work() or bool(self._quarantine)

  def num_running(self) -> int:
    return len(self.scheduler.running)

  def num_waiting(self) -> int:
    return len(self.scheduler.waiting) + len(self._quarantine)

  def pages_in_use(self) -> int:
    return self.pool.num_in_use

  def hit_rate(self) -> float:
    """Prefix-cache hit rate: cached over prompt tokens at first admissions (0 before any)."""
    stats = self.scheduler.stats
    return stats.first_cached_tokens / stats.first_prompt_tokens if stats.first_prompt_tokens else 0

  def step(self, now: float, next_arrival_s: float = math.inf) -> StepOutput:
    """Runs one step at time `now` (the caller's clock): its tokens, finished and failed
    requests, and the time it ended (now + its duration, measured or priced by the clock)."""
    self._release_probe()
    if not self.scheduler.has_work():
      return StepOutput(now)
    self._events = []
    try:
      end = self.scheduler.step(now, next_arrival_s)
    except Exception as e:  # noqa: BLE001  Any failure is recovered from (class docstring).
      return StepOutput(now, failed=self._recover(e))
    if self._probe in self.executor.last_batch:
      self._probe = None  # It ran a step: not the culprit.
    out = StepOutput(end, tokens=self._events, finished=self._harvest())
    self._events = []
    return out

  def _on_token(self, state: RequestState) -> None:
    """The executor's hook after each generated token (inside the step)."""
    top = state.positions.get(len(state.tokens) - 2)  # The position that predicted the token.
    prompt_positions = None
    if len(state.generated) == 1 and state.positions:
      n = state.request.prompt_len - 1
      prompt_positions = {p: v for p, v in state.positions.items() if p < n}
    self._events.append(
      TokenEvent(
        state.request.request_id,
        state.generated[-1],
        state.logprobs[-1],
        None if top is None else (top[1], top[2]),
        state.text,
        state.finish_reason,
        len(state.generated),
        prompt_positions,
        state.token_depths[-1] if state.token_depths else 0,
      )
    )

  def _harvest(self) -> list[Generation]:
    """The results of the requests the scheduler finished; their states let go."""
    out = []
    for seq in self.scheduler.finished:
      state = self.executor.states.pop(seq.request.request_id)
      out.append(_generation(seq, state))
    self.scheduler.finished.clear()
    return out

  def _release_probe(self) -> None:
    """Re-admits the next quarantined request (at the head of the queue) once none is probed."""
    if self._probe is None and self._quarantine:
      seq = self._quarantine.popleft()
      self.scheduler.waiting.appendleft(seq)
      self._probe = seq.request.request_id

  def _recover(self, error: Exception) -> list[Failure]:
    """After a failed step (class docstring): its requests back in the queue, the culprit
    failed alone when known, the others quarantined when not."""
    log.error("engine step failed: %s: %s", type(error).__name__, error)
    sched = self.scheduler
    batch = list(self.executor.last_batch)
    if not self.executor.pages_valid():  # Failed on the device after taking the pages.
      what = f"{type(error).__name__}: {error}"
      return self._lose_pool(f"the engine step failed on the device: {what}")
    for rid in reversed(batch):
      sched.requeue(rid)
    culprit = None
    if isinstance(error, RequestFailed):
      culprit = error.request_id
    elif self._probe in batch or len(batch) == 1:
      culprit = self._probe if self._probe in batch else batch[0]
    if culprit is not None:
      self.abort(culprit)
      return [Failure(culprit, f"the engine failed on this request: {error}")]
    for rid in batch:  # Unknown culprit: each goes back alone (_release_probe).
      seq = sched.abort(rid)
      if seq is not None:
        self._quarantine.append(seq)
    return []

  def _lose_pool(self, message: str) -> list[Failure]:
    """Fresh pages, pool and scheduler: the cached K/V every request relied on are gone, so
    every request in flight fails (none can be resumed)."""
    sched = self.scheduler
    lost = [s.request.request_id for s in (*sched.running, *sched.waiting, *self._quarantine)]
    self.executor.reset_pages()
    self.reset(keep_stats=True)
    return [Failure(rid, message, pool_lost=True) for rid in lost]

  # -- The offline driver ----------------------------------------------------------------------

  def generate(
    self, requests: Sequence[GenRequest], on_token: Callable[[TokenEvent], None] | None = None
  ) -> list[Generation]:
    """Serves the requests to completion on the engine's clock, each joining at its arrival_s,
    from a fresh pool (as the simulator replays a trace); results in the order given.

    on_token(event) is called after every generated token (streaming).
    """
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
      raise ValueError("request ids must be unique.")
    for r in requests:
      self.check_request(r)
    if self.has_unfinished():
      raise RuntimeError("generate needs an idle engine: requests are in flight.")
    self.reset()
    pending = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
    results: dict[int, Generation] = {}
    now = 0.0
    while pending or self.has_unfinished():
      while pending and pending[0].arrival_s <= now:
        self.add_request(pending.popleft())
      if not self.has_unfinished():
        now = pending[0].arrival_s  # Idle until the next arrival.
        continue
      out = self.step(now, pending[0].arrival_s if pending else math.inf)
      if out.failed:
        raise RuntimeError(f"request {out.failed[0].request_id}: {out.failed[0].message}")
      now = out.now
      for event in out.tokens if on_token is not None else ():
        on_token(event)
      results.update((g.request_id, g) for g in out.finished)
    self._check_released()
    self.results = results
    return [results[i] for i in ids]

  def _check_released(self) -> None:
    if self.pool.num_in_use:
      raise RuntimeError(f"{self.pool.num_in_use} pages still held after serving (a leak).")
    if len(self.scheduler.free_slots) != self.num_slots:
      raise RuntimeError(
        f"{self.num_slots - len(self.scheduler.free_slots)} state slots still held."
      )

  def summary(self, generations: Sequence[Generation]) -> dict[str, Any]:
    """Throughput, latency and cache figures of the last generate call."""
    sched = self.scheduler
    stats = sched.stats
    tokens = sum(len(g.tokens) for g in generations)
    busy = stats.busy_s
    ttft = np.asarray([g.ttft_s for g in generations])
    depths = [d for g in generations for d in g.recurrences]
    rounds = sum(len(g.speculative_rounds) for g in generations)
    drafted = sum(g.drafted_tokens for g in generations)
    accepted = sum(g.accepted_tokens for g in generations)
    return {
      "num_requests": len(generations),
      "generated_tokens": tokens,
      "mean_recurrences": float(np.mean(depths)) if depths else None,
      "prompt_tokens": stats.first_prompt_tokens,
      "tokens_per_s": tokens / busy if busy else None,
      "ttft_s": {"mean": float(ttft.mean()), "p50": float(np.median(ttft))},
      "hit_rate": stats.first_cached_tokens / stats.first_prompt_tokens
      if stats.first_prompt_tokens
      else None,
      "preemptions": stats.num_preemptions,
      "num_steps": stats.num_steps,
      "speculative_rounds": rounds,
      "drafted_tokens": drafted,
      "accepted_tokens": accepted,
      "acceptance_rate": accepted / drafted if drafted else None,
      "busy_s": busy,
      "num_pages": self.num_pages,
      "page_bytes": self.page_bytes,
      "num_state_slots": self.num_slots,
      "state_slot_bytes": self.slot_bytes,
      "kv_pool_bytes": self.pool_bytes,
      "peak_pages_in_use": sched.pool.peak_in_use,
      "pages_in_use_at_end": sched.pool.num_in_use,
    }


def _generation(seq: scheduler_lib.Sequence, state: RequestState) -> Generation:
  r = seq.request
  return Generation(
    request_id=r.request_id,
    prompt=r.prompt_text,
    text=state.text,
    tokens=list(state.generated),
    logprobs=list(state.logprobs),
    finish_reason=state.finish_reason or "length",
    cached_prompt_tokens=seq.cached_tokens,
    num_preemptions=seq.num_preemptions,
    ttft_s=seq.first_token_s - seq.arrival_s,
    latency_s=seq.finish_s - seq.arrival_s,
    prompt_len=r.prompt_len,
    logits=state.logits,
    positions=state.positions,
    recurrences=list(state.token_depths),
    speculative_rounds=list(state.rounds),
    drafted_tokens=state.drafted,
    accepted_tokens=state.accepted,
  )


def _depth_model(model: LoopedLM, c: EngineConfig) -> LoopedLM:
  """The model the steps run: looping up to max_recurrences (its R, the loop's length, and the
  unshared layout's core copies), the same params."""
  r = model.cfg.num_recurrences
  top = c.max_recurrences or r
  if isinstance(top, bool) or not isinstance(top, int) or top < r:
    raise ValueError(f"max_recurrences = {top!r} must be an integer >= the model's R = {r}.")
  if top > r and not c.adaptive_depth:
    raise ValueError(f"max_recurrences = {top} > R = {r} needs adaptive_depth.")
  return model if top == r else LoopedLM(dataclasses.replace(model.cfg, num_recurrences=top))


def _speculates(c: EngineConfig) -> bool:
  """Whether the engine runs speculative rounds (a request may ask for them)."""
  return c.adaptive_depth and max(c.mesh_shape) == 1 and c.max_speculative_tokens > 0


def _check_config(model: LoopedLM, c: EngineConfig) -> None:
  """ValueError naming what the model and config cannot serve with."""
  paged_cache.check_model(model.cfg)
  if not 1 <= c.speculative_verify:
    raise ValueError(f"speculative_verify = {c.speculative_verify}: passes must be >= 1.")
  if c.speculative_verify > 1 and not c.share_kv:
    raise ValueError(
      f"speculative_verify = {c.speculative_verify} Jacobi passes: an unshared cache verifies "
      "exactly in one pass ('block'); the passes are for KV-sharing."
    )
  if c.speculative_verify > 1 and not mixers.all_with(model.cfg, "core", "attends"):
    raise ValueError("speculative_verify Jacobi passes re-read per-token entries: attention cores.")
  if c.exit_lookup not in adaptive.LOOKUPS:
    raise ValueError(f"exit_lookup = {c.exit_lookup!r}: expected one of {adaptive.LOOKUPS}.")
  if c.exit_lookup != adaptive.DEFAULT_LOOKUP and not mixers.all_with(model.cfg, "core", "attends"):
    raise ValueError(f"exit_lookup {c.exit_lookup!r} reads per-token entries: attention cores.")
  kv_policy_lib.parse(c.kv_policy, model.cfg.num_recurrences, "kv_policy")
  if c.kv_policy != kv_policy_lib.FINAL and not mixers.all_with(model.cfg, "core", "kv_policies"):
    others = ", ".join(m.upper() for m in mixers.lacking(model.cfg, "core", "kv_policies"))
    raise ValueError(f"kv_policy {c.kv_policy!r}: {others} core layers share as 'final' only.")
  if c.num_pages < 1:
    raise ValueError(f"num_pages = {c.num_pages}: the KV budget holds no page.")
  if max(c.mesh_shape) > 1 and not c.mesh_rules:
    raise ValueError(
      f"mesh_shape = {c.mesh_shape} needs mesh_rules (logical axis -> mesh axes) to split "
      "the model; without them every device would hold a full replica."
    )


def _scheduler_config(
  c: EngineConfig, max_model_len: int, stateful: bool
) -> scheduler_lib.SchedulerConfig:
  block = c.prefill_block
  if block is None:
    limit = min(DEFAULT_PREFILL_BLOCK, c.max_num_batched_tokens)
    block = max(limit // c.page_size, 1) * c.page_size
  if block < 1 or block > c.max_num_batched_tokens:
    raise ValueError(
      f"prefill_block = {block} must be in [1, max_num_batched_tokens = "
      f"{c.max_num_batched_tokens}]: a block is one call, never split."
    )
  return scheduler_lib.SchedulerConfig(
    c.page_size,
    c.max_num_batched_tokens,
    c.max_num_seqs,
    max_model_len,
    prefill_block=block,
    shared_blocks=c.share_kv,
    state_slots=stateful,
    prefix_caching=not stateful,  # A KDA state is not a function of a page.
  )


def _padding(
  c: EngineConfig, sched: scheduler_lib.SchedulerConfig, max_model_len: int
) -> padding_lib.Padding:
  """The padded call shapes: the configured buckets, or padding.default_buckets."""
  longest = padding_lib.longest_chunk(sched)
  rows, tokens, columns = padding_lib.default_buckets(
    c.max_num_seqs, longest, -(-max_model_len // c.page_size)
  )
  row_buckets = tuple(sorted(c.row_buckets or rows))
  token_buckets = tuple(sorted(c.token_buckets or tokens))
  if row_buckets[-1] < c.max_num_seqs or token_buckets[-1] < longest:
    raise ValueError(
      f"buckets {row_buckets} x {token_buckets} must reach max_num_seqs = {c.max_num_seqs} "
      f"and the longest chunk, {longest} tokens."
    )
  columns = c.column_buckets or columns
  return padding_lib.Padding.create(c.page_size, row_buckets, token_buckets, columns, max_model_len)


def _stop_at_exit(engine_ref) -> None:
  engine = engine_ref()
  if engine is not None:
    engine.stop_compiling()


def cover_shapes(shapes) -> list[tuple[int, int, int]]:
  """The shapes no other of their kind (one-token call, chunk call) holds: each holds as many
  or more rows, tokens and columns, so every call of the list fits one of them."""

  def holds(a, b) -> bool:
    return (a[1] == 1) == (b[1] == 1) and all(x >= y for x, y in zip(a, b))

  unique = sorted(set(shapes))
  return [s for s in unique if not any(o != s and holds(o, s) for o in unique)]


def _check_shape_count(
  padding: padding_lib.Padding,
  sched: scheduler_lib.SchedulerConfig,
  max_model_len: int,
  speculative: int = 0,
) -> None:
  """ValueError, before anything compiles, for buckets reaching more call shapes (and
  `speculative` speculative ones) than a process keeps compiled (step_table.MAX_LIVE_STEPS)."""
  count = speculative + len(
    padding.reachable(
      sched.max_num_seqs,
      sched.max_num_batched_tokens,
      max_model_len,
      padding_lib.longest_chunk(sched),
    )
  )
  if count > step_table.MAX_LIVE_STEPS:
    raise ValueError(
      f"buckets rows {padding.row_buckets} x tokens {padding.token_buckets} x columns "
      f"{padding.column_buckets} reach {count} step shapes, over the {step_table.MAX_LIVE_STEPS} "
      "compiled steps a process keeps (each maps ~300 memory regions on XLA:CPU, against "
      "vm.max_map_count; docs/server.md): give fewer buckets."
    )
