"""Stage 1: pretraining a looped LM with stochastic depth.

  python -m looped.main --config=configs/pretrain.py --workdir=/tmp/pretrain
  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/smoke

Args (comma-separated): `smoke` (tiny model, trains in seconds on a CPU), `fixed` (no
stochastic depth: every recurrence runs for every sequence).
"""

import ml_collections

import configs

VARIANTS = {
  "smoke": "tiny model, 60 steps, ~30 s on 2 CPU cores",
  "fixed": "no stochastic depth: every recurrence runs for every sequence",
}


def model_config() -> ml_collections.ConfigDict:
  """The looped LM (docs/design.md §2). Shared by every program that needs a model's shape."""
  m = ml_collections.ConfigDict()
  m.vocab_size = 257  # Embedding rows; >= the tokenizer's vocabulary (bytes: 256 + EOS).
  m.d_model = 128  # Residual stream width.
  m.num_heads = 4  # Query heads per attention layer.
  m.num_kv_heads = 2  # Key/value heads (GQA); divides num_heads.
  m.head_dim = 32  # Width of one attention head.
  m.mlp_dim = 384  # Hidden width of the MLP.
  m.mlp_type = "swiglu"  # MLP kind: 'swiglu' or 'relu2'.
  m.num_prelude_layers = 1  # P: layers before the loop (run once, ordinary KV-cache).
  m.num_core_layers = 2  # B: layers of the looped core block (one set of weights).
  m.num_coda_layers = 1  # C: layers after the loop (run once, ordinary KV-cache).
  m.num_recurrences = 4  # R: core-block recurrences at evaluation (and the training maximum).
  m.injection = "diagonal"  # How e enters each recurrence: 'diagonal', 'linear', 'additive',
  # 'none' (h alone: a stack looped as a whole, as Ouro).
  m.diagonal_decay_init = 0.5  # injection='diagonal': per-channel decay of h at init, in (0, 1).
  m.state_init = "like_init"  # h_0: 'like_init' (scaled noise), 'zeros', 'embed' (h_0 = e).
  m.state_init_std = 0.02  # Std of h_0 noise for state_init='like_init'.
  m.prelude_norm = True  # RMSNorm on the prelude output e before injection.
  m.qk_norm = True  # RMSNorm on queries and keys per head.
  m.rope_base = 10000.0  # RoPE base frequency.
  m.tie_embeddings = True  # LM head reuses the embedding matrix.
  m.max_seq_len = 512  # Longest sequence (positions) the model is used with.
  m.init_std = 0.02  # Std of weight initialisation (output projections scaled by depth).
  m.dtype = "float32"  # Compute dtype: 'float32' or 'bfloat16'.
  m.param_dtype = "float32"  # Parameter storage dtype: 'float32' or 'bfloat16'.
  m.scan_recurrences = True  # Loop the core with lax.scan (False: Python-unrolled, same math).
  m.scan_unroll = 0  # Recurrences per scan iteration, unrolled by XLA (0: all R, the speed of
  # the unrolled loop; 1: compile time constant in R; same math).
  m.remat = "none"  # Per-recurrence remat: 'none', 'full', 'dots_saveable', ... (saves memory).
  m.attention_impl = "xla"  # 'xla' (einsum) or 'pallas' (pallas_kernels; interpreted on CPU).
  m.prelude_mixers = ("gqa",)  # Sequence mixer per prelude layer, repeated: 'gqa', 'mla', 'kda'.
  m.core_mixers = ("gqa",)  # Per core layer, repeated, e.g. ('kda', 'kda', 'kda', 'mla').
  m.coda_mixers = ("gqa",)  # Per coda layer, repeated.
  m.mla_kv_rank = 64  # MLA: latent c_kv width (cached per token with the RoPE key).
  m.mla_q_rank = 0  # MLA: low-rank query width (0 = full-rank query projection).
  m.mla_rope_dim = 32  # MLA: decoupled RoPE key/query width (even; shared by the heads).
  m.kda_conv_size = 4  # KDA: short causal conv width on q, k, v.
  m.kda_chunk_size = 16  # KDA: chunk length of the chunkwise-parallel (training) form (16: 3x
  # faster training steps than 64 on CPU, same math; docs/mixers.md).
  m.block_norm = "pre"  # Layer norms: 'pre', 'sandwich' (x + n(f(n(x))), Ouro), 'post' (Huginn).
  m.qk_bias = False  # GQA: a learned per-head bias on queries and keys before RoPE (Huginn).
  m.embed_scale = 1.0  # Token embeddings are multiplied by this (Huginn: sqrt(d_model)).
  m.core_out_norm = "none"  # 'final': the final norm also on h_R before the coda (Huginn);
  # 'every': a norm ends every recurrence and is the final norm (Ouro; no coda).
  m.exit_gate = False  # A per-recurrence exit logit w.h_r + b (Ouro's early-exit gate), in aux.
  return m


def smoke_model(m: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets `m` (a model_config()) to the tiny smoke model, in place, and returns it.

  The `:smoke` variant of every config uses it (pretrain, benice through pretrain, generate,
  serve_sim): the default depth (P/B/C = 1/2/1, R = 4) and bytes vocabulary at width 64, 2
  query heads and 1 KV head of 32, 64 positions.
  """
  default = model_config()
  for field in ("vocab_size", "num_prelude_layers", "num_core_layers", "num_coda_layers"):
    m[field] = default[field]
  m.num_recurrences = default.num_recurrences
  m.d_model = 64
  m.num_heads = 2
  m.num_kv_heads = 1
  m.head_dim = 32
  m.mlp_dim = 128
  m.max_seq_len = 64
  return m


def data_config() -> ml_collections.ConfigDict:
  d = ml_collections.ConfigDict()
  d.source = "stdlib"  # 'stdlib' (interpreter's own .py sources), 'text' (glob) or 'tfds'.
  d.text_glob = ""  # Files for source='text', e.g. '/data/*.txt'.
  d.tfds_name = ""  # TFDS dataset for source='tfds', prepared as array_record.
  d.tfds_data_dir = ""  # TFDS data_dir ('' = TFDS default).
  d.tfds_train_split = "train"  # TFDS split for training.
  d.tfds_eval_split = "validation"  # TFDS split for evaluation.
  d.tfds_text_key = "text"  # Feature holding the document text.
  d.tokenizer = "bytes"  # 'bytes' (UTF-8 bytes + EOS), 'sentencepiece' or 'huggingface'.
  d.spm_path = ""  # SentencePiece model file for tokenizer='sentencepiece'.
  d.tokenizer_json = ""  # Hugging Face tokenizer.json for tokenizer='huggingface'.
  d.val_fraction = 0.05  # Fraction of documents (files) held out for validation.
  d.segment_bytes = 4096  # Files longer than this are split train/val in segments (0: whole).
  d.max_documents = 0  # Use only the first N documents after the split hash (0 = all).
  d.seq_len = 128  # Tokens per training row.
  d.batch_size = 16  # Global batch size (rows per step, split across processes).
  d.eval_batch_size = 16  # Global batch size for validation.
  d.num_eval_batches = 8  # Validation batches per evaluation (fixed, deterministic set).
  d.shuffle = True  # Shuffle training rows (seeded by config.seed).
  d.worker_count = 0  # Grain worker processes (0 = in the main process).
  return d


def mesh_config() -> ml_collections.ConfigDict:
  """The device mesh (docs/scaling.md): sizes multiply to the device count."""
  m = ml_collections.ConfigDict()
  m.data = -1  # Data parallel: batch split, params replicated (-1: the devices left over).
  m.fsdp = 1  # Fully sharded data parallel: batch split, params and Adam moments sharded.
  m.tensor = 1  # Tensor parallel: heads, KV heads, MLP width and vocabulary split.
  m.cpu_devices = 0  # CPU backend of `python -m looped.main`: devices the host is split into
  # (0: one per core, as many as mesh and batch divide; 1: one multi-threaded device).
  return m


def mesh_rules() -> tuple:
  """Logical axis -> mesh axes (looped.sharding): in order; a mesh axis is used once per array."""
  return (
    ("batch", ("data", "fsdp")),  # Rows of a batch (activations, decode caches).
    ("embed", "fsdp"),  # Residual width of weights: the FSDP shard (activations: whole).
    ("heads", "tensor"),  # Query heads.
    ("kv_heads", "tensor"),  # Key/value heads (replicated when fewer than the tensor shards).
    ("mlp", "tensor"),  # MLP hidden width.
    ("vocab", "tensor"),  # Embedding rows / logits (replicated when not divisible).
    ("length", None),  # Sequence positions: whole.
    ("head_dim", None),  # Width of one head: whole.
  )


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)

  c = ml_collections.ConfigDict()
  c.program = "train"  # Which program main runs: 'train'.
  c.seed = 0  # Seed for parameters, data order and stochastic depth.
  c.model = model_config()
  c.data = data_config()
  c.mesh = mesh_config()
  c.mesh_rules = mesh_rules()  # Logical -> mesh axes; see mesh_rules() for each rule.

  c.depth = ml_collections.ConfigDict()
  c.depth.sampler = "poisson"  # Stochastic depth: 'poisson' (per sequence), 'bernoulli', 'fixed'.
  c.depth.poisson_mean = 2.0  # Mean of the truncated Poisson depth (clipped to [1, R]).
  c.depth.survival = 0.7  # Bernoulli: probability each recurrence is kept (>= 1 always kept).
  c.depth.backprop_recurrences = 0  # k: only the last k active recurrences get gradient (0: all).

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 1500  # Optimizer steps.
  c.train.learning_rate = 3e-3  # Peak learning rate.
  c.train.warmup_steps = 100  # Linear warmup steps.
  c.train.min_lr_ratio = 0.1  # Cosine decays to this fraction of the peak.
  c.train.weight_decay = 0.1  # AdamW decoupled weight decay (matrices only).
  c.train.b1 = 0.9  # Adam beta1.
  c.train.b2 = 0.95  # Adam beta2.
  c.train.grad_clip = 1.0  # Global-norm gradient clipping (0: off).
  c.train.log_every = 25  # Steps between progress lines / metrics.jsonl records.
  c.train.eval_every = 250  # Steps between validation passes (and at the end).
  c.train.checkpoint_every = 250  # Steps between checkpoints (and at the end).
  c.train.keep_checkpoints = 2  # Checkpoints kept in the workdir.
  c.train.init_from = ""  # Checkpoint directory to take params from at step 0 ('' = random).
  c.train.grad_accum_steps = 1  # Microbatches per step (gradients summed; batch split k ways).

  if "smoke" in args:
    smoke_model(c.model)
    c.data.seq_len = 64
    c.data.batch_size = 8
    c.data.eval_batch_size = 8
    c.data.num_eval_batches = 2
    c.data.max_documents = 200
    c.train.num_steps = 60
    c.train.warmup_steps = 10
    c.train.log_every = 10
    c.train.eval_every = 30
    c.train.checkpoint_every = 30
  if "fixed" in args:
    c.depth.sampler = "fixed"
  return c
