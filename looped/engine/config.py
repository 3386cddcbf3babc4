"""The generation section: every field of `config.gen` declared once, with its default, doc and
range (looped.schema derives configs/generate.py's ConfigDict, the range checks and help;
looped/engine/generate.py checks the rules relating fields, the prompts and the model)."""

from __future__ import annotations

import dataclasses

from looped import kv_quant
from looped.engine import speculative
from looped.model import adaptive
from looped.schema import field

KV_FORMATS = ("",) + kv_quant.FORMATS  # '' : raw pages in the compute dtype.
# gen.kv_policy and serve.kv_policy.
KV_POLICY_DOC = (
  "With share_kv: which cached recurrence c(r) recurrence r reads for earlier tokens; the "
  "pages keep the policy's cached recurrences (docs/design.md §3)."
)
KV_POLICY_VALUES = (
  "a policy of looped/model/kv_policy.py for model.num_recurrences, e.g. 'final', "
  "'first', 'stride2', 'keep_last2', 'huginn_mod2'"
)
# EngineConfig.attention_impl, gen.attention_impl and serve.attention_impl.
ATTENTION_IMPLS = ("auto", "xla", "pallas")
ATTENTION_IMPL_DOC = (
  "How GQA layers read the KV pages: 'pallas' (pallas_kernels.paged_decode through page "
  "tables), 'xla' (a dense gather), 'auto' (the kernel on TPU, and GPU with power-of-two "
  "page_size >= 16 and head_dim, on one device; else XLA)."
)
# gen.prefill_block and serve.prefill_block: why the default is 32.
PREFILL_BLOCK_DOC = (
  "Prefill block (docs/design.md §3): prompt tokens per call, 1 = exact shared decode; <= "
  "max_num_batched_tokens. 32: 64 filled whole steps and lost hits on shorter prefixes, 16 "
  "costs more quality (docs/results.md: 'Generation engine: throughput', 'Block prefill')."
)


_BUCKETS = "a tuple of positive integers (empty: powers of two)"


@dataclasses.dataclass(frozen=True)
class BatchingLimits:
  """The scheduler's limits, which the engine and the simulator share (SimConfig extends this
  class with its own defaults, schema.redefault)."""

  page_size: int = field(16, "Tokens per KV page (prefix-cache granularity).", min=1)
  max_num_batched_tokens: int = field(
    64, "Per-step token budget (decodes + prefill chunks).", min=1
  )
  max_num_seqs: int = field(8, "Cap on requests running at once.", min=1)


@dataclasses.dataclass(frozen=True)
class EngineSection(BatchingLimits):
  """The paged engine's settings, declared once: `config.gen` and `config.serve` take them as
  their own fields (GenConfig and ServeConfig extend this class, so the flags keep their names,
  e.g. --config.serve.page_size); looped.engine.checks.engine_config turns them into an Engine's
  EngineConfig."""

  share_kv: bool = field(True, "KV-sharing: cache only the final recurrence's K/V of core layers.")
  kv_policy: str = field("final", KV_POLICY_DOC, by_hand=KV_POLICY_VALUES)
  kv_format: str = field(
    "", "Page storage: '' (raw, compute dtype) or a packed format.", choices=KV_FORMATS
  )
  kv_budget_bytes: float | None = field(
    64e6,
    "KV page pool in bytes; must hold the longest request (None, generation only: room for "
    "every prompt at once).",
    by_hand="a positive number of bytes (or None for generation)",
  )
  prefill_block: int = field(32, PREFILL_BLOCK_DOC, min=1)
  attention_impl: str = field("auto", ATTENTION_IMPL_DOC, choices=ATTENTION_IMPLS)
  row_buckets: tuple[int, ...] = field(
    (), "Padded batch rows, one compilation each; reaches max_num_seqs.", by_hand=_BUCKETS
  )
  token_buckets: tuple[int, ...] = field(
    (), "Padded chunk lengths; reach min(prefill_block, max_num_batched_tokens).", by_hand=_BUCKETS
  )
  column_buckets: tuple[int, ...] = field((), "Padded page-table widths.", by_hand=_BUCKETS)
  # Test-time depth (docs/design.md §3, "Depth at test time"): the engine's static limits, then
  # the settings of a request that gives none (the server's requests may give their own).
  max_recurrences: int = field(
    0,
    "Most recurrences a request may run: the step loop's length (0: the model's R). Above R "
    "the unshared layout pages this many core copies per token.",
    min=0,
  )
  exit_lookup: str = field(
    adaptive.DEFAULT_LOOKUP,
    "Unshared: what later recurrences read of a token that exited before them ('latest': its "
    "last K/V; 'always-last', 'skip': Huginn's; docs/design.md §3).",
    choices=adaptive.LOOKUPS,
  )
  recurrences: int = field(
    0, "Recurrences per token, <= max_recurrences (0: the model's R).", min=0
  )
  exit_criterion: str = field(
    "none",
    "Per-token exit: Huginn's criteria or Ouro's 'gate' (looped/model/adaptive.py).",
    choices=adaptive.CRITERIA,
  )
  exit_threshold: float | None = field(
    None, "The criterion's threshold (None: its default, Huginn's or Ouro's).", min=0.0
  )
  min_recurrences: int = field(0, "No exit before this many recurrences.", min=0)
  exit_every: int = field(1, "Check the exit criterion every this many recurrences.", min=1)
  init_scale: float = field(
    1.0, "Scales the initial state's noise (state_init 'like_init'); 0: a zero state.", min=0.0
  )
  continuous_compute: bool = field(
    False, "A generated token's recurrences start from the previous token's final state."
  )
  exit_in_prefill: bool = field(
    True, "Prompt tokens exit by the criterion too (False: they run every recurrence)."
  )
  # Self-speculative decoding (looped/engine/speculative.py, docs/engine.md): the settings of a
  # request that gives none, and how verification reads a shared cache.
  speculative_recurrences: int = field(
    0, "Draft recurrences r of speculative decoding, <= the verifier's (0: off).", min=0
  )
  speculative_tokens: int = field(
    4,
    "Tokens drafted then verified per round (k); also the most a request may ask for.",
    min=1,
    max=64,
  )
  speculative_verify: str = field(
    "block",
    "Verification: " + speculative.VERIFY_DOC,
    by_hand="'block' or a positive number of passes, as text",
  )


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSection))


@dataclasses.dataclass(frozen=True)
class GenConfig(EngineSection):
  """`config.gen`: the checkpoint, the prompts, the paged engine (EngineSection) and the
  sampler."""

  checkpoint: str = field(
    "", "Trainer workdir, pipeline stage dir or converted model (checkpoints/).", nonempty=True
  )
  step: int = field(-1, "Checkpoint step to load (-1: the latest).", min=-1)
  prompts: str = field(
    "",
    'One prompt, a tuple of prompts, or a file: .jsonl ({"prompt": ...} per line) or text '
    "(one prompt per line; '\\n' in a line stands for a newline).",
    by_hand="a string, a tuple of strings or a prompts file",
  )
  max_new_tokens: int = field(64, "Tokens generated per prompt at most.", min=1)
  temperature: float = field(
    0.0, "0: greedy; > 0: sample from softmax(logits / temperature).", min=0.0
  )
  top_k: int = field(0, "Sample among the k most likely tokens (0: all).", min=0)
  top_p: float = field(1.0, "Nucleus sampling mass (1: off).", gt=0.0, max=1.0)
  seed: int = field(0, "Sampler seed; prompt i uses seed + i.", min=0)
  stop_strings: tuple[str, ...] = field(
    (),
    "Generated text containing one of these ends the prompt's output.",
    by_hand="a tuple of non-empty strings",
  )
  stop_at_eos: bool = field(True, "The tokenizer's EOS ends a prompt's output.")
  stream: bool = field(True, "With a single prompt, print its text as it is generated.")
