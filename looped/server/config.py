"""The server section: every field of `config.serve` declared once, with its default, doc and
range (looped.schema derives configs/serve.py's ConfigDict, the range checks and help;
looped/server/program.py checks the rules relating fields and the model)."""

from __future__ import annotations

import dataclasses

from looped.engine.config import (
  ATTENTION_IMPL_DOC,
  ATTENTION_IMPLS,
  KV_FORMATS,
  KV_POLICY_DOC,
  KV_POLICY_VALUES,
  PREFILL_BLOCK_DOC,
)
from looped.schema import field

_BUCKETS = "a tuple of positive integers (empty: powers of two)"


@dataclasses.dataclass(frozen=True)
class ServeConfig:
  """`config.serve`: the checkpoint, the listening address and the paged engine's limits."""

  checkpoint: str = field(
    "", "Trainer workdir, pipeline stage dir or converted model (checkpoints/).", nonempty=True
  )
  step: int = field(-1, "Checkpoint step to load (-1: the latest).", min=-1)
  model_name: str = field("", "Name in /v1/models and responses ('': the checkpoint dir's name).")
  host: str = field("127.0.0.1", "Address to listen on.", nonempty=True)
  port: int = field(
    0, "TCP port (0: any free port; the one taken is written to server.json).", min=0, max=65535
  )
  share_kv: bool = field(True, "KV-sharing: cache only the final recurrence's K/V of core layers.")
  kv_policy: str = field("final", KV_POLICY_DOC, by_hand=KV_POLICY_VALUES)
  kv_format: str = field(
    "", "Page storage: '' (raw, compute dtype) or a packed format.", choices=KV_FORMATS
  )
  kv_budget_bytes: float = field(
    64e6, "KV page pool in bytes; must hold one max_seq_len request.", gt=0.0
  )
  page_size: int = field(16, "Tokens per KV page (prefix-cache granularity).", min=1)
  max_num_batched_tokens: int = field(
    64, "Per-step token budget (decodes + prefill chunks).", min=1
  )
  max_num_seqs: int = field(8, "Cap on requests running at once.", min=1)
  prefill_block: int = field(
    32,
    PREFILL_BLOCK_DOC,
    min=1,
  )
  attention_impl: str = field("auto", ATTENTION_IMPL_DOC, choices=ATTENTION_IMPLS)
  row_buckets: tuple[int, ...] = field(
    (), "Padded batch rows, one compilation each; reaches max_num_seqs.", by_hand=_BUCKETS
  )
  token_buckets: tuple[int, ...] = field(
    (), "Padded chunk lengths; reach min(prefill_block, max_num_batched_tokens).", by_hand=_BUCKETS
  )
  column_buckets: tuple[int, ...] = field((), "Padded page-table widths.", by_hand=_BUCKETS)
  max_waiting: int = field(
    256,
    "Requests queued beyond the running ones (more get HTTP 429); also a batch's most prompts.",
    min=0,
  )
  max_logprobs: int = field(
    5, "Largest `logprobs` a request may ask for (as OpenAI's API).", min=0, max=20
  )
  drain_timeout_s: float = field(
    600.0, "After SIGTERM, wait this long for requests in flight.", min=0.0
  )
  warmup: bool = field(
    True, "Compile every step shape before serving, so no request waits for a compile."
  )
  max_body_bytes: int = field(
    1 << 22, "Request bodies over this many bytes get HTTP 413.", min=1024
  )
