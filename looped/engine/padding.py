"""The padded model calls looped/engine's executor runs for a scheduler batch.

A step's rows are split by what they compute: rows with one new token (decodes, and one-token
blocks) form one call of shape [rows, 1], rows with a longer chunk (prefill blocks) another of
shape [rows, tokens]. So a decode token costs one token whatever another row's chunk is, and a
step computes close to the tokens it needs. Each call is padded to a (rows, tokens, page-table
columns) bucket so that a shape compiles once, and attends over columns * page_size dense slots
whatever the real context. The executor and its cost model (looped/sim/engine_cost.py) both pad
through this module, so what is priced is what is run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


def bucket(n: int, sizes: tuple[int, ...]) -> int:
  """Smallest size >= n."""
  for s in sizes:
    if s >= n:
      return s
  raise ValueError(f"{n} exceeds the largest bucket {sizes[-1]}.")


def powers_of_two(limit: int) -> tuple[int, ...]:
  """1, 2, 4, ... up to limit (limit itself included)."""
  sizes, s = [], 1
  while s < limit:
    sizes.append(s)
    s *= 2
  return tuple(sizes) + (limit,)


def geometric(limit: int) -> tuple[int, ...]:
  """1, 2, 3, 4, 6, 8, 12, 16, 24, ... up to limit (included): past 2, each bucket at most 1.5x
  the one before, so padding to a bucket adds at most half, at ~2 log2(limit) buckets."""
  sizes, s = [], 1
  while s < limit:
    sizes.append(s)
    s = s + 1 if s < 2 else (s * 3 // 2 if s & (s - 1) == 0 else s * 4 // 3)
  return tuple(sizes) + (limit,)


def default_buckets(
  max_num_seqs: int, longest_chunk: int, max_columns: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """The engine's (row, token, column) buckets when none are given: powers of two, chunks from
  4 tokens and page tables from 4 pages. Few shapes by design (the default model at 512
  positions: 96 reachable, against 387 for the geometric buckets with every power-of-two
  width), so every one compiles in the background of a server that started on the largest
  (looped/engine/step_table.py bounds the live ones), at a bounded cost in padding: at most 2x
  rows, tokens and columns, 4x for chunks under 4 tokens and tables under 4 pages."""
  rows = powers_of_two(max_num_seqs)
  tokens = tuple(t for t in powers_of_two(longest_chunk) if t >= min(4, longest_chunk))
  columns = tuple(c for c in powers_of_two(max_columns) if c >= min(4, max_columns))
  return rows, tokens, columns


@dataclasses.dataclass(frozen=True)
class CallShape:
  rows: int  # Padded rows (row bucket).
  tokens: int  # Padded new tokens per row: 1 for the one-token call, else a token bucket.
  columns: int  # Page-table width: the call attends over columns * page_size slots.

  @property
  def computed(self) -> int:
    """Token positions the call computes, padding included."""
    return self.rows * self.tokens


@dataclasses.dataclass(frozen=True)
class StepShape:
  calls: tuple[CallShape, ...]  # The one-token call first, when there is one.
  groups: tuple[tuple[int, ...], ...]  # Batch row indices each call computes, in order.

  @property
  def computed(self) -> int:
    return sum(c.computed for c in self.calls)


@dataclasses.dataclass(frozen=True)
class Padding:
  page_size: int
  row_buckets: tuple[int, ...]
  token_buckets: tuple[int, ...]  # Chunks of two or more tokens pad to these.
  column_buckets: tuple[int, ...]  # Closed by the widest table a step can need.

  @classmethod
  def create(
    cls,
    page_size: int,
    row_buckets: tuple[int, ...],
    token_buckets: tuple[int, ...],
    column_buckets: tuple[int, ...] | None,
    max_model_len: int,
  ) -> Padding:
    """Buckets as given, column buckets capped by the widest page table a step can write."""
    max_columns = -(-(max_model_len + token_buckets[-1]) // page_size)
    columns = tuple(c for c in column_buckets or () if c < max_columns) + (max_columns,)
    return cls(page_size, tuple(row_buckets), tuple(token_buckets), columns)

  @classmethod
  def engine_default(cls, config) -> Padding:
    """The buckets looped.engine.Engine uses by default for a SchedulerConfig
    (default_buckets up to max_num_seqs, the longest chunk and max_model_len's page table)."""
    p, max_len = config.page_size, config.max_model_len
    if max_len is None:
      raise ValueError("The engine's padding needs max_model_len (its widest page table).")
    buckets = default_buckets(config.max_num_seqs, longest_chunk(config), -(-max_len // p))
    return cls.create(p, *buckets, max_len)

  def shape(self, num_new: Sequence[int], num_context: Sequence[int]) -> StepShape:
    """The padded calls for rows computing num_new[i] tokens after num_context[i] cached ones."""
    one = tuple(i for i, q in enumerate(num_new) if q == 1)
    more = tuple(i for i, q in enumerate(num_new) if q > 1)
    calls, groups = [], []
    for group in (one, more):
      if group:
        tokens = 1 if group is one else bucket(max(num_new[i] for i in group), self.token_buckets)
        reach = max(num_context[i] for i in group) + tokens  # Slots the call writes up to.
        columns = bucket(-(-reach // self.page_size), self.column_buckets)
        calls.append(CallShape(bucket(len(group), self.row_buckets), tokens, columns))
        groups.append(group)
    return StepShape(tuple(calls), tuple(groups))

  def reachable(
    self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, max_chunk: int
  ) -> list[tuple[int, int, int]]:
    """Every (rows, tokens, columns) call some scheduler batch pads to.

    A chunk of q tokens after c cached ones has c + q <= max_model_len - 1 (the last generated
    token is never fed back) and q <= max_chunk. The one-token call: n rows in (r0, r] need
    r0 + 1 rows within the seat and token limits; it writes up to c + 1 in [1, max_model_len - 1].
    The longer call: n rows in (r0, r] whose longest chunk is in (t0, t] need at least
    max(t0 + 1, 2) + 2 r0 tokens; it writes up to c + t, at least t and at most
    max_model_len - 3 + t when a second row (of two tokens) may sit at the end, else
    max_model_len - 1 - max(t0 + 1, 2) + t. Column bucket (c0, c] is reached when that range
    meets (c0 * page_size, c * page_size]."""
    out, rows_prev = [], 0
    for r in self.row_buckets:
      fewest = rows_prev + 1
      if fewest <= min(max_num_seqs, max_num_batched_tokens):
        out += [(r, 1, c) for c in self._columns_meeting(1, max_model_len - 1)]
      tokens_prev = 1
      for t in self.token_buckets:
        if t < 2:
          continue
        q = max(tokens_prev + 1, 2)
        chunk_fits = q <= min(max_chunk, max_model_len - 1)
        if chunk_fits and fewest <= max_num_seqs and q + 2 * rows_prev <= max_num_batched_tokens:
          two = r >= 2 and max_num_seqs >= 2 and q + 2 <= max_num_batched_tokens
          furthest = max_model_len - 3 + t if two else max_model_len - 1 - q + t
          out += [(r, t, c) for c in self._columns_meeting(t, furthest)]
        tokens_prev = t
      rows_prev = r
    return out

  def _columns_meeting(self, lo: int, hi: int) -> list[int]:
    """Column buckets (c0, c] whose slots (c0 * page_size, c * page_size] meet [lo, hi]."""
    out, prev = [], 0
    for c in self.column_buckets:
      if c * self.page_size >= lo and prev * self.page_size < hi:
        out.append(c)
      prev = c
    return out


def longest_chunk(config) -> int:
  """The most tokens one row computes in a step under a SchedulerConfig."""
  if config.prefill_block is None:
    return config.max_num_batched_tokens
  return min(config.prefill_block, config.max_num_batched_tokens)
