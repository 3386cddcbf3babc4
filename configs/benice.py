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
decode on 32 rows, bf16 / fp8 / nvfp4 caches), and
at most one mixer: `gqa` (the default), `mla`, `kda` (every layer that mixer) or `hybrid` (KDA
and MLA 3:1 over the distinct layers: prelude KDA, core KDA + MLA, coda KDA; docs/mixers.md).

  python -m looped.main --config=configs/benice.py:smoke,kda --workdir=/tmp/benice_kda

Stage configs: pretraining reads seed/model/data/depth/train (fields and comments as in
configs/pretrain.py). Both post-training stages (standard finetune and BeNice!) read the same
with `post.depth` in place of `depth` and `post.train`'s fields in place of those of `train`,
so they share data order, steps, optimizer and schedule.
"""

import ml_collections

import configs
from configs import pretrain

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
  "gqa": "every layer grouped-query attention (the default)",
  "mla": "every layer multi-head latent attention (cached: latent + RoPE key)",
  "kda": "every layer Kimi delta attention (cached: a state per sequence)",
  "hybrid": "KDA everywhere but every second core layer MLA (3:1 KDA:MLA over the default depth)",
}


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  args = configs.parse_args(arg, VARIANTS)
  mixer = args & set(MIXERS)
  if len(mixer) > 1:
    raise ValueError(f"config variants name several mixers {sorted(mixer)}; pick one.")

  # seed, model, data, depth and train of stage 1, with `smoke`/`fixed` applied as there.
  c = pretrain.get_config(",".join(sorted(args - {"zero_shot", "composition"} - set(MIXERS))))
  if mixer:
    m = c.model
    m.prelude_mixers, m.core_mixers, m.coda_mixers = MIXERS[mixer.pop()]
  c.program = "benice"  # Which program main runs: the whole BeNice! pipeline.
  # Pretraining length: 300 steps keeps the main command within 12 minutes on 2 CPU cores; the
  # regimes the gap sweep and the recipe study measured (`fixed`, `zero_shot`) keep their 500.
  long = bool({"fixed", "zero_shot"} & args)
  c.train.num_steps = 500 if long else 300  # Pretraining steps (default: ~0.55 s/step, 2 cores).
  c.train.eval_every = c.train.num_steps // 2  # Pretraining steps between validation passes.
  c.train.checkpoint_every = c.train.num_steps // 2  # Pretraining steps between checkpoints.

  c.post = ml_collections.ConfigDict()  # Post-training: standard finetune and BeNice! alike.
  c.post.depth = ml_collections.ConfigDict()  # Replaces config.depth in post-training.
  c.post.depth.sampler = "fixed"  # 'fixed' (train at depth R, as evaluated), 'poisson', ...
  c.post.depth.poisson_mean = 2.0  # Mean of the truncated Poisson depth (sampler='poisson').
  c.post.depth.survival = 0.7  # Keep probability per recurrence (sampler='bernoulli').
  c.post.depth.backprop_recurrences = 0  # Only the last k active recurrences get gradient.
  c.post.train = ml_collections.ConfigDict()  # These fields replace config.train's.
  c.post.train.num_steps = 200  # Post-training steps (both arms).
  c.post.train.learning_rate = 1e-3  # Peak learning rate (both arms).
  c.post.train.warmup_steps = 20  # Linear warmup steps.
  c.post.train.log_every = 10  # Steps between metrics.jsonl records.
  c.post.train.eval_every = 100  # Steps between validation passes (unshared val_loss).
  c.post.train.checkpoint_every = 100  # Steps between checkpoints.

  c.benice = ml_collections.ConfigDict()  # The BeNice! objective (looped/benice/objectives.py).
  c.benice.read_recurrences = "all"  # Which recurrences read the broadcast K/V: 'all', 'first'
  # (the paper's wording) or 'none' (control: the shared pass is then the unshared forward).
  c.benice.shared_ce_weight = 1.0  # Weight of the CE of the shared pass.
  c.benice.unshared_ce_weight = 1.0  # Weight of the CE of the unshared pass.
  c.benice.kl_weight = 0.0  # Weight of KL(frozen pretrained model || student) (0: off).
  c.benice.kl_pass = "shared"  # Student pass the KL applies to: 'shared', 'unshared', 'both'.
  c.benice.residual_weight = 0.0  # Weight of shared-vs-unshared state matching (0: off).
  c.benice.kv_passes = 0  # Shared Jacobi passes (no gradient) before the broadcast K/V are
  # taken: 0 = the unshared pass's final K/V (the paper); n = trained pass is Jacobi pass n + 1.
  # 3 closed the fixed-depth gap where 0 did not (docs/results.md, ablation (c)), at +25% time.
  c.benice.kv_passes_ramp_steps = 0  # Curriculum: kv_passes grows 0 -> kv_passes over these
  # steps, each count an equal share (0: kv_passes from the first step).
  c.benice.distill_weight = 0.0  # Weight of KL(sg(unshared pass) || shared pass) (0: off).
  c.benice.shared_ramp_steps = 0  # Shared-pass weights ramp 0 -> value over these steps (0: off).

  c.eval = ml_collections.ConfigDict()  # Shareability evaluation of each model.
  c.eval.jacobi_passes = (1, 4)  # Jacobi shared-pass counts reported (one compilation for all).
  c.eval.decode_batches = 0  # First N eval batches also measured by exact decode (0: all).
  c.eval.decode_rows = 0  # Rows per exact-decode call (a multiple of the eval batch; 0: all).
  c.eval.kv_formats = ("bf16", "fp8", "mxfp8", "nvfp4")  # Cache formats also evaluated.
  c.eval.samples = 2  # Eval rows each model continues greedily in the report (0: none).
  c.eval.sample_prompt_tokens = 48  # Prompt: the first tokens of each of those rows.
  c.eval.sample_new_tokens = 48  # Greedy tokens generated, unshared and with the shared cache.

  c.pipeline = ml_collections.ConfigDict()  # Reuse of finished stages from other runs.
  c.pipeline.pretrain_workdir = ""  # Finished pretraining run to start from ('' = train one).
  c.pipeline.finetune_workdir = ""  # Finished standard-finetune run ('' = train one).
  c.pipeline.models = ("zero_shot", "finetune", "benice")  # Models trained and evaluated.

  if "smoke" in args:
    c.train.num_steps = 20
    c.train.eval_every = 20
    c.train.checkpoint_every = 20
    c.post.train.num_steps = 6
    c.post.train.warmup_steps = 2
    c.post.train.log_every = 2
    c.post.train.eval_every = 6
    c.post.train.checkpoint_every = 6
    c.eval.jacobi_passes = (1, 2)
    c.eval.decode_batches = 1
    c.eval.kv_formats = ("nvfp4",)
    c.eval.samples = 1
    c.eval.sample_prompt_tokens = 8
    c.eval.sample_new_tokens = 8
  if "fixed" in args:  # Chosen by experiments/gap_sweep.sh (docs/results.md, the gap sweep).
    c.model.injection = "linear"
    c.model.num_prelude_layers = 0
    c.model.num_coda_layers = 0
    c.benice.kv_passes = 3  # Recommended where there is a gap (docs/results.md, ablation (c)).
    # The 200-step recipe stays: no recipe of docs/benice_recipe.md meets all its targets yet.
  if "composition" in args:  # 4 mixers x 2 arms x 2 seeds (experiments/composition.sh).
    c.train.num_steps = 300
    c.train.eval_every = 150
    c.train.checkpoint_every = 150
    c.post.train.num_steps = 100
    c.post.train.warmup_steps = 10
    c.post.train.eval_every = 50
    c.post.train.checkpoint_every = 50
    c.eval.decode_batches = 2  # Exact decode on the first 32 rows; Jacobi passes on all 128.
    c.eval.kv_formats = ("bf16", "fp8", "nvfp4")
    c.eval.samples = 0
  if "zero_shot" in args:  # Pretraining and its zero-shot evaluation only (sweeps).
    c.pipeline.models = ("zero_shot",)
    c.eval.kv_formats = ()
  return c
