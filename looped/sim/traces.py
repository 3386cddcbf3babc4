"""Request traces: Mooncake JSONL (load, validate, write) and a synthetic generator.

Mooncake format, one JSON object per line: `timestamp` (arrival, ms from the trace's start),
`input_length` and `output_length` (tokens), `hash_ids` (ids of the prompt's 512-token blocks,
chained by prefix: equal ids at the same position mean equal prompts through that block). A trace
generated for a small model may use smaller blocks (looped/sim/sessions.py); the file does not
say which, so it is read with the block size it was written with (`sim.trace_block_size`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Sequence

import numpy as np

from looped.scheduler import page_keys

MOONCAKE_BLOCK_SIZE = 512
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
  """A trace line is malformed; the message names the file and line."""


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
  """One request of a trace: when it arrives, its lengths and its prompt's block hashes."""

  request_id: int
  arrival_s: float
  prompt_len: int
  output_len: int
  block_hashes: tuple[int, ...]
  block_size: int = MOONCAKE_BLOCK_SIZE

  def prompt_page_keys(self, page_size: int) -> list[int]:
    return page_keys.prompt_page_keys(
      self.block_hashes, self.block_size, self.prompt_len, page_size
    )


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _check_row(row, where: str, block_size: int = MOONCAKE_BLOCK_SIZE) -> None:
  if not isinstance(row, dict):
    raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}.")
  missing = [f for f in _FIELDS if f not in row]
  if missing:
    raise TraceError(f"{where}: missing field(s) {missing}; each line needs {list(_FIELDS)}.")
  ts = row["timestamp"]
  if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
    raise TraceError(f"{where}: timestamp = {ts!r} must be a finite number of ms >= 0.")
  for name in ("input_length", "output_length"):
    if not _is_int(row[name]) or row[name] < 1:
      raise TraceError(f"{where}: {name} = {row[name]!r} must be an integer >= 1.")
  hashes = row["hash_ids"]
  if not isinstance(hashes, list) or not all(_is_int(h) and h >= 0 for h in hashes):
    raise TraceError(f"{where}: hash_ids must be a list of integers >= 0.")
  expected = math.ceil(row["input_length"] / block_size)
  if len(hashes) != expected:
    raise TraceError(
      f"{where}: len(hash_ids) = {len(hashes)} but input_length = {row['input_length']} "
      f"needs ceil(input_length / {block_size}) = {expected} (blocks of {block_size} tokens)."
    )


class _ChainChecker:
  """Checks that every hash id always sits at the same position after the same predecessor."""

  def __init__(self):
    self._seen: dict[int, tuple[int, int, str]] = {}  # id -> (position, predecessor, where).

  def check(self, hashes: Sequence[int], where: str) -> None:
    seen = self._seen
    parent = -1
    for j, h in enumerate(hashes):
      entry = seen.get(h)
      if entry is None:
        seen[h] = (j, parent, where)
      elif entry[0] != j or entry[1] != parent:
        raise TraceError(
          f"{where}: hash_ids[{j}] = {h} also appears at position {entry[0]} after "
          f"{entry[1]} ({entry[2]}); hash_ids must be chained by prefix."
        )
      parent = h


# Traces shipped with the package (traces_data/README.md names source and license), by alias.
BUNDLED = {
  "mooncake_conversation": os.path.join(
    os.path.dirname(__file__), "traces_data", "mooncake_conversation.jsonl"
  ),
}


def resolve(trace: str) -> str:
  """A bundled trace's alias -> its path; any other string is taken as a path."""
  return BUNDLED.get(trace, trace)


def load_mooncake(
  path: str,
  *,
  time_scale: float = 1.0,
  max_requests: int = 0,
  block_size: int = MOONCAKE_BLOCK_SIZE,
) -> list[Request]:
  """Reads and validates a Mooncake JSONL trace.

  Args:
    path: the .jsonl file, or the alias of a bundled trace (`BUNDLED`).
    time_scale: arrival times are multiplied by this (0.5 replays the trace twice as fast).
    max_requests: keep only the first N requests (0: all).
    block_size: tokens per hash_ids block (Mooncake's 512; a generated trace's own).

  Raises:
    TraceError: naming the line of the first malformed request.
  """
  if not time_scale > 0:
    raise ValueError(f"time_scale must be > 0, got {time_scale}.")
  requests = []
  chain = _ChainChecker()
  last_ts = 0.0
  path = resolve(path)
  with open(path, "rb") as f:
    for lineno, raw in enumerate(f, start=1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise TraceError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start}).") from None
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg}).") from None
      _check_row(row, where, block_size)
      if row["timestamp"] < last_ts:
        raise TraceError(
          f"{where}: timestamp {row['timestamp']} is before the previous line's {last_ts}; "
          "timestamps must be non-decreasing."
        )
      last_ts = row["timestamp"]
      chain.check(row["hash_ids"], where)
      requests.append(
        Request(
          request_id=len(requests),
          arrival_s=row["timestamp"] / 1000.0 * time_scale,
          prompt_len=row["input_length"],
          output_len=row["output_length"],
          block_hashes=tuple(row["hash_ids"]),
          block_size=block_size,
        )
      )
      if max_requests and len(requests) == max_requests:
        break
  if not requests:
    raise TraceError(f"{path}: the trace holds no requests.")
  return requests


def ideal_hit_rate(requests: Sequence[Request], capacity_tokens: float | None = None) -> float:
  """Prefix hit rate of an idealised cache, a reference for what a run could reach.

  The cache holds whole blocks (LRU, `capacity_tokens` of room, None = unbounded) and none of its
  room goes to running requests; every prompt's blocks enter it at arrival. As in the simulator,
  a hit is the longest cached run of leading blocks and the last prompt token never hits. With
  capacity None this is the trace's own prefix reuse.
  """
  lru: collections.OrderedDict[int, None] = collections.OrderedDict()
  hit = total = 0
  for r in requests:
    run = 0
    for h in r.block_hashes:
      if h not in lru:
        break
      run += 1
    hit += min(run * r.block_size, r.prompt_len - 1) // r.block_size * r.block_size
    total += r.prompt_len
    for h in r.block_hashes:
      lru[h] = None
      lru.move_to_end(h)
    if capacity_tokens is not None:
      while lru and len(lru) * r.block_size > capacity_tokens:
        lru.popitem(last=False)
  return hit / total if total else 0.0


def write_mooncake(requests: Iterable[Request], path: str) -> None:
  """Writes requests in Mooncake format (timestamps in ms). All must share one block size (the
  file does not record it: a trace of blocks other than 512 tokens is read back with its own)."""
  requests = list(requests)
  sizes = sorted({r.block_size for r in requests})
  if len(sizes) > 1:
    raise ValueError(f"one block size per trace, got {sizes}.")
  with open(path, "w") as f:
    for r in requests:
      row = {
        "timestamp": round(r.arrival_s * 1000.0, 3),
        "input_length": r.prompt_len,
        "output_length": r.output_len,
        "hash_ids": list(r.block_hashes),
      }
      f.write(json.dumps(row) + "\n")


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
  """Multi-turn chat sessions behind one system prompt, arriving as a Poisson process."""

  num_requests: int = 1000
  rate_per_s: float = 1.0  # Mean arrivals per second.
  num_sessions: int = 50  # Conversations open at once; each request continues a random one.
  system_prompt_tokens: int = 1024  # Shared by every request.
  mean_turn_tokens: float = 600.0  # New user tokens per turn (exponential).
  mean_output_tokens: float = 200.0  # Generated tokens per turn (exponential).
  max_prompt_tokens: int = 32768  # A conversation restarts when its prompt would exceed this.
  seed: int = 0


def synthetic(spec: SyntheticSpec) -> list[Request]:
  """Generates a trace whose prompts are system prompt + conversation history + new turn.

  Block ids are interned from (owner, block index, block length): owner is the system prompt for
  blocks inside it, else the conversation, whose token stream only grows; so equal ids mean equal
  prefixes, as in Mooncake.
  """
  rng = np.random.default_rng(spec.seed)
  bs = MOONCAKE_BLOCK_SIZE
  arrivals = np.cumsum(rng.exponential(1.0 / spec.rate_per_s, spec.num_requests))
  sessions = rng.integers(0, spec.num_sessions, spec.num_requests)
  turns = 1 + rng.exponential(spec.mean_turn_tokens, spec.num_requests).astype(np.int64)
  outputs = 1 + rng.exponential(spec.mean_output_tokens, spec.num_requests).astype(np.int64)
  ids: dict[tuple[int, int, int], int] = {}
  owner = list(range(spec.num_sessions))  # Conversation id of each session slot.
  history = [0] * spec.num_sessions  # Tokens of the conversation so far (after the system).
  next_owner = spec.num_sessions
  sys_len = spec.system_prompt_tokens
  requests = []
  for i in range(spec.num_requests):
    s = int(sessions[i])
    turn, out = int(turns[i]), int(outputs[i])
    if sys_len + history[s] + turn > spec.max_prompt_tokens:
      owner[s], history[s], next_owner = next_owner, 0, next_owner + 1
    prompt_len = min(sys_len + history[s] + turn, spec.max_prompt_tokens)
    hashes = []
    for j in range(math.ceil(prompt_len / bs)):
      length = min(bs, prompt_len - j * bs)
      block_owner = -1 if j * bs + length <= sys_len else owner[s]
      hashes.append(ids.setdefault((block_owner, j, length), len(ids)))
    requests.append(
      Request(
        request_id=i,
        arrival_s=float(arrivals[i]),
        prompt_len=prompt_len,
        output_len=out,
        block_hashes=tuple(hashes),
      )
    )
    history[s] = prompt_len - sys_len + out
  return requests
