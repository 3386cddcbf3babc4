"""The training sections: every field of `config.train` and `config.depth` declared once, with
its default, doc and range (looped.schema derives the config files' ConfigDicts, the range
checks and help). Post-training reads the same fields from `config.post.train` (a subset, over
config.train's) and `config.post.depth`."""

from __future__ import annotations

import dataclasses

from looped.model.depth import SAMPLERS
from looped.schema import field

OPT_STATE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """`config.train`: optimizer, schedule and the cadence of logs, evaluations and checkpoints."""

  num_steps: int = field(1500, "Optimizer steps.", min=1)
  learning_rate: float = field(3e-3, "Peak learning rate.", gt=0.0)
  warmup_steps: int = field(100, "Linear warmup steps.", min=0)
  min_lr_ratio: float = field(0.1, "Cosine decays to this fraction of the peak.", min=0.0, max=1.0)
  weight_decay: float = field(0.1, "AdamW decoupled weight decay (matrices only).", min=0.0)
  b1: float = field(0.9, "Adam beta1.", min=0.0, max=1.0)
  b2: float = field(0.95, "Adam beta2.", min=0.0, max=1.0)
  grad_clip: float = field(1.0, "Global-norm gradient clipping (0: off).", min=0.0)
  log_every: int = field(25, "Steps between progress lines / metrics.jsonl records.", min=1)
  eval_every: int = field(250, "Steps between validation passes (and at the end).", min=1)
  checkpoint_every: int = field(250, "Steps between checkpoints (and at the end).", min=1)
  keep_checkpoints: int = field(2, "Checkpoints kept in the workdir.", min=1)
  init_from: str = field(
    "", "Checkpoint or run directory to take params from at step 0 ('' = random)."
  )
  grad_accum_steps: int = field(
    1, "Microbatches per step (gradients summed; batch split k ways).", min=1
  )
  peak_tflops: float = field(
    0.0,
    "Peak TFLOP/s per device for MFU (0: the known bf16 peak of the device kind; on CPU the "
    "matmul throughput measured at start-up).",
    min=0.0,
  )
  profile_steps: int = field(
    0,
    "Steps traced by the JAX profiler into WORKDIR/profile for TensorBoard (0: off), as "
    "MaxText's profiler_steps.",
    min=0,
  )
  profile_skip_steps: int = field(
    1,
    "Steps of this run before the trace starts (1: skip the compiling step), as MaxText's "
    "skip_first_n_steps_for_profiler.",
    min=0,
  )
  opt_state_dtype: str = field(
    "float32",
    "Storage dtype of AdamW's moments ('bfloat16': half their bytes; updated in float32).",
    choices=OPT_STATE_DTYPES,
  )
  master_weights: bool = field(
    False,
    "With model.param_dtype 'bfloat16': a float32 copy of the params in the optimizer state, "
    "where updates accumulate (the params are its rounding).",
  )
  loss_vocab_chunk: int = field(
    0,
    "Next-token CE from the final hidden states in vocabulary chunks of this many ids, "
    "recomputed in the backward: no [tokens, vocab] logits in memory (0: full logits).",
    min=0,
  )
  dry_run: bool = field(
    False,
    "Print per-device memory (params, optimizer state, activations) on the mesh of "
    "mesh.dry_run_devices and exit: abstract shapes only, no step, no data read.",
  )


@dataclasses.dataclass(frozen=True)
class DepthConfig:
  """`config.depth`: the stochastic depth of training (looped/model/depth.py)."""

  sampler: str = field(
    "poisson", "Stochastic depth: 'poisson' (per sequence), 'bernoulli', 'fixed'.", choices=SAMPLERS
  )
  poisson_mean: float = field(
    2.0, "Mean of the truncated Poisson depth (clipped to [1, R]).", gt=0.0
  )
  survival: float = field(
    0.7, "Bernoulli: probability each recurrence is kept (>= 1 always kept).", gt=0.0, max=1.0
  )
  backprop_recurrences: int = field(
    0,
    "k: only the last k active recurrences get gradient (0: all); <= model.num_recurrences.",
    min=0,
  )
