"""Serving simulation: prefix-cache hit rate, throughput and latency of a looped LM under KV
memory budgets, with and without KV-sharing (docs/design.md §5).

  python -m looped.main --config=configs/serve_sim.py --workdir=/tmp/sim
  python -m looped.main --config=configs/serve_sim.py --workdir=/tmp/sim \
      --config.sim.trace=mooncake_conversation \
      --config.sim.kv_budget_bytes='(2.4e10, 6.4e10, None)' --config.sim.kv_format=bf16,nvfp4
  python -m looped.main --config=configs/serve_sim.py:smoke --workdir=/tmp/sim_smoke

Args: `smoke` (tiny model, 300 synthetic requests, runs in seconds with invariant checks).

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

VARIANTS = {
  "smoke": "tiny model, 300 synthetic requests, seconds, with invariant checks",
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)

  c = ml_collections.ConfigDict()
  c.program = "serve_sim"  # Which program main runs.

  c.model = pretrain.model_config()  # Only the shape fields are read (shape.py).
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

  c.sim = ml_collections.ConfigDict()
  c.sim.trace = (
    ""  # Mooncake JSONL path or bundled alias ('mooncake_conversation'); '' = synthetic.
  )
  c.sim.time_scale = 1.0  # Arrival times are multiplied by this (0.5 = replay twice as fast).
  c.sim.max_requests = 0  # Replay only the first N requests (0 = all).
  c.sim.kv_budget_bytes = (24e9, 32e9, 48e9, 64e9, 96e9, 128e9)  # KV budgets (None = unbounded).
  c.sim.share_kv = (True, False)  # Layouts to compare: shared (final recurrence) / unshared.
  c.sim.kv_format = ("bf16",)  # KV formats: 'bf16', 'fp8', 'mxfp8', 'mxfp8_rceil', 'nvfp4'.
  c.sim.page_size = 16  # Tokens per KV page (vLLM's default block size).
  c.sim.max_num_batched_tokens = 8192  # Per-step token budget (decodes + prefill chunks).
  c.sim.max_num_seqs = 256  # Cap on running requests.
  # 'h200' (measured), 'h200_spec', 'h100', 'h100_spec', or 'cpu_2core' (prices looped/engine's
  # padded CPU step; there 'bf16' stands for the engine's raw pages, other formats for packed ones).
  c.sim.hardware = "h200"
  c.sim.hardware_json = ""  # JSON of measured values overriding the profile ('' = none).
  c.sim.weight_format = "bf16"  # Weight storage read each step: 'bf16', 'fp8', 'fp32'.
  c.sim.check_invariants = False  # Verify pool and block tables after every step (slow).

  c.synthetic = ml_collections.ConfigDict()  # Used when sim.trace is ''.
  c.synthetic.num_requests = 2000  # Requests generated.
  c.synthetic.rate_per_s = 2.0  # Mean Poisson arrival rate.
  c.synthetic.num_sessions = 64  # Concurrent multi-turn conversations.
  c.synthetic.system_prompt_tokens = 2048  # System prompt shared by every request.
  c.synthetic.mean_turn_tokens = 1500.0  # Mean new user tokens per turn (exponential).
  c.synthetic.mean_output_tokens = 300.0  # Mean generated tokens per turn (exponential).
  c.synthetic.max_prompt_tokens = 65536  # A conversation restarts beyond this prompt length.
  c.synthetic.seed = 0  # Seed of the synthetic trace.

  if "smoke" in args:
    pretrain.smoke_model(c.model)
    c.model.max_seq_len = 8192  # The synthetic trace's longest request.
    c.sim.kv_budget_bytes = (6e6, 24e6, None)
    c.sim.max_num_batched_tokens = 512
    c.sim.max_num_seqs = 32
    c.sim.check_invariants = True
    c.synthetic.num_requests = 300
    c.synthetic.rate_per_s = 20.0
    c.synthetic.num_sessions = 8
    c.synthetic.system_prompt_tokens = 512
    c.synthetic.mean_turn_tokens = 300.0
    c.synthetic.mean_output_tokens = 40.0
    c.synthetic.max_prompt_tokens = 4096
  return c
