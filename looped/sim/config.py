"""The simulator's sections: every field of `config.sim` and `config.synthetic` declared once,
with its default, doc and range (looped.schema derives configs/serve_sim.py's ConfigDicts, the
range checks and help; looped/sim/simulate.py checks the sweeps and the rules relating fields).
"""

from __future__ import annotations

import dataclasses

from looped import kv_quant
from looped.engine.config import BatchingLimits
from looped.schema import field, redefault
from looped.sim import cost_model, hardware


@dataclasses.dataclass(frozen=True)
class SimConfig(BatchingLimits):
  """`config.sim`: the trace, the sweep (budgets x layouts x formats) and the engine's limits."""

  trace: str = field(
    "",
    "Mooncake JSONL path or bundled alias ('mooncake_conversation'); '' = synthetic; "
    "'sessions' = the session trace of config.sessions.",
    by_hand="an existing Mooncake JSONL file, a bundled trace, 'sessions' or ''",
  )
  trace_block_size: int = field(
    512, "Tokens per hash_ids block of the trace file (Mooncake: 512).", min=1
  )
  time_scale: float = field(
    1.0, "Arrival times are multiplied by this (0.5 = replay twice as fast).", gt=0
  )
  max_requests: int = field(0, "Replay only the first N requests (0 = all).", min=0)
  kv_budget_bytes: tuple = field(
    (24e9, 32e9, 48e9, 64e9, 96e9, 128e9),
    "KV budgets swept (None = unbounded); each holds at least one page.",
    by_hand="a positive number or None, or a tuple of them",
  )
  share_kv: tuple = field(
    (True, False),
    "Layouts to compare: shared (final recurrence) / unshared.",
    by_hand="True, False or a tuple of them",
  )
  kv_format: tuple = field(
    ("bf16",),
    "KV formats swept ('bf16,fp8' on a command line is a tuple).",
    by_hand="a tuple of formats from " + ", ".join(kv_quant.FORMATS),
  )
  # The scheduler's limits (BatchingLimits), at vLLM's defaults for a serving accelerator.
  max_num_batched_tokens: int = redefault(BatchingLimits, "max_num_batched_tokens", 8192)
  max_num_seqs: int = redefault(BatchingLimits, "max_num_seqs", 256)
  prefill_block: int = field(
    32,
    "Prefill block as the engine runs it (docs/design.md §3): chunks end at its multiples; "
    "shared, a block is one step's chunk and generated tokens one per step. 0: no blocks.",
    min=0,
  )
  hardware: str = field(
    "h200",
    "Hardware profile ('cpu_2core' prices looped/engine's padded CPU step; there 'bf16' stands "
    "for the engine's raw pages, other formats for packed ones).",
    choices=hardware.PROFILES,
  )
  hardware_json: str = field("", "JSON of measured values overriding the profile ('' = none).")
  weight_format: str = field(
    "bf16", "Weight storage read each step.", choices=cost_model.WEIGHT_BYTES
  )
  check_invariants: bool = field(False, "Verify pool and block tables after every step (slow).")


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  """`config.synthetic`: the generated multi-turn trace, used when sim.trace is ''."""

  num_requests: int = field(2000, "Requests generated.", min=1)
  rate_per_s: float = field(2.0, "Mean Poisson arrival rate.", gt=0)
  num_sessions: int = field(64, "Concurrent multi-turn conversations.", min=1)
  system_prompt_tokens: int = field(2048, "System prompt shared by every request.", min=0)
  mean_turn_tokens: float = field(1500.0, "Mean new user tokens per turn (exponential).", min=1)
  mean_output_tokens: float = field(300.0, "Mean generated tokens per turn (exponential).", min=1)
  max_prompt_tokens: int = field(65536, "A conversation restarts beyond this prompt length.", min=1)
  seed: int = field(0, "Seed of the synthetic trace.", min=0)


@dataclasses.dataclass(frozen=True)
class SessionsConfig:
  """`config.sessions`: the multi-turn session trace (looped/sim/sessions.py), used when
  sim.trace is 'sessions'. Lengths and times are drawn uniformly from [min, max]."""

  num_sessions: int = field(200, "Conversations generated.", min=1)
  session_rate_per_s: float = field(0.5, "Mean Poisson arrival rate of new sessions.", gt=0)
  min_turns: int = field(2, "Fewest turns of a session.", min=1)
  max_turns: int = field(8, "Most turns of a session (>= min_turns).", min=1)
  shared_system_tokens: int = field(1024, "System prompt shared by every session (0: none).", min=0)
  min_context_tokens: int = field(0, "Fewest first-turn context tokens of a session's own.", min=0)
  max_context_tokens: int = field(4096, "Most first-turn context tokens (>= min).", min=0)
  min_input_tokens: int = field(32, "Fewest new user tokens per turn.", min=1)
  max_input_tokens: int = field(1024, "Most new user tokens per turn (>= min).", min=1)
  min_output_tokens: int = field(32, "Fewest generated tokens per turn.", min=1)
  max_output_tokens: int = field(512, "Most generated tokens per turn (>= min).", min=1)
  min_think_s: float = field(5.0, "Shortest time from a turn's arrival to the next's.", min=0)
  max_think_s: float = field(60.0, "Longest time from a turn's arrival to the next's.", min=0)
  max_prompt_tokens: int = field(
    0, "A session ends before a turn whose prompt + output would pass this (0: no limit).", min=0
  )
  block_size: int = field(512, "Tokens per hash_ids block (Mooncake: 512).", min=1)
  seed: int = field(0, "Seed of the session trace.", min=0)
