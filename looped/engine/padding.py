"""The padded shape looped/engine's executor computes for a scheduler batch.

The engine pads every step to a (rows, tokens per row, page-table columns) bucket so that a shape
compiles once, and attends over columns * page_size dense slots whatever the real context. Under
sharing or with a KV format it runs a chunk token by token: as many model calls as the longest
chunk, each over every padded row. The executor and its cost model (engine_cost.py) both pad
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


@dataclasses.dataclass(frozen=True)
class StepShape:
  rows: int  # Padded rows (row bucket).
  tokens: int  # Padded new tokens per row (token bucket).
  columns: int  # Page-table width: the step attends over columns * page_size slots.
  calls: int  # Model calls: 1 (parallel chunk) or the longest chunk (token by token).


@dataclasses.dataclass(frozen=True)
class Padding:
  page_size: int
  row_buckets: tuple[int, ...]
  token_buckets: tuple[int, ...]
  column_buckets: tuple[int, ...]  # Closed by the widest table a step can need.
  sequential: bool  # Chunks run token by token (shared layout, or any KV format).

  @classmethod
  def create(
    cls,
    page_size: int,
    row_buckets: tuple[int, ...],
    token_buckets: tuple[int, ...],
    column_buckets: tuple[int, ...] | None,
    max_model_len: int,
    sequential: bool,
  ) -> Padding:
    """Buckets as given, column buckets capped by the widest page table a step can write."""
    max_columns = -(-(max_model_len + token_buckets[-1]) // page_size)
    columns = tuple(c for c in column_buckets or () if c < max_columns) + (max_columns,)
    return cls(page_size, tuple(row_buckets), tuple(token_buckets), columns, sequential)

  @classmethod
  def engine_default(cls, config, sequential: bool) -> Padding:
    """The buckets looped.engine.Engine uses by default for a SchedulerConfig: powers of two up
    to max_num_seqs, max_num_batched_tokens and max_model_len's page-table width."""
    p, max_len = config.page_size, config.max_model_len
    if max_len is None:
      raise ValueError("The engine's padding needs max_model_len (its widest page table).")
    return cls.create(
      p,
      powers_of_two(config.max_num_seqs),
      powers_of_two(config.max_num_batched_tokens),
      powers_of_two(-(-max_len // p)),
      max_len,
      sequential,
    )

  def shape(self, num_new: Sequence[int], num_context: Sequence[int]) -> StepShape:
    """The padded step for rows computing num_new[i] tokens after num_context[i] cached ones."""
    rows = bucket(len(num_new), self.row_buckets)
    longest = max(num_new)
    tokens = bucket(longest, self.token_buckets)
    reach = max(c + tokens for c in num_context)  # Slots the padded step writes up to.
    columns = bucket(-(-reach // self.page_size), self.column_buckets)
    return StepShape(rows, tokens, columns, longest if self.sequential else 1)

  def reachable(
    self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
  ) -> list[tuple[int, int, int]]:
    """Every (rows, tokens, columns) bucket some scheduler batch pads to.

    n rows in (r0, r] with the longest chunk in (t0, t] fit the token budget when the fewest
    such tokens do (the other rows at one token each). A step writes slots up to
    max(context + t): at least t, and at most max_model_len - 1 + t when a second row may be a
    decode at the last position, else (one row) max_model_len - (t0 + 1) + t. Column bucket
    c in (c0, c] is reached when that range meets (c0 * page_size, c * page_size]."""
    out = []
    rows_prev, p = 0, self.page_size
    for r in self.row_buckets:
      tokens_prev = 0
      for t in self.token_buckets:
        fewest = max(rows_prev + 1, 1)  # Rows in this bucket, at the least.
        if fewest <= max_num_seqs and fewest - 1 + tokens_prev + 1 <= max_num_batched_tokens:
          two_rows = 2 <= min(r, max_num_seqs) and 1 + tokens_prev + 1 <= max_num_batched_tokens
          furthest = max_model_len - 1 + t if two_rows else max_model_len - tokens_prev - 1 + t
          columns_prev = 0
          for c in self.column_buckets:
            if c * p >= t and columns_prev * p < furthest:
              out.append((r, t, c))
            columns_prev = c
        tokens_prev = t
      rows_prev = r
    return out
