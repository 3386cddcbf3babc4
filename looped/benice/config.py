"""The BeNice! pipeline's sections: every field of `config.benice`, `config.eval` and
`config.pipeline` declared once, with its default, doc and range (looped.schema derives
configs/benice.py's ConfigDicts, the range checks and help; looped/benice/pipeline.py checks
the rules relating fields). Post-training's `post.depth` and `post.train` follow the training
schemas (looped/train/config.py)."""

from __future__ import annotations

import dataclasses

from looped import kv_quant
from looped.model import adaptive
from looped.schema import field

READ_MODES = ("all", "first", "none")  # Which earlier tokens' cached K/V a shared pass reads.
KL_PASSES = ("shared", "unshared", "both")  # Student passes the KL applies to.
MODEL_NAMES = ("zero_shot", "finetune", "benice")  # Models the pipeline can train and evaluate.


@dataclasses.dataclass(frozen=True)
class BeniceConfig:
  """`config.benice`: the BeNice! objective (looped/benice/objectives.py)."""

  read_recurrences: str = field(
    "all",
    "Which recurrences read the broadcast K/V: 'all', 'first' (the paper's wording) or 'none' "
    "(control: the shared pass is then the unshared forward).",
    choices=READ_MODES,
  )
  shared_ce_weight: float = field(1.0, "Weight of the CE of the shared pass.", min=0.0)
  unshared_ce_weight: float = field(1.0, "Weight of the CE of the unshared pass.", min=0.0)
  kl_weight: float = field(
    0.0, "Weight of KL(frozen pretrained model || student) (0: off).", min=0.0
  )
  kl_pass: str = field("shared", "Student pass the KL applies to.", choices=KL_PASSES)
  residual_weight: float = field(
    0.0, "Weight of shared-vs-unshared state matching (0: off).", min=0.0
  )
  kv_passes: int = field(
    0,
    "Shared Jacobi passes (no gradient) before the broadcast K/V are taken: 0 = the unshared "
    "pass's final K/V (the paper); n = trained pass is Jacobi pass n + 1 (3 closed the "
    "fixed-depth gap where 0 did not, docs/results.md ablation (c), at +25% time).",
    min=0,
  )
  kv_passes_ramp_steps: int = field(
    0,
    "Curriculum: kv_passes grows 0 -> kv_passes over these steps, each count an equal share "
    "(0: kv_passes from the first step); <= post.train.num_steps, needs kv_passes > 0.",
    min=0,
  )
  prefill_block: int = field(
    0,
    "The shared pass and its kv_passes read as block prefill with blocks of C tokens "
    "(docs/design.md §3): shared K/V before a token's block, its own recurrence's inside (0: "
    "token-level sharing, exact decode's reads); needs model.attention_impl 'xla' or 'auto', "
    "no KDA core.",
    min=0,
  )
  distill_weight: float = field(
    0.0, "Weight of KL(sg(unshared pass) || shared pass) (0: off).", min=0.0
  )
  shared_ramp_steps: int = field(
    0,
    "Shared-pass weights ramp 0 -> value over these steps (0: off); <= post.train.num_steps.",
    min=0,
  )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """`config.eval`: the shareability evaluation of each model."""

  jacobi_passes: tuple[int, ...] = field(
    (1, 4),
    "Jacobi shared-pass counts reported (one compilation for all).",
    by_hand="a non-empty tuple of integers >= 1",
  )
  prefill_blocks: tuple[int, ...] = field(
    (16, 64, 256),
    "Block prefill sizes C measured on the exact-decode rows, each gap vs unshared with its 95% "
    "CI (C = 1 is exact shared decode, already gap_exact; C >= data.seq_len is the unshared "
    "forward; (): none).",
    by_hand="a tuple of integers >= 1 (may be empty)",
  )
  kv_policy: str = field(
    "final",
    "KV-sharing policy of every shared metric (exact decode, Jacobi, block prefill, KV formats, "
    "samples): which cached recurrence c(r) recurrence r reads for earlier tokens "
    "(docs/design.md §3).",
    by_hand="a policy of looped/model/kv_policy.py for model.num_recurrences, e.g. 'final', "
    "'first', 'full', 'keep_first2', 'keep_last2', 'stride2', 'boundaries:2-4', 'huginn_mod2', "
    "'huginn_anchor8'",
  )
  kv_policies: tuple[str, ...] = field(
    (),
    "Further KV-sharing policies each measured by exact decode on the exact-decode rows: gap vs "
    "unshared with its 95% CI and KV bytes per token beside it (): none.",
    by_hand="a tuple of policies (as eval.kv_policy; may be empty)",
  )
  decode_batches: int = field(
    0,
    "First N eval batches also measured by exact decode (0: all); <= data.num_eval_batches.",
    min=0,
  )
  decode_rows: int = field(
    0, "Rows per exact-decode call (a multiple of the eval batch; 0: all).", min=0
  )
  kv_formats: tuple[str, ...] = field(
    ("bf16", "fp8", "mxfp8", "nvfp4"),
    "Cache formats also evaluated.",
    by_hand=f"a tuple of formats from {kv_quant.FORMATS}",
  )
  samples: int = field(2, "Eval rows each model continues greedily in the report (0: none).", min=0)
  sample_prompt_tokens: int = field(
    48, "Prompt: the first tokens of each of those rows; <= data.seq_len.", min=1
  )
  sample_new_tokens: int = field(
    48, "Greedy tokens generated, unshared and with the shared cache.", min=1
  )
  # Test-time depth (docs/design.md §3, "Depth at test time").
  recurrences: int = field(
    0, "Recurrences every metric runs at (0: the model's R; above R loops further).", min=0
  )
  exit_criterion: str = field(
    "none",
    "Per-token exit measured by exact decode on the exact-decode rows, shared and unshared: "
    "ppl and mean recurrences per token with 95% CIs ('none': not measured).",
    choices=adaptive.CRITERIA,
  )
  exit_threshold: float | None = field(
    None, "The exit criterion's threshold (None: its default).", min=0.0
  )
  min_recurrences: int = field(0, "No exit before this many recurrences.", min=0)
  exit_every: int = field(1, "Check the exit criterion every this many recurrences.", min=1)
  continuous_compute: bool = field(
    False, "With an exit criterion: each token starts from the previous token's final state."
  )
  exit_lookup: str = field(
    adaptive.DEFAULT_LOOKUP,
    "Unshared exact decode with exits: what later recurrences read of an exited token.",
    choices=adaptive.LOOKUPS,
  )


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """`config.pipeline`: reuse of finished stages from other runs, and the models trained."""

  pretrain_workdir: str = field("", "Finished pretraining run to start from ('' = train one).")
  finetune_workdir: str = field("", "Finished standard-finetune run ('' = train one).")
  models: tuple[str, ...] = field(
    MODEL_NAMES,
    "Models trained and evaluated.",
    by_hand=f"a non-empty tuple of distinct names from {MODEL_NAMES}",
  )
