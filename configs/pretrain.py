"""Stage 1: pretraining a looped LM with stochastic depth.

  python -m looped.main --config=configs/pretrain.py --workdir=/tmp/pretrain
  python -m looped.main --config=configs/pretrain.py:smoke --workdir=/tmp/smoke

Args (comma-separated): `smoke` (tiny model, trains in seconds on a CPU), `fixed` (no
stochastic depth: every recurrence runs for every sequence).
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
}


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
  if "fixed" in args:
    c.depth.sampler = "fixed"  # Every recurrence runs for every sequence.
  return c
