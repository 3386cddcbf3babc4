"""Multi-turn session traces: conversations whose every turn resends the whole history.

A session starts at a Poisson arrival (`session_rate_per_s`) and runs `min_turns`..`max_turns`
turns. Its first prompt is the shared system prompt (the same tokens in every session, or none),
the session's own context and the first user input; turn t + 1's prompt is turn t's prompt, its
output and a new user input, and it arrives a think time after turn t arrived (an open-loop
trace cannot know when turn t's answer ends, so the think time includes it). Every length and
time is drawn uniformly from its [min, max], from one seeded generator, session by session.

Block ids follow Mooncake's chain: block j of a prompt (tokens [j B, (j + 1) B), B =
`block_size`) gets the id of (owner, j, its length), where the owner is the shared system prompt
for a block inside it and the session otherwise. A session's token stream only grows, so every
later turn's hash_ids start with the earlier turns' full blocks, and equal ids mean equal
prefixes. Written with traces.write_mooncake; a trace of blocks other than 512 tokens is read
back with `sim.trace_block_size` set to its block size.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from looped import config_checks as checks
from looped import schema
from looped.sim.config import SessionsConfig
from looped.sim.traces import Request

_RANGES = ("turns", "context_tokens", "input_tokens", "output_tokens", "think_s")


def check(cfg: SessionsConfig, prefix: str = "sessions") -> None:
  """Each field's type and range, then min <= max and a first turn that fits max_prompt_tokens;
  raises ConfigError naming the field."""
  schema.validate(SessionsConfig, {prefix: dataclasses.asdict(cfg)}, prefix)
  for name in _RANGES:
    low, high = getattr(cfg, f"min_{name}"), getattr(cfg, f"max_{name}")
    if high < low:
      checks.fail(f"{prefix}.max_{name}", high, f"must be >= {prefix}.min_{name} = {low}")
  if cfg.max_prompt_tokens:
    first = (
      cfg.shared_system_tokens
      + cfg.max_context_tokens
      + cfg.max_input_tokens
      + cfg.max_output_tokens
    )
    if cfg.max_prompt_tokens < first:
      checks.fail(
        f"{prefix}.max_prompt_tokens",
        cfg.max_prompt_tokens,
        f"must hold the longest first turn, shared system + max context + max input + max "
        f"output = {first} tokens (or be 0: no limit)",
      )


def generate(cfg: SessionsConfig) -> list[Request]:
  """The session trace of `cfg` (checked first), in arrival order (module docstring)."""
  check(cfg)
  rng = np.random.default_rng(cfg.seed)

  def uniform_int(name: str) -> int:
    return int(rng.integers(getattr(cfg, f"min_{name}"), getattr(cfg, f"max_{name}") + 1))

  starts = np.cumsum(rng.exponential(1.0 / cfg.session_rate_per_s, cfg.num_sessions))
  bs, shared = cfg.block_size, cfg.shared_system_tokens
  ids: dict[tuple[int, int, int], int] = {}
  rows = []  # (arrival s, session, turn, prompt tokens, output tokens, hash ids)
  for session in range(cfg.num_sessions):
    turns = uniform_int("turns")
    history = shared + uniform_int("context_tokens")  # Tokens before this turn's input.
    arrival = float(starts[session])
    for turn in range(turns):
      prompt = history + uniform_int("input_tokens")
      output = uniform_int("output_tokens")
      if cfg.max_prompt_tokens and prompt + output > cfg.max_prompt_tokens:
        break
      hashes = []
      for j in range(math.ceil(prompt / bs)):
        length = min(bs, prompt - j * bs)
        owner = -1 if j * bs + length <= shared else session
        hashes.append(ids.setdefault((owner, j, length), len(ids)))
      rows.append((arrival, session, turn, prompt, output, tuple(hashes)))
      history = prompt + output
      arrival += float(rng.uniform(cfg.min_think_s, cfg.max_think_s))
  rows.sort(key=lambda row: row[:3])
  return [
    Request(i, arrival, prompt, output, hashes, block_size=bs)
    for i, (arrival, _, _, prompt, output, hashes) in enumerate(rows)
  ]
