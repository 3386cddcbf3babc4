"""Serving simulation: prefix-cache hit rate, throughput and latency of a looped LM under KV
memory budgets, with and without KV-sharing (docs/design.md §5).

  python -m looped.main --config=configs/serve_sim.py --workdir=/tmp/sim
  python -m looped.main --config=configs/serve_sim.py --workdir=/tmp/sim \
      --config.sim.trace=mooncake_conversation \
      --config.sim.kv_budget_bytes='(2.4e10, 6.4e10, None)' --config.sim.kv_format=bf16,nvfp4
  python -m looped.main --config=configs/serve_sim.py:smoke --workdir=/tmp/sim_smoke
  python -m looped.main --config=configs/serve_sim.py:hybrid,sessions --workdir=/tmp/sim_sessions

Args: `smoke` (tiny model, 300 synthetic requests, runs in seconds with invariant checks); `mla`
or `hybrid` (the model's mixers, as configs/benice.py's variants); `sessions` or `sessions_1k`
(the multi-turn session trace, at Mooncake's scale or for a model of 1,024 positions).

The model is the paper-size looped LM: prelude/core/coda 8/8/8 layers, R = 8 recurrences,
d_model 1536, 12 query heads of 128 and 4 KV heads (GQA, groups of 3; 128 is the head width fast
attention kernels and the MX/NV block scales are built for), SwiGLU MLP of 4096 (= 8/3 d, rounded
to a multiple of 256), a 32k-token vocabulary (the trace counts tokens of a real BPE vocabulary,
so the LM head is sized like one). ~0.65B parameters; 80 layer executions per token; KV per
token 48 KiB shared and 160 KiB unshared in bf16.
"""

import ml_collections

import configs
from configs import pretrain
from looped import schema
from looped.sim.config import SessionsConfig, SimConfig, SyntheticConfig

VARIANTS = {
  "smoke": "tiny model, 300 synthetic requests, seconds, with invariant checks",
  "mla": "every layer MLA (latent 512 + RoPE key 64 cached per token)",
  "hybrid": "KDA everywhere except every second core layer MLA (KDA states per sequence)",
  "sessions": "the multi-turn session trace (config.sessions), 512-token blocks",
  "sessions_1k": "the session trace scaled to 1,024 positions: 16-token blocks",
}
# Mixers per stage (prelude, core, coda) of the mixer variants, as configs/benice.py's.
MIXERS = {
  "mla": (("mla",), ("mla",), ("mla",)),
  "hybrid": (("kda",), ("kda", "mla"), ("kda",)),
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)

  c = ml_collections.ConfigDict()
  c.program = "serve_sim"  # Which program main runs.

  c.model = pretrain.model_config()  # looped/model/config.py; only shape fields are read.
  c.model.vocab_size = 32768  # BPE-sized vocabulary: sets the LM head's cost.
  c.model.d_model = 1536  # Residual width of the paper-size model.
  c.model.num_heads = 12  # Query heads (12 x 128 = d_model).
  c.model.num_kv_heads = 4  # KV heads: GQA with groups of 3.
  c.model.head_dim = 128  # Head width.
  c.model.mlp_dim = 4096  # SwiGLU hidden width (8/3 d_model, rounded).
  c.model.num_prelude_layers = 8  # P.
  c.model.num_core_layers = 8  # B, looped R times.
  c.model.num_coda_layers = 8  # C.
  c.model.num_recurrences = 8  # R.
  c.model.max_seq_len = 131072  # Longest prompt + output served (Mooncake's longest is 126k).

  # Sections: every field, default, doc and range in its schema (see `--help`).
  c.sim = schema.defaults(SimConfig)  # looped/sim/config.py (SimConfig).
  c.synthetic = schema.defaults(SyntheticConfig)  # Used when sim.trace is ''; looped/sim/config.py.
  c.sessions = schema.defaults(SessionsConfig)  # Used when sim.trace is 'sessions'.

  if "smoke" in args:
    pretrain.smoke_model(c.model)
    c.model.max_seq_len = 8192  # The synthetic trace's longest request.
    c.sim.kv_budget_bytes = (6e6, 24e6, None)  # Budgets the smoke model's pages fill.
    c.sim.max_num_batched_tokens = 512  # Per-step token budget.
    c.sim.max_num_seqs = 32  # Cap on running requests.
    c.sim.check_invariants = True  # Verify pool and block tables after every step.
    c.synthetic.num_requests = 300  # Requests generated.
    c.synthetic.rate_per_s = 20.0  # Mean Poisson arrival rate.
    c.synthetic.num_sessions = 8  # Concurrent conversations.
    c.synthetic.system_prompt_tokens = 512  # Shared system prompt.
    c.synthetic.mean_turn_tokens = 300.0  # Mean new user tokens per turn.
    c.synthetic.mean_output_tokens = 40.0  # Mean generated tokens per turn.
    c.synthetic.max_prompt_tokens = 4096  # A conversation restarts beyond this.
  if len(args & set(MIXERS)) > 1 or {"sessions", "sessions_1k"} <= args:
    raise ValueError(f"config variants {sorted(args)}: at most one of mla, hybrid and one trace.")
  for name, (prelude, core, coda) in MIXERS.items():
    if name in args:
      c.model.prelude_mixers, c.model.core_mixers, c.model.coda_mixers = prelude, core, coda
      c.model.mla_kv_rank = 512  # MLA latent (DeepSeek-V2's, 4 x head_dim).
      c.model.mla_rope_dim = 64  # Decoupled RoPE key (DeepSeek-V2's, head_dim / 2).
  if "sessions" in args or "sessions_1k" in args:
    c.sim.trace = "sessions"  # Generated from c.sessions (looped/sim/sessions.py).
  if "sessions_1k" in args:  # Histories up to ~1,000 tokens, for a model of 1,024 positions.
    c.model.max_seq_len = 1024  # Longest prompt + output.
    c.sim.trace_block_size = 16  # Blocks as the generated trace's (for its written file).
    c.sessions.block_size = 16  # Tokens per hash_ids block.
    c.sessions.shared_system_tokens = 128  # Shared system prompt.
    c.sessions.max_context_tokens = 256  # A session's own first-turn context.
    c.sessions.min_input_tokens = 16  # New user tokens per turn.
    c.sessions.max_input_tokens = 128
    c.sessions.min_output_tokens = 16  # Generated tokens per turn.
    c.sessions.max_output_tokens = 96
    c.sessions.max_prompt_tokens = 1024  # A session ends before a turn that would not fit.
    c.sessions.session_rate_per_s = 2.0  # Mean session arrivals per second.
  return c
