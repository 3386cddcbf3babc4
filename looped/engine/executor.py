"""The scheduler's executor backed by the real model: one jitted step per scheduled batch.

A step takes the scheduler's ragged batch (each sequence computes q_i new tokens after c_i
cached ones; prefill chunks and decode tokens mixed), pads it to a (rows, tokens, page-table
width) bucket (looped/engine/padding.py, which the simulator's engine pricing shares) so steps
do not recompile, gathers each row's pages into a dense cache, runs the model's decode
path, writes the new K/V back into the pages and samples the next token of every sequence whose
chunk reaches its last token.

Two ways to run a chunk, chosen so a token's K/V depend only on the tokens before it (which is
what makes a prefix-cache hit or a recompute after preemption reproduce the same values):
- parallel (unshared layout, raw K/V): the q_i tokens in one model call, causal within the
  chunk; equal to the parallel forward.
- sequential (shared layout, or any KV format): the chunk's tokens one at a time in a lax.scan.
  Under sharing, a token's recurrences must read the *final* K/V of every earlier token, which a
  parallel chunk does not give (docs/design.md §3), and with a KV format every earlier token
  must be read through the format; one token at a time is exact shared decode (and the format's
  own quantized decode) whatever the chunking.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from looped.engine import paged_cache, sampling
from looped.engine.padding import Padding, bucket, powers_of_two  # noqa: F401 (re-exported)
from looped.engine.requests import GenRequest
from looped.model.looped_lm import LoopedLM
from looped.scheduler import scheduler as scheduler_lib


class RequestFailed(RuntimeError):
  """A step failed on one request's own data (building its row, or applying its token); the
  step's results were not applied, so the engine can drop that request and go on."""

  def __init__(self, request_id: int, cause: BaseException):
    super().__init__(f"request {request_id}: {type(cause).__name__}: {cause}")
    self.request_id = request_id


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


def _step_fn(
  model: LoopedLM,
  share_kv: bool,
  kv_format: str | None,
  sequential: bool,
  return_logits: bool,
  top_logprobs: int,
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
):
  b, t = tokens_BxT.shape
  cache = paged_cache.gather(pages, page_table_BxP, context_B, share_kv, kv_format)
  if sequential:
    # Only as many micro-steps as the longest chunk: a decode-only step costs one, whatever T.
    def one_token(j, carry):
      cache, logits_TxBxV = carry
      logits, aux = model.apply(params, tokens_BxT[:, j][:, None], cache=cache)
      return aux["cache"], logits_TxBxV.at[j].set(logits[:, 0])

    v = model.cfg.vocab_size
    init = (cache, jnp.zeros((t, b, v), jnp.float32))
    cache, logits_TxBxV = jax.lax.fori_loop(0, jnp.max(num_new_B), one_token, init)
    logits_BxTxV = jnp.moveaxis(logits_TxBxV, 0, 1)
  else:
    logits_BxTxV, aux = model.apply(params, tokens_BxT, cache=cache)
    cache = aux["cache"]
  pages = paged_cache.scatter(pages, cache, page_table_BxP, context_B, num_new_B, t, share_kv)
  last_BxV = logits_BxTxV[jnp.arange(b), jnp.maximum(num_new_B - 1, 0)]
  token_B, logprob_B = sampling.sample(last_BxV, temperature_B, top_k_B, top_p_B, seed_B, index_B)
  positions = None
  if top_logprobs:  # Every position's distribution over the next token (the raw logits').
    logprobs_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    target_BxT = jnp.take_along_axis(logprobs_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    # Each [B, T, top_logprobs]: the best next tokens' logprobs and their ids.
    top, top_ids = jax.lax.top_k(logprobs_BxTxV, top_logprobs)
    positions = (target_BxT, top_ids, top)
  return pages, token_B, logprob_B, (logits_BxTxV if return_logits else None), positions


@functools.lru_cache(maxsize=32)
def compiled_step(
  cfg, share_kv: bool, kv_format: str | None, sequential: bool, logits: bool, top_logprobs: int = 0
):
  """The jitted step for a model and layout; shared by engines so each shape compiles once."""
  step = functools.partial(
    _step_fn, LoopedLM(cfg), share_kv, kv_format, sequential, logits, top_logprobs
  )
  return jax.jit(step, donate_argnums=(1,))


class ModelExecutor:
  """Runs scheduler batches on the model (see the module docstring); returns step durations."""

  def __init__(
    self,
    model: LoopedLM,
    params,
    *,
    num_pages: int,
    page_size: int,
    share_kv: bool,
    kv_format: str | None,
    max_model_len: int,
    row_buckets: tuple[int, ...],
    token_buckets: tuple[int, ...],
    column_buckets: tuple[int, ...] | None = None,
    sequential: bool | None = None,
    clock: scheduler_lib.Executor | None = None,
    record_logits: bool = False,
    decode: Callable | None = None,
    on_token: Callable | None = None,
    top_logprobs: int = 0,
  ):
    """top_logprobs: k > 0 makes every step also compute, per position, the logprob of the next
    token and the k most likely ones, kept for requests with position_logprobs."""
    self.model = model
    self.params = params
    self.page_size = page_size
    self.share_kv = share_kv
    self.kv_format = kv_format
    self.scratch_page = num_pages
    self.pages = paged_cache.init_pages(model.cfg, num_pages, page_size, share_kv, kv_format)
    self.sequential = (share_kv or kv_format is not None) if sequential is None else sequential
    # Page-table widths: the dense cache a step attends over is columns * page_size slots.
    self.padding = Padding.create(
      page_size, row_buckets, token_buckets, column_buckets, max_model_len, self.sequential
    )
    self.clock = clock
    self.record_logits = record_logits
    self.decode = decode or (lambda ids: "")
    self.on_token = on_token
    self.states: dict[int, RequestState] = {}
    self.last_batch: list[int] = []  # Request ids of the step last started (failed or not).
    self.step_log: list[dict] = []  # Per step: rows, tokens, bucket, wall seconds.
    self.top_logprobs = top_logprobs
    self._step = compiled_step(
      model.cfg, share_kv, kv_format, self.sequential, record_logits, top_logprobs
    )

  def add(self, request: GenRequest) -> None:
    self.states[request.request_id] = RequestState(request, list(request.prompt_tokens))

  def warmup(self, shapes, on_shape: Callable | None = None) -> None:
    """Compiles (or loads from the persistent compilation cache) the step of each padded
    (rows, tokens, columns) shape by running it once on no tokens: every row reads and writes
    only the scratch page, so no cached K/V changes."""
    for i, (b, q, columns) in enumerate(shapes):
      zeros_B = np.zeros((b,), np.int32)
      self.pages, *_ = self._step(
        self.params,
        self.pages,
        np.zeros((b, q), np.int32),
        np.full((b, columns), self.scratch_page, np.int32),
        zeros_B,
        zeros_B,
        np.zeros((b,), np.float32),
        zeros_B,
        np.ones((b,), np.float32),
        zeros_B,
        zeros_B,
        np.zeros((b, q), np.int32),
      )
      if on_shape is not None:
        on_shape(i + 1, len(shapes))
    jax.block_until_ready(self.pages)

  def pages_valid(self) -> bool:
    """False once a step failed after donating the pages to the device (they are gone)."""
    return not any(leaf.is_deleted() for leaf in jax.tree.leaves(self.pages))

  def reset_pages(self) -> None:
    """Fresh, zeroed pages (every cached K/V lost: the caller drops whatever refers to them)."""
    cfg = self.model.cfg
    self.pages = paged_cache.init_pages(
      cfg, self.scratch_page, self.page_size, self.share_kv, self.kv_format
    )

  def execute(self, batch: scheduler_lib.StepBatch) -> float:
    """Runs one step. Nothing of it is applied (request states, emitted tokens) unless all of it
    succeeds: a row that fails raises RequestFailed naming its request, anything else fails the
    step as a whole; either way the scheduler's state is that of before the step."""
    n = len(batch.seqs)
    self.last_batch = [seq.request.request_id for seq in batch.seqs]
    padded = self.padding.shape(batch.num_new_tokens, batch.num_context_tokens)
    b, q, columns = padded.rows, padded.tokens, padded.columns
    tokens = np.zeros((b, q), np.int32)
    table = np.full((b, columns), self.scratch_page, np.int32)
    context = np.zeros((b,), np.int32)
    num_new = np.zeros((b,), np.int32)
    temperature = np.zeros((b,), np.float32)
    top_k = np.zeros((b,), np.int32)
    top_p = np.ones((b,), np.float32)
    seed = np.zeros((b,), np.int32)
    index = np.zeros((b,), np.int32)
    targets = np.zeros((b, q), np.int32)
    states = []
    for i, (seq, new, ctx) in enumerate(
      zip(batch.seqs, batch.num_new_tokens, batch.num_context_tokens)
    ):
      try:
        state = self.states[seq.request.request_id]
        states.append(state)
        tokens[i, :new] = state.tokens[ctx : ctx + new]
        table[i, : len(seq.pages)] = seq.pages
        context[i], num_new[i] = ctx, new
        sp = state.request.sampling
        temperature[i], top_k[i], top_p[i], seed[i] = sp.temperature, sp.top_k, sp.top_p, sp.seed
        index[i] = len(state.generated)
        if self.top_logprobs and state.request.position_logprobs:
          known = state.tokens[ctx + 1 : ctx + new + 1]  # The last one is sampled if unknown.
          targets[i, : len(known)] = known
      except Exception as e:
        raise RequestFailed(seq.request.request_id, e) from e
    start = time.perf_counter()
    self.pages, token_B, logprob_B, logits, positions = self._step(
      self.params,
      self.pages,
      tokens,
      table,
      context,
      num_new,
      temperature,
      top_k,
      top_p,
      seed,
      index,
      targets,
    )
    token_B, logprob_B = np.asarray(token_B), np.asarray(logprob_B)
    wall = time.perf_counter() - start
    self.step_log.append(
      {"rows": n, "tokens": int(num_new.sum()), "bucket": (b, q, columns), "s": wall}
    )
    if logits is not None:
      logits = np.asarray(logits)
    if positions is not None:
      positions = tuple(np.asarray(x) for x in positions)
    # Every row's results first, applied only once all of them are known (see execute).
    updates = []
    for i, (seq, state) in enumerate(zip(batch.seqs, states)):
      try:
        updates.append(
          self._row_update(seq, state, i, context, num_new, logits, positions, logprob_B)
        )
        if updates[-1]["sampled"]:
          token, logprob = int(token_B[i]), float(logprob_B[i])
          updates[-1]["emit"] = (token, logprob, self._stop(state, token))
      except Exception as e:
        raise RequestFailed(seq.request.request_id, e) from e
    for (seq, state), update in zip(zip(batch.seqs, states), updates):
      state.logits.update(update["logits"])
      state.positions.update(update["positions"])
      if "emit" in update:
        self._emit(seq, state, *update["emit"])
    return wall if self.clock is None else self.clock.execute(batch)

  def _row_update(self, seq, state, i, context, num_new, logits, positions, logprob_B) -> dict:
    """Row i's logits and position logprobs to record, and whether its chunk samples a token."""
    ctx, new = int(context[i]), int(num_new[i])
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

  def _stop(self, state: RequestState, token: int) -> tuple[str | None, str]:
    """(finish reason or None, text) once `token` is appended: computed before anything is."""
    return sampling.check_stop(state.generated + [token], state.request.sampling, self.decode)

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
