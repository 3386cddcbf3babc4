"""Continuous-batching scheduler over a paged, prefix-cached KV pool (vLLM v1 semantics).

Each step:
1. Running requests, in admission order, get their next tokens (one for a decode, a chunk for a
   prefill) under a per-step token budget. A request that needs a page when none is free preempts
   the last admitted request (possibly itself): its pages are released, keeping their cached
   contents, and it returns to the front of the queue, to be recomputed on re-admission.
2. If nothing was preempted, queued requests are admitted first come, first served while budget,
   pages and the running cap allow; each reuses the longest cached run of its leading full pages
   (the last prompt token is always computed; `prefix_caching` off: none) and, with
   `state_slots`, takes a per-sequence state slot. A head that does not fit blocks the queue.
3. The executor runs the batch and returns its duration (a real executor may end a request
   early, on a stop token, by setting its Sequence's `stopped`). Pages that became full are
   registered in the prefix cache only then: under KV-sharing the cache holds final-recurrence
   K/V, which exists only once the step is done, so a request cannot hit pages computed in the
   same step.

A request needs ceil((prompt + output - 1) / page_size) pages at most (the last generated token is
never fed back); one that needs more than the pool holds, or exceeds max_model_len, is rejected on
arrival, so the first admitted request can always finish and the system never deadlocks.

When every running request is decoding and nothing else can change (no arrival, no finish, no
page shortage, no queued request that could start), steps differ only by their context lengths.
If the executor offers `decode_step_time`, such runs of steps are applied in one go: per-request
work is O(1) per run instead of per token, with results identical to stepping one at a time.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import math
from typing import Any, Protocol

from looped.scheduler import page_keys
from looped.scheduler import pages as pages_lib


@dataclasses.dataclass(eq=False)
class Sequence:
  """A request's serving state."""

  request: Any  # Has request_id, prompt_len, output_len and prompt_page_keys(page_size).
  arrival_s: float
  num_tokens: int  # Prompt plus tokens generated so far.
  num_computed: int = 0  # Leading tokens whose K/V is in this request's pages (hits included).
  num_output: int = 0
  pages: list[int] = dataclasses.field(default_factory=list)  # Block table.
  num_registered: int = 0  # Leading pages already offered to the prefix cache.
  prompt_keys: list | None = None
  admitted: bool = False
  cached_tokens: int = 0  # Prefix-cache hit at first admission.
  num_preemptions: int = 0
  first_token_s: float | None = None
  finish_s: float | None = None
  stopped: bool = False  # Set by an executor when a sampled token ends the request early.
  slot: int | None = None  # Its state slot while running (SchedulerConfig.state_slots).
  # Tokens its last speculative round emitted (set by the executor; StepBatch.speculative).
  emitted: int = 0


@dataclasses.dataclass
class StepBatch:
  """What one forward step computes: for each sequence, new tokens after its context."""

  seqs: list[Sequence]
  num_new_tokens: list[int]
  num_context_tokens: list[int]  # Tokens already in the cache before this step.
  num_sampled: int  # Sequences whose chunk ends at their last token: they emit a token.
  # Per sequence: a speculative round (num_new_tokens is its lookahead k, more than it has to
  # feed); the executor sets the sequence's `emitted` (1..k tokens) and the scheduler keeps
  # that many of the k positions, giving back pages past them.
  speculative: tuple[bool, ...] = ()


class Executor(Protocol):
  """Runs (or prices) a batch. A simulator may also offer decode_step_time(num_seqs, context)."""

  def execute(self, batch: StepBatch) -> float:
    """Returns the step's duration in seconds."""
    ...


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  page_size: int = 16  # Tokens per KV page.
  max_num_batched_tokens: int = 8192  # Token budget of one step (decodes + prefill chunks).
  max_num_seqs: int = 256  # Cap on running requests.
  max_model_len: int | None = None  # Longest prompt + output served (None: no limit).
  # Chunks never cross a multiple of this many tokens from the sequence start (None: no blocks).
  prefill_block: int | None = None
  # A cached position's values depend on its block (block prefill under KV-sharing, docs/design.md
  # §3): a prompt block is never split, prefix hits end at a block boundary, and positions after
  # the prompt are computed one per step, as decoding computed them (also when recomputed).
  shared_blocks: bool = False
  # Each running request holds one of max_num_seqs state slots (a recurrent mixer's state,
  # e.g. KDA): taken at admission, given back on finish, preemption or abort.
  state_slots: bool = False
  # Reuse cached pages of a matching prompt prefix. Off for a model with a recurrent state:
  # that state is not a function of a page, so a hit could not restore it.
  prefix_caching: bool = True


@dataclasses.dataclass
class SchedulerStats:
  num_steps: int = 0
  busy_s: float = 0.0  # Time spent executing steps.
  num_preemptions: int = 0
  first_prompt_tokens: int = 0  # Prompt tokens at first admissions.
  first_cached_tokens: int = 0  # ... of which prefix-cache hits.
  readmit_tokens: int = 0  # Tokens to recompute at re-admissions after preemption.
  readmit_cached_tokens: int = 0  # ... of which prefix-cache hits.


def _block_exact(seq: Sequence) -> bool:
  """A request scheduled as under shared_blocks whatever the config (an engine request whose
  depth settings make its pages depend on its blocks: GenRequest.block_exact)."""
  return getattr(seq.request, "block_exact", False)


class Scheduler:
  """Owns the queue, the running set and the page pool; advances simulated time step by step."""

  def __init__(
    self,
    config: SchedulerConfig,
    pool: pages_lib.PagePool,
    executor: Executor,
    *,
    fast_forward: bool = True,
    check_invariants: bool = False,
  ):
    if config.page_size < 1 or config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
      raise ValueError(f"page_size, token budget and max_num_seqs must be >= 1: {config}")
    block = config.prefill_block
    if block is not None and block < 1:
      raise ValueError(f"prefill_block = {block} must be >= 1.")
    if config.shared_blocks and (block is None or block > config.max_num_batched_tokens):
      raise ValueError(
        f"shared_blocks needs a prefill_block <= max_num_batched_tokens "
        f"({config.max_num_batched_tokens}): a block is never split across steps; got {block}."
      )
    self.config = config
    self.pool = pool
    self.executor = executor
    self._decode_step_time = getattr(executor, "decode_step_time", None) if fast_forward else None
    self._check = check_invariants
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.running: list[Sequence] = []
    self.finished: list[Sequence] = []
    self.rejected: list[Any] = []
    self.stats = SchedulerStats()
    # The queue head's last lookup, kept valid across steps (see _head_hits).
    self._head: Sequence | None = None
    self._head_hits: list[int] = []
    self._head_hit_set: set[int] = set()
    self._head_blocked = False  # The head failed to fit for lack of pages this step.
    # Free state slots (SchedulerConfig.state_slots), lowest first.
    self.free_slots = list(range(config.max_num_seqs)) if config.state_slots else []

  # -- Requests -------------------------------------------------------------------------------

  def max_pages(self, request: Any) -> int:
    """Pages a request holds at its longest."""
    return -(-(request.prompt_len + request.output_len - 1) // self.config.page_size)

  def add_request(self, request: Any) -> bool:
    """Queues a request; returns False (and records it) if it can never be served."""
    too_long = (
      self.config.max_model_len is not None
      and request.prompt_len + request.output_len > self.config.max_model_len
    )
    if too_long or self.max_pages(request) > (self.pool.num_pages or math.inf):
      self.rejected.append(request)
      return False
    self.waiting.append(Sequence(request, request.arrival_s, num_tokens=request.prompt_len))
    return True

  def abort(self, request_id: Any) -> Sequence | None:
    """Drops a queued or running request (a client went away): its pages are released, keeping
    the cached contents of full ones, as on a finish. Returns its Sequence, or None if it is
    not queued or running."""
    for i, seq in enumerate(self.waiting):
      if seq.request.request_id == request_id:
        del self.waiting[i]
        if seq is self._head:
          self._head = None
        return seq
    for i, seq in enumerate(self.running):
      if seq.request.request_id == request_id:
        del self.running[i]
        self.pool.release(seq.pages)
        self._free_slot(seq)
        seq.pages = []
        seq.prompt_keys = None
        return seq
    return None

  def requeue(self, request_id: Any) -> Sequence | None:
    """Puts a running request back at the head of the queue with nothing computed, as a
    preemption does (pages released, its K/V recomputed on re-admission), for a step whose
    results were never applied (it failed). Returns its Sequence, or None if not running."""
    for i, seq in enumerate(self.running):
      if seq.request.request_id == request_id:
        del self.running[i]
        self.pool.release(seq.pages)
        self._free_slot(seq)
        seq.pages = []
        seq.num_computed = 0
        seq.num_registered = 0
        self.waiting.appendleft(seq)
        return seq
    return None

  def has_work(self) -> bool:
    return bool(self.running or self.waiting)

  # -- One step ---------------------------------------------------------------------------------

  def step(self, now: float, next_arrival_s: float = math.inf) -> float:
    """Schedules and executes one step (or a run of identical decode steps); returns the time."""
    seqs, new_tokens, contexts, changed = self._schedule()
    if not seqs:
      raise RuntimeError("The scheduler made no progress although requests are pending.")
    if (
      self._decode_step_time is not None
      and not changed
      and len(seqs) == len(self.running)
      and all(
        s.num_output and s.num_tokens - c == 1 == q for s, c, q in zip(seqs, contexts, new_tokens)
      )
    ):
      end = self._decode_run(seqs, sum(contexts), now, next_arrival_s)
    else:
      end = self._execute(seqs, new_tokens, contexts, now)
    if self._check:
      self.check()
    return end

  def _schedule(self) -> tuple[list[Sequence], list[int], list[int], bool]:
    """Picks this step's sequences and chunk sizes; allocates their pages."""
    p = self.config.page_size
    pool = self.pool
    running = self.running
    budget = self.config.max_num_batched_tokens
    seqs, new_tokens, contexts = [], [], []
    preempted = False
    i = 0
    while i < len(running) and budget > 0:
      seq = running[i]
      q = self._chunk(seq, seq.num_computed, budget)
      if not q:  # Its next block does not fit in what is left of the budget.
        i += 1
        continue
      need = -(-(seq.num_computed + q) // p) - len(seq.pages)
      if need > 0:
        while need > pool.num_free and running[-1] is not seq:
          self._preempt(running.pop())
          preempted = True
        if need > pool.num_free:
          self._preempt(running.pop())
          preempted = True
          break
        seq.pages.extend(pool.allocate(need))
      seqs.append(seq)
      new_tokens.append(q)
      contexts.append(seq.num_computed)
      budget -= q
      i += 1

    admitted = False
    self._head_blocked = False
    evicted = pool.drain_evictions()
    if not self._head_hit_set.isdisjoint(evicted):
      self._head = None
    if not preempted:
      prefix_caching, state_slots = self.config.prefix_caching, self.config.state_slots
      waiting = self.waiting
      while waiting and budget > 0 and len(running) < self.config.max_num_seqs:
        seq = waiting[0]
        hits = self._usable_hits(seq, self._head_hits_of(seq)) if prefix_caching else []
        hit_tokens = len(hits) * p
        q = self._chunk(seq, hit_tokens, budget)
        if not q:
          break
        need = -(-(hit_tokens + q) // p) - len(hits)
        free = pool.num_free
        if need > free or need > free - pool.num_unreferenced(hits):
          self._head_blocked = True
          break
        waiting.popleft()
        self._head = None
        pool.acquire(hits)
        seq.pages = hits + pool.allocate(need)
        if state_slots:  # Running requests never outnumber max_num_seqs: one is free.
          seq.slot = heapq.heappop(self.free_slots)
        seq.num_computed = hit_tokens
        seq.num_registered = len(hits)
        self._count_admission(seq, hit_tokens)
        running.append(seq)
        seqs.append(seq)
        new_tokens.append(q)
        contexts.append(hit_tokens)
        budget -= q
        admitted = True
    return seqs, new_tokens, contexts, preempted or admitted

  def _chunk(self, seq: Sequence, start: int, budget: int) -> int:
    """Tokens to compute from position `start` within `budget` (0: wait for a later step)."""
    c = self.config
    q = seq.num_tokens - start
    k = getattr(seq.request, "lookahead", 0)
    if k and q == 1 and start >= seq.request.prompt_len:  # A speculative round, or plain.
      k = min(k, seq.request.output_len - seq.num_output)  # Nothing drafted past the end.
      if k > 1:
        return k if k <= budget else 0
    if c.prefill_block is None:
      return min(q, budget)
    prompt = seq.request.prompt_len
    if c.shared_blocks or _block_exact(seq):
      if start >= prompt:  # A decoded position: its own block, as when it was decoded.
        return 1 if budget >= 1 else 0
      q = min((start // c.prefill_block + 1) * c.prefill_block, prompt) - start
      return q if q <= budget else 0
    return min(q, (start // c.prefill_block + 1) * c.prefill_block - start, budget)

  def _usable_hits(self, seq: Sequence, hits: list[int]) -> list[int]:
    """The cached pages a request may use: all of them, or under shared_blocks those up to the
    last block boundary inside the prompt that is also a page boundary (a block is computed in
    one call, never resumed)."""
    c = self.config
    tokens = len(hits) * c.page_size
    if not (c.shared_blocks or _block_exact(seq)) or tokens >= seq.request.prompt_len:
      return hits
    boundary = math.lcm(c.prefill_block, c.page_size)  # A block and a page boundary.
    return hits[: tokens // boundary * boundary // c.page_size]

  def _count_admission(self, seq: Sequence, hit_tokens: int) -> None:
    stats = self.stats
    if seq.admitted:
      stats.readmit_tokens += seq.num_tokens
      stats.readmit_cached_tokens += hit_tokens
    else:
      seq.admitted = True
      seq.cached_tokens = hit_tokens
      stats.first_prompt_tokens += seq.num_tokens
      stats.first_cached_tokens += hit_tokens

  def _execute(
    self, seqs: list[Sequence], new_tokens: list[int], contexts: list[int], now: float
  ) -> float:
    sampled = sum(c + q >= s.num_tokens for s, q, c in zip(seqs, new_tokens, contexts))
    spec = tuple(c + q > s.num_tokens for s, q, c in zip(seqs, new_tokens, contexts))
    duration = self.executor.execute(StepBatch(seqs, new_tokens, contexts, sampled, spec))
    end = now + duration
    self.stats.num_steps += 1
    self.stats.busy_s += duration
    any_finished = False
    p = self.config.page_size
    for seq, q, speculative in zip(seqs, new_tokens, spec):
      emitted = 1
      if speculative:  # Keeps the positions of the tokens it emitted (StepBatch.speculative).
        emitted = q = seq.emitted
        self._trim(seq, seq.num_computed + q)
      seq.num_computed += q
      if seq.num_computed // p > seq.num_registered:
        self._register(seq)
      if seq.num_computed == seq.num_tokens + emitted - 1:
        seq.num_output += emitted
        seq.num_tokens += emitted
        if seq.first_token_s is None:
          seq.first_token_s = end
        if seq.num_output == seq.request.output_len or seq.stopped:
          self._finish(seq, end)
          any_finished = True
    return self._drop_finished(any_finished, end)

  def _decode_run(self, seqs: list[Sequence], context: int, now: float, next_arrival: float):
    """Applies k identical-shape decode steps at once (see module docstring)."""
    p = self.config.page_size
    pool = self.pool
    n = len(seqs)
    k_max = min(s.request.output_len - s.num_output for s in seqs)  # Up to the first finish.

    def extra_pages(k: int) -> int:  # Pages beyond those held, for k steps (step 0's are held).
      return sum(max(0, -(-(s.num_computed + k) // p) - len(s.pages)) for s in seqs)

    step_time = self._decode_step_time
    ends = []
    end = now
    while len(ends) < k_max:  # Up to the first step boundary at or after the next arrival.
      end += step_time(n, context + n * len(ends))
      ends.append(end)
      if end >= next_arrival:
        break
    k = len(ends)
    need = extra_pages(k)
    if need:
      room = pool.num_free
      if self._head_blocked:
        # Evicting one of the blocked head's hits can let it fit (its freed hits count as free
        # pages again), so the run stops there, exactly where single steps would admit it.
        room = pool.allocatable_sparing(self._head_hit_set, need)
      if need > room:  # Stop before the step whose pages would not fit.
        lo, hi = 1, k  # extra_pages(lo) <= room < extra_pages(hi).
        while hi - lo > 1:
          mid = (lo + hi) // 2
          lo, hi = (mid, hi) if extra_pages(mid) <= room else (lo, mid)
        k = lo
    end = ends[k - 1]
    self.stats.num_steps += k
    self.stats.busy_s += end - now

    any_finished = False
    for seq in seqs:
      need = -(-(seq.num_computed + k) // p) - len(seq.pages)
      if need > 0:
        seq.pages.extend(pool.allocate(need))
      seq.num_computed += k
      seq.num_tokens += k
      seq.num_output += k
      if seq.num_computed // p > seq.num_registered:
        self._register(seq)
      if seq.num_output == seq.request.output_len:
        self._finish(seq, end)
        any_finished = True
    return self._drop_finished(any_finished, end)

  def _drop_finished(self, any_finished: bool, end: float) -> float:
    """Removes finished sequences from the running list; returns the step's end time."""
    if any_finished:
      self.running = [s for s in self.running if s.finish_s is None]
    return end

  # -- Bookkeeping -----------------------------------------------------------------------------

  def _head_hits_of(self, seq: Sequence) -> list[int]:
    """_lookup for the queue head, reusing the previous step's answer while it is still valid.

    A blocked head is looked up every step; its hits only change when one of its pages is evicted
    (then _schedule forgets them) or when the key after the run gets cached (checked here).
    """
    if seq is not self._head:
      self._head = seq
      self._head_hits = self._lookup(seq)
      self._head_hit_set = set(self._head_hits)
    else:
      more = self._lookup(seq, start=len(self._head_hits))
      if more:
        self._head_hits = self._head_hits + more
        self._head_hit_set.update(more)
    return self._head_hits

  def _lookup(self, seq: Sequence, start: int = 0) -> list[int]:
    """Cached pages of the longest leading run among the full pages before the last token.

    With start > 0, continues a run already known to cover pages [0, start).
    """
    p = self.config.page_size
    if seq.prompt_keys is None:
      seq.prompt_keys = seq.request.prompt_page_keys(p)
    keys = seq.prompt_keys
    max_pages = (seq.num_tokens - 1) // p
    if max_pages <= len(keys):
      return self.pool.lookup(itertools.islice(keys, start, max_pages))
    rid = seq.request.request_id
    private_start = max(start, len(keys))
    private = (page_keys.private_page_key(rid, k) for k in range(private_start, max_pages))
    return self.pool.lookup(itertools.chain(itertools.islice(keys, start, None), private))

  def _register(self, seq: Sequence) -> None:
    """Offers the sequence's newly full pages (callers check there are some) to the cache."""
    start = seq.num_registered
    full = seq.num_computed // self.config.page_size
    if not self.config.prefix_caching:  # Nothing is offered, so a page is free once released.
      seq.num_registered = full
      return
    keys = seq.prompt_keys
    n_prompt = len(keys)
    if full <= n_prompt:
      new_keys = keys[start:full]
    else:
      rid = seq.request.request_id
      new_keys = keys[start:n_prompt] + [
        page_keys.private_page_key(rid, k) for k in range(max(start, n_prompt), full)
      ]
    self.pool.register(seq.pages[start:full], new_keys)
    seq.num_registered = full

  def _trim(self, seq: Sequence, tokens: int) -> None:
    """Gives back the pages past the first `tokens` positions (a speculative round's rejected
    positions: fresh pages, held by no one else and never offered to the prefix cache)."""
    keep = -(-tokens // self.config.page_size)
    if len(seq.pages) > keep:
      self.pool.release(seq.pages[keep:])
      del seq.pages[keep:]

  def _free_slot(self, seq: Sequence) -> None:
    """Gives the sequence's state slot back (its state is not kept: a re-admitted request is
    recomputed from its first token, from a zero state)."""
    if seq.slot is not None:
      heapq.heappush(self.free_slots, seq.slot)
      seq.slot = None

  def _preempt(self, seq: Sequence) -> None:
    self.pool.release(seq.pages)
    self._free_slot(seq)
    seq.pages = []
    seq.num_computed = 0
    seq.num_registered = 0
    seq.num_preemptions += 1
    self.stats.num_preemptions += 1
    self.waiting.appendleft(seq)

  def _finish(self, seq: Sequence, now: float) -> None:
    self.pool.release(seq.pages)
    self._free_slot(seq)
    seq.pages = []
    seq.prompt_keys = None
    seq.finish_s = now
    self.finished.append(seq)

  def check(self) -> None:
    """Verifies the pool and that each page's references are exactly the block tables holding it."""
    self.pool.check()
    held = collections.Counter()
    for seq in self.running:
      assert len(set(seq.pages)) == len(seq.pages), "a request holds a page twice"
      pages_needed = -(-seq.num_computed // self.config.page_size)
      assert len(seq.pages) == pages_needed, "a request holds the wrong number of pages"
      held.update(seq.pages)
    for seq in self.waiting:
      assert not seq.pages, "a queued request holds pages"
      assert seq.slot is None, "a queued request holds a state slot"
    if self.config.state_slots:
      slots = [seq.slot for seq in self.running]
      assert None not in slots, "a running request holds no state slot"
      held_slots = sorted(slots + self.free_slots)
      assert held_slots == list(range(self.config.max_num_seqs)), "state slots lost or shared"
    assert self.pool.num_in_use == len(held), "a page is referenced by no request"
    for page, count in held.items():
      assert self.pool.ref_count(page) == count, f"page {page} has wrong reference count"
