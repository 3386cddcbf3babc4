"""The BeNice! pipeline (docs/design.md §4): pretrain -> standard finetune and BeNice! -> evaluate.

  python -m looped.main --config=configs/benice.py --workdir=/tmp/benice
  python -m looped.main --config=configs/benice.py:smoke,fixed --workdir=/tmp/benice_smoke
  python -m looped.main --config=configs/benice.py:fixed --workdir=/tmp/ablation \
      --config.pipeline.pretrain_workdir=/tmp/fixed/pretrain \
      --config.pipeline.finetune_workdir=/tmp/fixed/finetune --config.benice.read_recurrences=first

Args (comma-separated): `smoke` (tiny, runs in about a minute on a CPU, for tests), `fixed`
(the regime where sharing breaks, docs/results.md: fixed-depth pretraining of a
non-contracting loop, linear injection and no prelude/coda layers, so the core's attention does
all the sequence mixing; its BeNice! reads the K/V after 3 Jacobi passes),
`zero_shot` (pretraining and its zero-shot shareability evaluation only, no KV formats),
`composition` (the composition table's scale: 300 pretraining and 100 post-training steps, exact
decode on 32 rows, bf16 / fp8 / nvfp4 caches), `ctx1024` (1024-token rows, the models the
serving replay serves: docs/server.md), `gpu_pilot` (`fixed` at 65M parameters on the default
corpus, sized for one accelerator: the whole pipeline within 5 minutes on one H200,
docs/kernels.md; its per-device memory and step FLOPs: --config.train.dry_run=True), and
at most one mixer: `gqa` (the default), `mla`, `kda` (every layer that mixer) or `hybrid` (KDA
and MLA 3:1 over the distinct layers: prelude KDA, core KDA + MLA, coda KDA; docs/mixers.md).

  python -m looped.main --config=configs/benice.py:smoke,kda --workdir=/tmp/benice_kda

and at most one paper size, `parcae_140m`, `parcae_370m` or `huginn_width` (configs/pretrain.py
sets the model, depth, corpus and pretraining; post-training runs 2000 steps).

Stage configs: pretraining reads seed/model/data/depth/train (as configs/pretrain.py sets
them; each section's fields, docs and ranges are in its schema, listed by `--help`). Both
post-training stages (standard finetune and BeNice!) read the same with `post.depth` in place
of `depth` and `post.train`'s fields in place of those of `train`, so they share data order,
steps, optimizer and schedule.
"""

import ml_collections

import configs
from configs import pretrain
from looped import schema
from looped.benice.config import BeniceConfig, EvalConfig, PipelineConfig
from looped.train.config import DepthConfig

# Mixer per stage (prelude, core, coda) for each mixer arg; patterns repeat over the layers.
MIXERS = {
  "gqa": (("gqa",), ("gqa",), ("gqa",)),
  "mla": (("mla",), ("mla",), ("mla",)),
  "kda": (("kda",), ("kda",), ("kda",)),
  "hybrid": (("kda",), ("kda", "mla"), ("kda",)),
}

VARIANTS = {
  "smoke": "tiny, the whole pipeline in about a minute on a CPU (tests)",
  "fixed": "the regime where sharing breaks: fixed depth, linear injection, no prelude/coda",
  "zero_shot": "pretraining and its zero-shot shareability evaluation only",
  "composition": "the composition table's smaller scale (docs/mixers.md): 300 + 100 steps",
  "ctx1024": "1024-token rows (configs/pretrain.py); eval: exact decode on 2 rows, 3 formats",
  "gpu_pilot": "`fixed` at 65M params, bf16 compute, 256-token rows: the pipeline on one H200",
  "gqa": "every layer grouped-query attention (the default)",
  "mla": "every layer multi-head latent attention (cached: latent + RoPE key)",
  "kda": "every layer Kimi delta attention (cached: a state per sequence)",
  "hybrid": "KDA everywhere but every second core layer MLA (3:1 KDA:MLA over the default depth)",
  "parcae_140m": "configs/pretrain.py's Parcae-small shape and corpus; 2000 post-training steps",
  "parcae_370m": "configs/pretrain.py's Parcae-medium shape and corpus; 2000 post-training steps",
  "huginn_width": "configs/pretrain.py's Huginn-0125 shape and corpus; 2000 post-training steps",
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = _with_pilot(configs.parse_args(arg, VARIANTS))
  mixer = args & set(MIXERS)
  if len(mixer) > 1:
    raise ValueError(f"config variants name several mixers {sorted(mixer)}; pick one.")

  # seed, model, data, depth and train of stage 1, with `smoke`/`fixed` applied as there.
  own = {"zero_shot", "composition", "gpu_pilot"} | set(MIXERS)  # Not configs/pretrain.py's.
  c = pretrain.get_config(",".join(sorted(args - own)))
  if mixer:  # The mixer of every stage's layers (patterns repeat over the layers).
    m = c.model
    m.prelude_mixers, m.core_mixers, m.coda_mixers = MIXERS[mixer.pop()]
  c.program = "benice"  # Which program main runs: the whole BeNice! pipeline.
  # Pretraining length: 300 steps keeps the main command within 12 minutes on 2 CPU cores; the
  # regimes the gap sweep and the recipe study measured (`fixed`, `zero_shot`) keep their 500.
  long = bool({"fixed", "zero_shot"} & args)
  paper_size = bool(set(pretrain.SIZES) & args)  # Pretraining as configs/pretrain.py sets it.
  if not paper_size:
    c.train.num_steps = 500 if long else 300  # Pretraining steps (~0.55 s/step, 2 cores).
    c.train.eval_every = c.train.num_steps // 2  # Pretraining steps between validation passes.
    c.train.checkpoint_every = c.train.num_steps // 2  # Pretraining steps between checkpoints.

  # Sections: every field, default, doc and range in its schema (see `--help`).
  c.post = ml_collections.ConfigDict()  # Post-training: standard finetune and BeNice! alike.
  # Replaces config.depth in post-training: looped/train/config.py (DepthConfig).
  c.post.depth = schema.defaults(DepthConfig)
  c.post.depth.sampler = "fixed"  # Train at depth R, as evaluated.
  # These fields replace config.train's (looped/train/config.py, TrainConfig) in post-training.
  c.post.train = ml_collections.ConfigDict()
  c.post.train.num_steps = 200  # Post-training steps (both arms).
  c.post.train.learning_rate = 1e-3  # Peak learning rate (both arms).
  c.post.train.warmup_steps = 20  # Linear warmup steps.
  c.post.train.log_every = 10  # Steps between metrics.jsonl records.
  c.post.train.eval_every = 100  # Steps between validation passes (unshared val_loss).
  c.post.train.checkpoint_every = 100  # Steps between checkpoints.

  c.benice = schema.defaults(BeniceConfig)  # The objective: looped/benice/config.py.
  c.eval = schema.defaults(EvalConfig)  # Shareability evaluation: looped/benice/config.py.
  c.pipeline = schema.defaults(PipelineConfig)  # Reuse of finished stages: the same file.

  if paper_size:  # Post-training at scale: ~1B tokens of 256 x 2048 per step.
    c.post.train.num_steps = 2000  # Post-training steps (both arms).
    c.post.train.warmup_steps = 100  # Linear warmup steps.
    c.post.train.log_every = 50  # Steps between metrics records.
    c.post.train.eval_every = 500  # Steps between validation passes.
    c.post.train.checkpoint_every = 500  # Steps between checkpoints.
    c.eval.decode_batches = 1  # Exact (sequential) shared decode on the first eval batch only.
  if "smoke" in args:
    c.train.num_steps = 20  # Pretraining steps.
    c.train.eval_every = 20  # One validation pass, at the end.
    c.train.checkpoint_every = 20  # One checkpoint, at the end.
    c.post.train.num_steps = 6  # Post-training steps.
    c.post.train.warmup_steps = 2  # Linear warmup steps.
    c.post.train.log_every = 2  # Steps between metrics records.
    c.post.train.eval_every = 6  # One validation pass, at the end.
    c.post.train.checkpoint_every = 6  # One checkpoint, at the end.
    c.eval.jacobi_passes = (1, 2)  # Jacobi shared-pass counts reported.
    c.eval.decode_batches = 1  # Exact decode on the first eval batch.
    c.eval.kv_formats = ("nvfp4",)  # One cache format.
    c.eval.prefill_blocks = (16,)  # One block prefill size (4 blocks of the 64-token rows).
    c.eval.samples = 1  # One sample row in the report.
    c.eval.sample_prompt_tokens = 8  # Short prompts.
    c.eval.sample_new_tokens = 8  # Short continuations.
  if "fixed" in args:  # Chosen by experiments/gap_sweep.sh (docs/results.md, the gap sweep).
    c.model.injection = "linear"  # A non-contracting loop.
    c.model.num_prelude_layers = 0  # No prelude: the core's attention does all the mixing.
    c.model.num_coda_layers = 0  # No coda, likewise.
    c.benice.kv_passes = 3  # Recommended where there is a gap (docs/results.md, ablation (c)).
    # The 200-step recipe stays: no recipe of docs/benice_recipe.md meets all its targets yet.
  if "composition" in args:  # 4 mixers x 2 arms x 2 seeds (experiments/composition.sh).
    c.train.num_steps = 300  # Pretraining steps.
    c.train.eval_every = 150  # Pretraining validation passes.
    c.train.checkpoint_every = 150  # Pretraining checkpoints.
    c.post.train.num_steps = 100  # Post-training steps.
    c.post.train.warmup_steps = 10  # Linear warmup steps.
    c.post.train.eval_every = 50  # Post-training validation passes.
    c.post.train.checkpoint_every = 50  # Post-training checkpoints.
    c.eval.decode_batches = 2  # Exact decode on the first 32 rows; Jacobi passes on all 128.
    c.eval.kv_formats = ("bf16", "fp8", "nvfp4")  # Three cache formats.
    c.eval.samples = 0  # No sample rows.
  if "ctx1024" in args:  # Models to serve at a 1024-token context (docs/server.md).
    c.eval.decode_batches = 1  # Exact decode on the first eval batch: 2 rows of 1024 tokens.
    c.eval.kv_formats = ("bf16", "fp8", "nvfp4")  # The formats the serving replay pages in.
    c.eval.prefill_blocks = (16, 32, 64, 256)  # Block sizes, the engine's default 32 among them.
  if "gpu_pilot" in args:  # `fixed` at 142x the CPU study's 0.46M params (docs/kernels.md).
    gpu_pilot(c)
  if "zero_shot" in args:  # Pretraining and its zero-shot evaluation only (sweeps).
    c.pipeline.models = ("zero_shot",)  # Only the pretrained model.
    c.eval.kv_formats = ()  # No cache formats.
  return c


def _with_pilot(args: set[str]) -> set[str]:
  """`gpu_pilot` is the `fixed` regime at its own size: no other size variant beside it."""
  if "gpu_pilot" not in args:
    return args
  if args & ({"smoke", "ctx1024", "composition"} | set(pretrain.SIZES)):
    raise ValueError("config variant gpu_pilot sets its own size; drop the other size variants.")
  return args | {"fixed"}


def gpu_pilot(c: ml_collections.ConfigDict) -> None:
  """The `fixed` config at 65M parameters, in place: the same corpus (the interpreter's own
  sources, bytes), regime and step counts as the CPU recipe study (0.46M params), a 142x
  larger model on 4x the tokens per step. Sized (docs/kernels.md) so pretraining, both
  post-training arms and the evaluation finish within 5 minutes on one H200, most of it
  compiling."""
  m = c.model
  m.d_model = 1024  # Residual width (the study's: 128).
  m.num_heads = 8  # Query heads of 128: the flash kernel's tiles on GPU and TPU.
  m.num_kv_heads = 4  # GQA groups of 2, as the default's 4 / 2.
  m.head_dim = 128  # Head width.
  m.mlp_dim = 4096  # SwiGLU hidden width (4 d_model).
  m.num_core_layers = 4  # Core layers, 15.7M params each (the study's: 2; no prelude/coda).
  m.max_seq_len = 256  # The rows' length.
  m.dtype = "bfloat16"  # Compute dtype (params, moments and the loss stay float32).
  m.scan_unroll = 1  # The core compiled once, not R times: compiling is most of 5 minutes.
  c.data.seq_len = 256  # Tokens per row (the study's: 128).
  c.data.batch_size = 32  # Rows per step: 8,192 tokens (the study's: 2,048).
  c.data.eval_batch_size = 32  # Rows per validation batch.
  c.data.num_eval_batches = 4  # 128 validation rows, as the study's 128.
  c.train.learning_rate = 1e-3  # Peak pretraining lr (3e-3 is the tiny models').
  c.post.train.learning_rate = 3e-4  # Peak post-training lr: the study's ratio to pretraining.
  c.eval.decode_batches = 1  # Exact shared decode on the first 32 rows (256 sequential steps).
  c.eval.kv_formats = ("bf16",)  # One cache format beside the raw cache.
  c.eval.prefill_blocks = ()  # No block-prefill sizes.
  c.eval.samples = 0  # No sample rows.
