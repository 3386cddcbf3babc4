"""The scheduler's executor backed by the real model: jitted model calls per scheduled batch.

A step takes the scheduler's ragged batch (each sequence computes q_i new tokens after c_i
cached ones; prefill chunks and decode tokens mixed) and runs it as at most two padded calls
(looped/engine/padding.py, which the simulator's engine pricing shares): the rows with one new
token together, and the rows with a longer chunk together, so a decode does not pay for another
row's chunk. A call gathers each row's pages (and KDA states, from its state slot) into a dense
cache, runs the model's decode path on
the whole chunk at once, writes the new entries back into the pages and samples the next token
of every sequence whose chunk reaches its last token.

A chunk is one model call in every layout and format, which is what the model's decode path
defines (docs/design.md §3): unshared, it equals the parallel forward; under KV-sharing it is a
block of block prefill (the scheduler cuts chunks at block boundaries, so a page's contents
depend only on its prefix); with a KV format the chunk's own earlier tokens are read through
the format, as they would be from the cache.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from looped.engine import paged_cache, sampling, speculative, step_table
from looped.engine.mesh import EngineMesh
from looped.engine.padding import (  # noqa: F401 (bucket, powers_of_two re-exported)
  CallShape,
  Padding,
  StepShape,
  bucket,
  powers_of_two,
)
from looped.engine.requests import DepthParams, GenRequest
from looped.model import adaptive
from looped.model.cache_layout import KVLayout
from looped.model.looped_lm import LoopedLM
from looped.scheduler import scheduler as scheduler_lib


class RequestFailed(RuntimeError):
  """A step failed on one request's own data (building its row, or applying its token); the
  step's results were not applied, so the engine can drop that request and go on."""

  def __init__(self, request_id: int, cause: BaseException):
    super().__init__(f"request {request_id}: {type(cause).__name__}: {cause}")
    self.request_id = request_id


STEP_LOG_KEPT = 16_384  # ModelExecutor.step_log keeps at least this many of the last steps.


@dataclasses.dataclass
class RequestState:
  request: GenRequest
  tokens: list[int]  # Prompt plus generated so far: what a (re)computation feeds.
  generated: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  text: str = ""
  finish_reason: str | None = None
  logits: dict = dataclasses.field(default_factory=dict)  # Position -> logits (record_logits).
  # Position p -> (log p(token p + 1), top ids, their logprobs), for requests that ask
  # (GenRequest.position_logprobs): scoring a prompt (echo) and top-k alternatives.
  positions: dict = dataclasses.field(default_factory=dict)
  # Recurrences of the call that produced each generated token (Generation.recurrences).
  token_depths: list[int] = dataclasses.field(default_factory=list)
  # The final state of the last position computed and that position (continuous compute).
  last_state: np.ndarray | None = None
  state_position: int = -1
  # Tokens each speculative round emitted (looped.engine.speculative), the tokens they ...
  rounds: list[int] = dataclasses.field(default_factory=list)
  drafted: int = 0  # ... drafted ...
  accepted: int = 0  # ... and of those, kept by verification.


def needs_depths(layout: KVLayout, exit_lookup: str) -> bool:
  """Whether steps read each cached token's recurrences (an unshared cache's 'skip' and
  'always-last' lookups, looped.model.adaptive): the executor then keeps them per page slot."""
  return not layout.share_kv and exit_lookup != adaptive.DEFAULT_LOOKUP


def _call_fn(
  model: LoopedLM,
  mesh: EngineMesh,
  layout: KVLayout,
  return_logits: bool,
  top_logprobs: int,
  attention_impl: str,
  exit_lookup: str | None,
  params,
  pages,
  tokens_BxT,
  page_table_BxP,
  context_B,
  num_new_B,
  temperature_B,
  top_k_B,
  top_p_B,
  seed_B,
  index_B,
  targets_BxT,
  slot_B,
  *depth_args,
):
  """One padded call. exit_lookup None: every row runs the model's R recurrences (the scan);
  else depth_args are the rows' depth settings (_CallInputs.depth: recurrences, criterion,
  threshold, min_recurrences, check_every, init_scale, warm, state_BxD, past_depth_BxS), and the
  call also returns each row's recurrences and final state."""
  b, t = tokens_BxT.shape
  slotted = layout.slotted_core(model.cfg)
  kernel = None
  if attention_impl == "pallas":  # These layers read the pages through paged_decode.
    kernel = paged_cache.kernel_layers(model.cfg, layout, t)
    if exit_lookup is not None and needs_depths(layout, exit_lookup):  # Masks the kernel lacks.
      kernel = {**kernel, "core": (False,) * len(kernel["core"])}
  dtypes = None  # 'xla': the pool is stored as its bits (paged_cache), read as these.
  if attention_impl == "xla":
    dtypes = paged_cache.page_dtypes(model.cfg, layout)
  cache = paged_cache.gather(
    pages, page_table_BxP, context_B, layout, slot_B, slotted, kernel, dtypes
  )
  depth = {}
  if exit_lookup is not None:
    *rows, past_depth_BxS = depth_args
    if past_depth_BxS.shape[1]:
      cache = cache.replace(depth_BxS=past_depth_BxS)
    depth = {"depth": adaptive.DepthInputs(*rows), "exit_lookup": exit_lookup}
  logits_BxTxV, aux = model.apply(params, tokens_BxT, cache=cache, num_new_B=num_new_B, **depth)
  last_BxV = logits_BxTxV[jnp.arange(b), jnp.maximum(num_new_B - 1, 0)]
  token_B, logprob_B = sampling.sample(last_BxV, temperature_B, top_k_B, top_p_B, seed_B, index_B)
  # Every read of the pool before any write. A layer's new entries do not depend on its past, so
  # nothing else orders the writes after the reads XLA fuses into attention, and XLA:CPU then
  # copies the prelude's and coda's pools every step to keep both (tests/paged_cache_bits_test).
  # Sampled tokens are never negative: this only makes the writes wait for the logits.
  written_B = jnp.where(token_B >= 0, num_new_B, 0)
  pages = paged_cache.scatter(
    pages,
    aux["cache"],
    aux["cache_chunk"],
    page_table_BxP,
    context_B,
    written_B,
    t,
    layout,
    slot_B,
    slotted,
    dtypes,
  )
  # The pool stays where it was placed (split over KV heads), so the next step reuses it.
  pages = jax.lax.with_sharding_constraint(pages, mesh.pool_shardings(pages, layout, slotted))
  positions = None
  if top_logprobs:  # Every position's distribution over the next token (the raw logits').
    logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    target_BxT = jnp.take_along_axis(logprobs_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    # Each [B, T, top_logprobs]: the best next tokens' logprobs and their ids.
    top, top_ids = jax.lax.top_k(logprobs_BxTxV, top_logprobs)
    positions = (target_BxT, top_ids, top)
  logits = logits_BxTxV if return_logits else None
  return pages, token_B, logprob_B, logits, positions, aux.get("depth_B"), aux.get("state_BxD")


def compiled_call(
  cfg,
  layout: KVLayout,
  logits: bool,
  top_logprobs: int = 0,
  mesh: EngineMesh | None = None,
  attention_impl: str = "xla",
  exit_lookup: str | None = None,
) -> Callable:
  """The jitted model call for a model, layout (sharing and its KV policy), mesh (None: one
  device) and attention ('xla': pages gathered into a dense cache; 'pallas': GQA layers read
  them with pallas_kernels.paged_decode, paged_cache.kernel_layers); shared by engines so each
  shape compiles once. exit_lookup: per-row depth settings (_call_fn; None: all R recurrences).
  Call it inside mesh.context()."""
  mesh = mesh or EngineMesh.create(cfg)
  return _compiled_call(cfg, layout, logits, top_logprobs, mesh, attention_impl, exit_lookup)


@functools.lru_cache(maxsize=32)
def _compiled_call(
  cfg, layout, logits, top_logprobs, mesh, attention_impl, exit_lookup=None
) -> Callable:
  call = functools.partial(
    _call_fn, LoopedLM(cfg), mesh, layout, logits, top_logprobs, attention_impl, exit_lookup
  )
  return jax.jit(call, donate_argnums=(1,))


@dataclasses.dataclass
class _CallInputs:
  """One padded call's host arrays (see _call_fn)."""

  tokens: np.ndarray
  table: np.ndarray
  context: np.ndarray
  num_new: np.ndarray
  temperature: np.ndarray
  top_k: np.ndarray
  top_p: np.ndarray
  seed: np.ndarray
  index: np.ndarray
  targets: np.ndarray
  slot: np.ndarray  # Each row's state slot (KDA layers); padding rows the scratch slot.
  # Per-row depth settings (DepthInputs' fields, then past_depth [rows, slots]), or None when
  # the engine runs every row at full depth.
  depth: dict | None = None
  draft: np.ndarray | None = None  # A speculative call's draft recurrences per row.

  @classmethod
  def empty(
    cls,
    rows: int,
    tokens: int,
    columns: int,
    scratch_page: int,
    scratch_slot: int = 0,
    depth: tuple[int, int, int] | None = None,
    draft: bool = False,
  ) -> _CallInputs:
    """depth: (the rows' default recurrences, d_model, depth slots per page-table column, 0
    unless needs_depths) of an engine with per-row depth settings; None: without. draft: the
    inputs of a speculative call (looped.engine.speculative.call_fn)."""
    zeros_B = np.zeros((rows,), np.int32)
    rows_depth = None
    if depth is not None:
      recurrences, d_model, per_column = depth
      rows_depth = {
        "recurrences": np.full((rows,), recurrences, np.int32),
        "criterion": zeros_B.copy(),
        "threshold": np.zeros((rows,), np.float32),
        "min_recurrences": zeros_B.copy(),
        "check_every": np.ones((rows,), np.int32),
        "init_scale": np.ones((rows,), np.float32),
        "warm": np.zeros((rows,), bool),
        "state": np.zeros((rows, d_model), np.float32),
        "past_depth": np.zeros((rows, columns * per_column), np.int32),
      }
    return cls(
      np.zeros((rows, tokens), np.int32),
      np.full((rows, columns), scratch_page, np.int32),
      zeros_B.copy(),
      zeros_B.copy(),
      np.zeros((rows,), np.float32),
      zeros_B.copy(),
      np.ones((rows,), np.float32),
      zeros_B.copy(),
      zeros_B.copy(),
      np.zeros((rows, tokens), np.int32),
      np.full((rows,), scratch_slot, np.int32),
      rows_depth,
      np.ones((rows,), np.int32) if draft else None,
    )

  def args(self) -> tuple:
    depth = () if self.depth is None else tuple(self.depth.values())
    if self.draft is not None:
      depth += (self.draft,)
    return (
      self.tokens,
      self.table,
      self.context,
      self.num_new,
      self.temperature,
      self.top_k,
      self.top_p,
      self.seed,
      self.index,
      self.targets,
      self.slot,
      *depth,
    )


def _abstract_args(
  params, pages, scratch_page: int, scratch_slot: int, mesh: EngineMesh, depth=None, draft=False
):
  """shape -> a call's arguments as lowering sees them: params and pages as they are placed (as
  ShapeDtypeStructs: nothing of an engine is kept alive by its table) and host arrays of a call
  on no tokens (replicated on a mesh of several devices); depth as _CallInputs.empty's."""
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
  params, pages = jax.tree.map(spec, params), jax.tree.map(spec, pages)
  replicated = mesh.replicated() if mesh.mesh.size > 1 else None

  def abstract(shape) -> tuple:
    rows, tokens, columns = shape
    args = _CallInputs.empty(rows, tokens, columns, scratch_page, scratch_slot, depth, draft).args()
    if replicated is not None:
      args = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated) for a in args)
    return (params, pages, *args)

  return abstract


class ModelExecutor:
  """Runs scheduler batches on the model (see the module docstring); returns step durations."""

  def __init__(
    self,
    model: LoopedLM,
    params,
    *,
    num_pages: int,
    layout: KVLayout,
    # Per-sequence state slots of KDA layers (the scheduler's max_num_seqs; Sequence.slot).
    num_slots: int = 0,
    padding: Padding,
    clock: scheduler_lib.Executor | None = None,
    record_logits: bool = False,
    decode: Callable | None = None,
    on_token: Callable | None = None,
    top_logprobs: int = 0,
    mesh: EngineMesh | None = None,
    attention_impl: str = "xla",
    exit_lookup: str | None = None,
    trained_recurrences: int | None = None,
    speculative_passes: int = 0,
    max_lookahead: int = 0,
  ):
    """padding: the padded call shapes (rows, tokens, page-table columns). top_logprobs: k > 0
    makes every call also compute, per position, the logprob of the next token and the k most
    likely ones, kept for requests with position_logprobs. mesh: where params and pages are
    placed and the calls run (looped.engine.mesh; None: one device). layout: sharing, format,
    KV policy and page size of the pages (looped/model/cache_layout.py KVLayout).
    attention_impl: 'xla' or 'pallas', how the calls read the pages (compiled_call).
    exit_lookup: the steps take each request's depth settings (GenRequest.depth, resolved by
    the engine), with this unshared lookup (looped.model.adaptive.LOOKUPS); None: every token
    runs the model's R recurrences. trained_recurrences: what a request's recurrences 0 means
    (default: the model's R; an engine looping further than trained runs a model whose R is
    its maximum). speculative_passes: n > 0 runs the scheduler's speculative rounds
    (StepBatch.speculative; needs exit_lookup) with n verify passes (looped.engine.speculative);
    max_lookahead: the most tokens a round drafts (its calls pad k to a power of two)."""
    self.model = model
    self.mesh = mesh or EngineMesh.create(model.cfg)
    self.params = self.mesh.place_params(model, params)
    self.layout = layout
    self.page_size = layout.page_size
    self.scratch_page = num_pages
    self.scratch_slot = num_slots
    self.attention_impl = attention_impl
    self.exit_lookup = exit_lookup
    self.trained_recurrences = trained_recurrences or model.cfg.num_recurrences
    # The recurrences of each page slot's token, kept on the host for the lookups that read
    # them (needs_depths): a page and its depths move together, prefix hits included.
    self.page_depths = None
    if exit_lookup is not None and needs_depths(layout, exit_lookup):
      self.page_depths = np.zeros((num_pages + 1, layout.page_size), np.int32)
    self.reset_pages()
    self.padding = padding
    self.clock = clock
    self.record_logits = record_logits
    self.decode = decode or (lambda ids: "")
    self.on_token = on_token
    self.states: dict[int, RequestState] = {}
    self.last_batch: list[int] = []  # Request ids of the step last started (failed or not).
    # Per step: rows, tokens needed, tokens computed (padding included), call shapes, seconds;
    # the last STEP_LOG_KEPT to 2x that many steps, so a long-running server's memory is bounded.
    self.step_log: list[dict] = []
    self.top_logprobs = top_logprobs
    # Strict: a step runs the smallest compiled shape that holds it and never compiles
    # (step_table.StepTable.lookup); else a shape not compiled yet is compiled on its step.
    self.strict = False
    self.steps = self._step_table(model.cfg, record_logits)
    self.speculative_passes = speculative_passes
    self.lookahead_buckets = powers_of_two(max_lookahead) if speculative_passes else ()
    self.spec_steps = None
    if speculative_passes:
      if exit_lookup is None:
        raise ValueError("speculative rounds draft at their own depth: they need exit_lookup.")
      self.spec_steps = self._step_table(model.cfg, record_logits, speculative_passes)

  def _step_table(self, cfg, record_logits: bool, passes: int = 0) -> step_table.StepTable:
    """The process's compiled steps for this model, layout, pool and mesh (shared by engines
    with the same ones: a shape compiles once while it lives); passes > 0: the speculative
    calls' (looped.engine.speculative.call_fn) with that many verify passes."""
    signature = lambda tree: (
      str(jax.tree.structure(tree)),
      tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(tree)),
    )
    key = (
      cfg,
      self.layout,
      record_logits,
      self.top_logprobs,
      self.mesh,
      self.attention_impl,
      self.exit_lookup,
      signature(self.params),
      signature(self.pages),
      passes,
    )
    fn = functools.partial(
      _call_fn,
      LoopedLM(cfg),
      self.mesh,
      self.layout,
      record_logits,
      self.top_logprobs,
      self.attention_impl,
      self.exit_lookup,
    )
    if passes:
      fn = functools.partial(
        speculative.call_fn,
        LoopedLM(cfg),
        self.layout,
        record_logits,
        self.attention_impl,
        self.exit_lookup,
        passes,
      )
    abstract = _abstract_args(
      self.params,
      self.pages,
      self.scratch_page,
      self.scratch_slot,
      self.mesh,
      self._depth(),
      draft=bool(passes),
    )
    return step_table.shared(key, lambda: step_table.StepTable(fn, abstract, self.mesh))

  def _depth(self) -> tuple[int, int, int] | None:
    """_CallInputs.empty's depth argument for this executor's calls."""
    if self.exit_lookup is None:
      return None
    per_column = self.page_size if self.page_depths is not None else 0
    return self.trained_recurrences, self.model.cfg.d_model, per_column

  def _call(self, params, pages, *args):
    """One padded call, its shape read off the tokens and page table: the table's executable."""
    return self._execute_in(self.steps, params, pages, *args)

  def _call_speculative(self, params, pages, *args):
    """One padded speculative call (looped.engine.speculative.call_fn), in a shape _calls
    fitted: a compiled one that holds it, else its own, compiled on first use."""
    return self._execute_in(self.spec_steps, params, pages, *args)

  def _execute_in(self, table: step_table.StepTable, params, pages, *args):
    (rows, tokens), columns = args[0].shape, args[1].shape[1]
    strict = self.strict and table is self.steps  # _calls fitted a speculative call's shape.
    _, executable = table.lookup((rows, tokens, columns), strict=strict)
    return executable(params, pages, *args)

  def add(self, request: GenRequest) -> None:
    self.states[request.request_id] = RequestState(request, list(request.prompt_tokens))

  def warmup(self, shapes, on_shape: Callable | None = None) -> None:
    """Compiles (or loads from the persistent compilation cache) the call of each padded
    (rows, tokens, columns) shape ahead of time; nothing runs, so it may go on in a thread
    beside the steps."""
    self._compile(self.steps, shapes, on_shape)

  def warmup_speculative(self, shapes, on_shape: Callable | None = None) -> None:
    """warmup for the speculative calls' shapes (tokens: the lookahead bucket)."""
    self._compile(self.spec_steps, shapes, on_shape)

  def _compile(self, table: step_table.StepTable, shapes, on_shape) -> None:
    for i, shape in enumerate(shapes):
      table.compile(tuple(shape))
      if on_shape is not None:
        on_shape(i + 1, len(shapes))

  def pages_valid(self) -> bool:
    """False once a step failed after donating the pages to the device (they are gone)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.pages))

  def reset_pages(self) -> None:
    """Fresh, zeroed pages (every cached K/V lost: the caller drops whatever refers to them)."""
    cfg = self.model.cfg
    init = functools.partial(
      paged_cache.init_pages,
      cfg,
      self.scratch_page,
      self.layout,
      self.scratch_slot,
      as_bits=self.attention_impl == "xla",
    )
    # Made in place, each device its shards only: the whole pool need not fit on one device.
    slotted = self.layout.slotted_core(cfg)
    shardings = self.mesh.pool_shardings(jax.eval_shape(init), self.layout, slotted)
    with self.mesh.context():  # Not a caller's mesh (e.g. training's, around the evaluation).
      self.pages = jax.jit(init, out_shardings=shardings)()

  def _run(self, inputs: _CallInputs):
    """One model call on the mesh: the step's inputs replicated, params and pages in place (a
    speculative call's program when the inputs have draft recurrences)."""
    args = inputs.args()
    if self.mesh.mesh.size > 1:  # One device: jit's own dispatch moves host arrays faster.
      args = jax.device_put(args, self.mesh.replicated())
    call = self._call if inputs.draft is None else self._call_speculative
    with self.mesh.context():
      return call(self.params, self.pages, *args)

  def _fit(self, padded: StepShape) -> StepShape:
    """Strict: each call in the smallest compiled shape that holds it (StepTable.lookup)."""
    if not self.strict:
      return padded
    calls = []
    for c in padded.calls:
      rows, tokens, columns = self.steps.lookup((c.rows, c.tokens, c.columns), strict=True)[0]
      calls.append(CallShape(rows, tokens, columns))
    return StepShape(tuple(calls), padded.groups)

  def _inputs(self, batch, shape, group, speculative: bool = False) -> _CallInputs:
    """The host arrays of one call; a row that cannot be built raises RequestFailed. A
    speculative call's rows feed their last token and draft `new` more."""
    inputs = _CallInputs.empty(
      shape.rows,
      shape.tokens,
      shape.columns,
      self.scratch_page,
      self.scratch_slot,
      self._depth(),
      speculative,
    )
    for row, i in enumerate(group):
      seq, new, ctx = batch.seqs[i], batch.num_new_tokens[i], batch.num_context_tokens[i]
      try:
        state = self.states[seq.request.request_id]
        if speculative:
          inputs.tokens[row, 0] = state.tokens[ctx]
          inputs.draft[row] = state.request.speculative.recurrences
        else:
          inputs.tokens[row, :new] = state.tokens[ctx : ctx + new]
        inputs.table[row, : len(seq.pages)] = seq.pages
        inputs.context[row], inputs.num_new[row] = ctx, new
        sp = state.request.sampling
        inputs.temperature[row], inputs.top_k[row] = sp.temperature, sp.top_k
        inputs.top_p[row], inputs.seed[row] = sp.top_p, sp.seed
        inputs.index[row] = len(state.generated)
        if self.scratch_slot:  # KDA layers: the row's state lives in its slot.
          if seq.slot is None:
            raise ValueError("holds no state slot (SchedulerConfig.state_slots is off).")
          inputs.slot[row] = seq.slot
        if self.top_logprobs and state.request.position_logprobs:
          known = state.tokens[ctx + 1 : ctx + new + 1]  # The last one is sampled if unknown.
          inputs.targets[row, : len(known)] = known
        if inputs.depth is not None:
          self._depth_row(inputs.depth, row, state, ctx, new, inputs.table[row])
      except Exception as e:
        raise RequestFailed(seq.request.request_id, e) from e
    return inputs

  def _depth_row(self, depth: dict, row: int, state: RequestState, ctx: int, new: int, table):
    """Row `row`'s depth settings (_CallInputs.depth) for the chunk of `new` tokens after
    `ctx`: its request's, with no exit in a prompt chunk unless exit_in_prefill, and the
    previous position's final state where it computes a generated token warm."""
    request = state.request
    d = request.depth or DepthParams()
    prompt_chunk = ctx < request.prompt_len
    criterion = d.exit_criterion if d.exit_in_prefill or not prompt_chunk else "none"
    depth["recurrences"][row] = d.recurrences or self.trained_recurrences
    depth["criterion"][row] = adaptive.criterion_index(criterion)
    depth["threshold"][row] = adaptive.threshold_of(criterion, d.exit_threshold)
    depth["min_recurrences"][row] = d.min_recurrences
    depth["check_every"][row] = d.exit_every
    depth["init_scale"][row] = d.init_scale
    warm = d.continuous_compute and not prompt_chunk and state.state_position == ctx - 1
    depth["warm"][row] = warm
    if warm:
      depth["state"][row] = state.last_state
    if self.page_depths is not None:
      depth["past_depth"][row] = self.page_depths[table].reshape(-1)

  def _record_depths(self, seq, state: RequestState, ctx, new, depth: int, final) -> None:
    """After a call: the row's final state (continuous compute) and, where steps read them,
    the recurrences of its new tokens' page slots."""
    state.last_state, state.state_position = np.asarray(final), ctx + new - 1
    if self.page_depths is not None:
      positions = np.arange(ctx, ctx + new)
      pages = np.asarray(seq.pages)[positions // self.page_size]
      self.page_depths[pages, positions % self.page_size] = depth

  def _calls(self, batch: scheduler_lib.StepBatch) -> list[tuple[CallShape, tuple, bool]]:
    """The step's padded calls: (shape, batch rows, speculative) each; the plain rows in at
    most two (padding.py), the speculative rounds in one."""
    n = len(batch.seqs)
    spec = batch.speculative or (False,) * n
    plain = [i for i in range(n) if not spec[i]]
    calls = []
    if plain:
      new = [batch.num_new_tokens[i] for i in plain]
      padded = self._fit(self.padding.shape(new, [batch.num_context_tokens[i] for i in plain]))
      for shape, group in zip(padded.calls, padded.groups):
        calls.append((shape, tuple(plain[j] for j in group), False))
    rounds = tuple(i for i in range(n) if spec[i])
    if rounds:
      k = bucket(max(batch.num_new_tokens[i] for i in rounds), self.lookahead_buckets)
      reach = max(batch.num_context_tokens[i] for i in rounds) + k
      columns = bucket(-(-reach // self.page_size), self.padding.column_buckets)
      shape = (bucket(len(rounds), self.padding.row_buckets), k, columns)
      if self.strict and self.spec_steps.shapes():  # The smallest compiled shape holding it,
        try:  # else (a lookahead no warm-up compiled) compiled on first use.
          shape = self.spec_steps.lookup(shape, strict=True)[0]
        except RuntimeError:
          pass
      calls.append((CallShape(*shape), rounds, True))
    return calls

  def execute(self, batch: scheduler_lib.StepBatch) -> float:
    """Runs one step. Nothing of it is applied (request states, emitted tokens) unless all of it
    succeeds: a row that fails raises RequestFailed naming its request, anything else fails the
    step as a whole; either way the scheduler's state is that of before the step."""
    n = len(batch.seqs)
    self.last_batch = [seq.request.request_id for seq in batch.seqs]
    calls = self._calls(batch)
    inputs = [self._inputs(batch, c, g, spec) for c, g, spec in calls]
    # Per batch row: (call, row within it), and each call's outputs.
    where = {i: (k, row) for k, (_, g, _) in enumerate(calls) for row, i in enumerate(g)}
    start = time.perf_counter()
    outputs = []
    for call_inputs in inputs:
      self.pages, *out = self._run(call_inputs)
      outputs.append(tuple(None if x is None else jax.tree.map(np.asarray, x) for x in out))
    wall = time.perf_counter() - start
    self.step_log.append(
      {
        "rows": n,
        "tokens": int(sum(batch.num_new_tokens)),
        "computed": sum(c.computed for c, _, _ in calls),
        "calls": [(c.rows, c.tokens, c.columns) for c, _, _ in calls],
        "speculative": any(spec for _, _, spec in calls),
        "s": wall,
      }
    )
    if len(self.step_log) > 2 * STEP_LOG_KEPT:
      del self.step_log[:-STEP_LOG_KEPT]
    # Every row's results first, applied only once all of them are known (see execute).
    updates = []
    for i, seq in enumerate(batch.seqs):
      try:
        k, row = where[i]
        state = self.states[seq.request.request_id]
        new, ctx = batch.num_new_tokens[i], batch.num_context_tokens[i]
        if calls[k][2]:
          update = self._round_update(state, row, ctx, new, outputs[k], inputs[k])
        else:
          update = self._plain_update(seq, state, row, ctx, new, outputs[k])
        updates.append((seq, state, update))
      except Exception as e:
        raise RequestFailed(seq.request.request_id, e) from e
    for seq, state, update in updates:
      self._apply(seq, state, update)
    return wall if self.clock is None else self.clock.execute(batch)

  def _plain_update(self, seq, state, row, ctx, new, outputs) -> dict:
    """A plain call row's results (_apply applies them)."""
    token_B, logprob_B, logits, positions, depth_B, state_BxD = outputs
    update = self._row_update(seq, state, row, ctx, new, logits, positions, logprob_B)
    update["depth"] = self.trained_recurrences if depth_B is None else int(depth_B[row])
    if state_BxD is not None:
      update["final"] = (ctx, new, state_BxD[row])
    update["emits"] = []
    if update["sampled"]:
      token, logprob = int(token_B[row]), float(logprob_B[row])
      update["emits"] = [(token, logprob, self._stop(state, [token]))]
    return update

  def _round_update(self, state, row, ctx, k, outputs, inputs: _CallInputs) -> dict:
    """A speculative round's results: its emitted tokens up to the first that ends the
    request, the verifier's logits at their positions, the drafts kept."""
    emitted_BxK, m_B, a_B, logprob_BxK, logits = outputs
    emits, tokens = [], []
    for j in range(int(m_B[row])):
      tokens.append(int(emitted_BxK[row, j]))
      stop = self._stop(state, tokens)
      emits.append((tokens[-1], float(logprob_BxK[row, j]), stop))
      if stop[0] is not None:
        break
    update = {"emits": emits, "positions": {}, "logits": {}, "round": (k, int(a_B[row]))}
    if logits is not None:
      update["logits"] = {ctx + j: logits[row, j] for j in range(len(emits))}
    update["depth"] = int(inputs.depth["recurrences"][row])
    update["pages"] = (ctx, len(emits))
    return update

  def _apply(self, seq, state: RequestState, update: dict) -> None:
    """Applies one row's results to its request (after the whole step succeeded)."""
    state.logits.update(update["logits"])
    state.positions.update(update["positions"])
    if "final" in update:
      self._record_depths(seq, state, *update["final"][:2], update["depth"], update["final"][2])
    if "round" in update:
      seq.emitted = len(update["emits"])
      state.rounds.append(len(update["emits"]))
      state.drafted += update["round"][0]
      state.accepted += update["round"][1]
      ctx, written = update["pages"]
      if self.page_depths is not None:  # The verifier's recurrences, at the kept positions.
        positions = np.arange(ctx, ctx + written)
        pages = np.asarray(seq.pages)[positions // self.page_size]
        self.page_depths[pages, positions % self.page_size] = update["depth"]
    for emit in update["emits"]:
      state.token_depths.append(update["depth"])
      self._emit(seq, state, *emit)

  def _row_update(self, seq, state, i, ctx, new, logits, positions, logprob_B) -> dict:
    """Call row i's logits and position logprobs to record, and whether its chunk (new tokens
    after ctx cached ones) samples a token."""
    sampled = ctx + new == seq.num_tokens
    update = {"sampled": sampled, "logits": {}, "positions": {}}
    if logits is not None:
      for j in range(new):
        update["logits"][ctx + j] = logits[i, j]
    if positions is not None and state.request.position_logprobs:
      target, top_ids, top = positions
      for j in range(new):
        lp = float(logprob_B[i]) if sampled and j == new - 1 else float(target[i, j])
        update["positions"][ctx + j] = (lp, top_ids[i, j].tolist(), top[i, j].tolist())
    return update

  def _stop(self, state: RequestState, tokens: list[int]) -> tuple[str | None, str]:
    """(finish reason or None, text) once `tokens` are appended: computed before anything is."""
    return sampling.check_stop(state.generated + tokens, state.request.sampling, self.decode)

  def _emit(self, seq, state: RequestState, token: int, logprob: float, stop) -> None:
    state.generated.append(token)
    state.tokens.append(token)
    state.logprobs.append(logprob)
    reason, state.text = stop
    if reason is not None:
      state.finish_reason = reason
      seq.stopped = True
    elif len(state.generated) == state.request.output_len:
      state.finish_reason = "length"
    if self.on_token is not None:
      self.on_token(state)
