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
