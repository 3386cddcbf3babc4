"""The server section: every field of `config.serve` declared once, with its default, doc and
range (looped.schema derives configs/serve.py's ConfigDict, the range checks and help;
looped/server/program.py checks the rules relating fields and the model)."""

from __future__ import annotations

import dataclasses

from looped.engine.config import EngineSection
from looped.schema import field


@dataclasses.dataclass(frozen=True)
class ServeConfig(EngineSection):
  """`config.serve`: the checkpoint, the listening address, the paged engine (EngineSection)
  and the server's own limits."""

  checkpoint: str = field(
    "", "Trainer workdir, pipeline stage dir or converted model (checkpoints/).", nonempty=True
  )
  step: int = field(-1, "Checkpoint step to load (-1: the latest).", min=-1)
  model_name: str = field("", "Name in /v1/models and responses ('': the checkpoint dir's name).")
  host: str = field("127.0.0.1", "Address to listen on.", nonempty=True)
  port: int = field(
    0, "TCP port (0: any free port; the one taken is written to server.json).", min=0, max=65535
  )
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
  body_timeout_s: float = field(
    60.0, "A request body not complete this long after the request began gets HTTP 408.", min=0.1
  )
  stream_backlog: int = field(
    64,
    "Tokens a stream may have waiting for a client that stopped reading before it is cancelled.",
    min=1,
  )
