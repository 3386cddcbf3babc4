"""Stage 1: pretraining a looped LM with stochastic depth.

  python -m looped.main --config=configs/pretrain.py --workdir=/tmp/pretrain
  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/smoke

Args (comma-separated): `smoke` (tiny model, trains in seconds on a CPU), `fixed` (no
stochastic depth: every recurrence runs for every sequence), `ctx1024` (1024-token rows, the
default's tokens per step: a model to serve long multi-turn prompts), and at most one paper size:
`parcae_140m`, `parcae_370m` (Parcae's shapes) or `huginn_width` (Huginn-0125's), each with
2048- (Huginn: 4096-) token rows of a tokenised real corpus (see paper_size). Per-device memory
of a size on a mesh, without the devices or the corpus (docs/scaling.md):

  python -m looped.main --config=configs/pretrain.py:parcae_140m --workdir=/tmp/dry \
      --config.train.dry_run=True --config.mesh.dry_run_devices=64 --config.mesh.fsdp=-1 \
      --config.mesh.data=1
"""

import ml_collections

import configs
from looped import schema
from looped.data.config import DataConfig
from looped.model.config import ModelConfig
from looped.sharding import MeshConfig
from looped.train.config import DepthConfig, TrainConfig

VARIANTS = {
  "smoke": "tiny model, 60 steps, ~30 s on 2 CPU cores",
  "fixed": "no stochastic depth: every recurrence runs for every sequence",
  "ctx1024": "1024-token rows (serving workloads): 2 rows a step, the default's tokens per step",
  "parcae_140m": "Parcae-small's shape (d 768, P/B/C 2/2/2, R 8), 2048-token rows, C4 (TFDS)",
  "parcae_370m": "Parcae-medium's shape (d 1024, P/B/C 4/4/4, R 8), 2048-token rows, C4 (TFDS)",
  "huginn_width": "Huginn-0125's width and depth (d 5280, 55 heads, P/B/C 2/4/2, R 32), C4",
}
# At most one model size.
SIZES = ("parcae_140m", "parcae_370m", "huginn_width")


def model_config() -> ml_collections.ConfigDict:
  """The looped LM (docs/design.md §2). Shared by every program that needs a model's shape.

  Every field, its default, doc and range: looped/model/config.py (ModelConfig); `--help` lists
  them.
  """
  return schema.defaults(ModelConfig)


def smoke_model(m: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets `m` (a model_config()) to the tiny smoke model, in place, and returns it.

  The `:smoke` variant of every config uses it (pretrain, benice through pretrain, generate,
  serve_sim): the default depth (P/B/C = 1/2/1, R = 4) and bytes vocabulary at width 64, 2
  query heads and 1 KV head of 32, 64 positions.
  """
  default = model_config()
  for field in ("vocab_size", "num_prelude_layers", "num_core_layers", "num_coda_layers"):
    m[field] = default[field]  # The default vocabulary and depth.
  m.num_recurrences = default.num_recurrences  # The default R.
  m.d_model = 64  # Residual width.
  m.num_heads = 2  # Query heads.
  m.num_kv_heads = 1  # One KV head (GQA groups of 2).
  m.head_dim = 32  # Head width.
  m.mlp_dim = 128  # MLP hidden width (2 d_model).
  m.max_seq_len = 64  # The smoke rows' length.
  return m


def parcae_model(m: ml_collections.ConfigDict, size: str) -> ml_collections.ConfigDict:
  """Sets `m` to a Parcae shape, in place (sandyresearch/parcae, parcae_lm/configs/parcae/:
  parcae-small-140m.py and parcae-medium-370m.py; arXiv 2604.12946)."""
  wide = size == "parcae_370m"
  m.vocab_size = 32768  # Parcae's tokenizer (32768 ids).
  m.d_model = 1024 if wide else 768  # n_embd.
  m.num_heads = 8 if wide else 6  # num_attention_heads (head width 128).
  m.num_kv_heads = m.num_heads  # num_key_value_heads: plain multi-head attention.
  m.head_dim = 128  # n_embd / num_attention_heads.
  m.mlp_dim = 4 * m.d_model  # intermediate_size (4 x n_embd).
  m.mlp_type = "relu2"  # nonlin_name ReLU2 in a BaseMLP (no gate).
  layers = 4 if wide else 2  # n_layers_in_prelude / _recurrent_block / _coda, all equal.
  m.num_prelude_layers = layers  # Prelude layers.
  m.num_core_layers = layers  # Core (recurrent block) layers.
  m.num_coda_layers = layers  # Coda layers.
  # mean_recurrence = 8. Parcae's Poisson depth is unbounded above; here R caps it (and is the
  # evaluation depth), so the depth sampler's mean below is a truncated Poisson's.
  m.num_recurrences = 8
  m.injection = "diagonal"  # injection_type.
  m.state_init = "like_init"  # state_init 'like-init'.
  m.prelude_norm = True  # prelude_norm.
  m.qk_norm = True  # qk_norm.
  m.tie_embeddings = True  # tie_embeddings.
  m.max_seq_len = 2048  # block_size.
  return m


def huginn_model(m: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Sets `m` to Huginn-0125's shape, in place (its config.json, as looped/convert/huginn.py
  reads it: SandwichBlocks, linear adapter, embeddings scaled by sqrt(d))."""
  m.vocab_size = 65536  # padded_vocab_size.
  m.d_model = 5280  # n_embd.
  m.num_heads = 55  # num_attention_heads (head width 96).
  m.num_kv_heads = 55  # Multi-head attention.
  m.head_dim = 96  # n_embd / num_attention_heads.
  m.mlp_dim = 17920  # intermediate_size of the gated (SiLU) MLP.
  m.mlp_type = "swiglu"  # GatedMLP with SiLU.
  m.num_prelude_layers = 2  # n_layers_in_prelude.
  m.num_core_layers = 4  # n_layers_in_recurrent_block.
  m.num_coda_layers = 2  # n_layers_in_coda.
  m.num_recurrences = 32  # mean_recurrence.
  m.injection = "linear"  # The adapter over [h; e].
  m.block_norm = "post"  # SandwichBlock: a norm after each residual sum.
  m.core_out_norm = "final"  # ln_f on h_R before the coda too.
  m.embed_scale = 5280**0.5  # Embeddings times sqrt(n_embd).
  m.prelude_norm = False  # No norm on e.
  m.qk_norm = False  # No QK-norm ...
  m.qk_bias = True  # ... but a learned query/key bias.
  m.rope_base = 50000.0  # rope_base.
  m.tie_embeddings = True  # tie_embeddings.
  m.max_seq_len = 4096  # block_size.
  return m


def data_config() -> ml_collections.ConfigDict:
  """The corpus, tokenizer and batches: looped/data/config.py (DataConfig) holds every field."""
  return schema.defaults(DataConfig)


def mesh_config() -> ml_collections.ConfigDict:
  """The device mesh (docs/scaling.md): looped/sharding.py (MeshConfig) holds every field."""
  return schema.defaults(MeshConfig)


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
  c.model = model_config()  # looped/model/config.py (ModelConfig).
  c.data = data_config()  # looped/data/config.py (DataConfig).
  c.mesh = mesh_config()  # looped/sharding.py (MeshConfig).
  c.mesh_rules = mesh_rules()  # Logical -> mesh axes; see mesh_rules() for each rule.

  # Sections: every field, default, doc and range in its schema (see `--help`).
  c.depth = schema.defaults(DepthConfig)  # looped/train/config.py (DepthConfig).
  c.train = schema.defaults(TrainConfig)  # looped/train/config.py (TrainConfig).

  if "smoke" in args:
    smoke_model(c.model)
    c.data.seq_len = 64  # The smoke model's max_seq_len.
    c.data.batch_size = 8  # Rows per step.
    c.data.eval_batch_size = 8  # Rows per validation batch.
    c.data.num_eval_batches = 2  # A 16-row validation set.
    c.data.max_documents = 200  # A small corpus.
    c.train.num_steps = 60  # ~30 s on 2 CPU cores.
    c.train.warmup_steps = 10  # Linear warmup steps.
    c.train.log_every = 10  # Steps between progress lines.
    c.train.eval_every = 30  # Two validation passes.
    c.train.checkpoint_every = 30  # Two checkpoints.
  size = args & set(SIZES)
  if len(size) > 1:
    raise ValueError(f"config variants name several model sizes {sorted(size)}; pick one.")
  if size:
    paper_size(c, size.pop())
  if "fixed" in args:
    c.depth.sampler = "fixed"  # Every recurrence runs for every sequence.
  if "ctx1024" in args:  # A context long enough for multi-turn serving (docs/server.md).
    if args & set(SIZES) or "smoke" in args:
      raise ValueError("config variant ctx1024 is for the default model; drop smoke / the size.")
    c.model.max_seq_len = 1024  # Positions the model is trained on and serves.
    c.data.seq_len = 1024  # Tokens per training row.
    c.data.batch_size = 2  # Rows per step: 2,048 tokens, as the default's 16 x 128.
    c.data.eval_batch_size = 2  # Rows per validation batch.
    c.data.num_eval_batches = 8  # 16,384 validation tokens, as the default's.
  return c


def paper_size(c: ml_collections.ConfigDict, size: str) -> None:
  """A paper-size model, its depth regime, batches of its rows and a tokenised real corpus
  (C4 through TFDS, Parcae's 32768-id or Huginn's 65536-id Hugging Face tokenizer), in place.

  Before a real run, prepare the corpus (`tfds build c4/en` as array_record, or point
  data.tfds_name / tfds_data_dir at another prepared one) and set data.tokenizer_json to the
  tokenizer's tokenizer.json. `--config.train.dry_run=True` needs neither.
  """
  if size == "huginn_width":
    huginn_model(c.model)
    c.depth.poisson_mean = 32.0  # Huginn's mean recurrence (log-normal Poisson there).
    c.depth.backprop_recurrences = 8  # mean_backprop_depth.
    c.data.seq_len = 4096  # block_size.
  else:
    parcae_model(c.model, size)
    c.depth.poisson_mean = 8.0  # mean_recurrence (truncated at R = 8 here).
    c.depth.backprop_recurrences = 4  # mean_backprop_depth: gradient through the last 4.
    c.data.seq_len = 2048  # block_size.
  c.model.dtype = "bfloat16"  # Compute in bf16 (Parcae: bf16-mixed) ...
  c.model.param_dtype = "float32"  # ... over float32 params and AdamW moments.
  c.data.batch_size = 256  # Parcae's world_batch_size (rows of seq_len tokens).
  c.data.eval_batch_size = 64  # Validation rows per batch.
  c.data.num_eval_batches = 16  # Parcae's eval_iters.
  c.data.source = "tfds"  # A prepared TFDS dataset (array_record).
  c.data.tfds_name = "c4/en"  # English C4; any prepared TFDS text dataset works.
  c.data.tfds_train_split = "train"  # Training split.
  c.data.tfds_eval_split = "validation"  # Validation split.
  c.data.tfds_text_key = "text"  # The feature holding each document.
  c.data.segment_bytes = 0  # Web documents are short: whole documents.
  c.data.tokenizer = "huggingface"  # A tokenizer.json (Parcae's or Huginn's).
  c.data.tokenizer_json = ""  # Path to that tokenizer.json: set it for a real run.
  c.train.learning_rate = 3e-3  # Peak AdamW learning rate.
  c.train.warmup_steps = 1000  # Linear warmup steps.
  c.train.num_steps = 20000  # ~10.5B tokens at 256 x 2048 per step.
  c.train.log_every = 50  # Steps between progress lines.
  c.train.eval_every = 1000  # Steps between validation passes.
  c.train.checkpoint_every = 1000  # Steps between checkpoints.
