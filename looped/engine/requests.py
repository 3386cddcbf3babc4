"""What the engine serves: a prompt's tokens with its sampling parameters, and what comes back.

A `GenRequest` is what the scheduler queues (request_id, arrival_s, prompt_len, output_len,
prompt_page_keys), so the simulator can replay exactly the same stream. Its prefix-cache keys
are a hash chain over the prompt's tokens: page k's key hashes tokens [0, (k + 1) * page_size),
so equal keys mean equal prefixes and a hit reuses K/V computed from the same tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from looped.engine.sampling import SamplingParams
from looped.engine.speculative import SpeculativeParams
from looped.model import adaptive

# A request's recurrences and exit settings (looped.model.adaptive.DepthSettings).
DepthParams = adaptive.DepthSettings


@dataclasses.dataclass(frozen=True, eq=False)
class GenRequest:
  request_id: int
  prompt_tokens: tuple[int, ...]
  sampling: SamplingParams = SamplingParams()
  arrival_s: float = 0.0
  prompt_text: str = ""
  # Record every position's next-token logprob and top-k (RequestState.positions; the executor
  # needs top_logprobs > 0), e.g. to score the prompt. Such a request never hits the prefix
  # cache, so each of its positions is computed.
  position_logprobs: bool = False
  # Recurrences and exits (None: the engine's default, EngineConfig.depth; the engine
  # resolves it when the request is added).
  depth: DepthParams | None = None
  # Self-speculative decoding (None: the engine's default, EngineConfig.speculative).
  speculative: SpeculativeParams | None = None

  @property
  def lookahead(self) -> int:
    """Tokens each speculative round drafts (0: plain decoding), what the scheduler reserves.
    Requests recording every position's logprobs decode plainly."""
    s = self.speculative
    return s.tokens if s is not None and s.enabled and not self.position_logprobs else 0

  @property
  def prompt_len(self) -> int:
    return len(self.prompt_tokens)

  @property
  def output_len(self) -> int:
    """Most tokens it can generate (the scheduler's page reservation uses this)."""
    return self.sampling.max_new_tokens

  @property
  def block_exact(self) -> bool:
    """Whether its cached positions depend on how its prompt is cut into calls (exits are
    decided per call, a warm start chains generated tokens): the scheduler then cuts its
    prompt in blocks and its generated positions one per call, in any layout."""
    depth = self.depth
    return depth is not None and (depth.exits or depth.continuous_compute)

  def prompt_page_keys(self, page_size: int) -> list[int]:
    """Keys of the full prompt pages: non-negative 63-bit hashes chained over the tokens (and
    the depth settings, DepthParams.page_key, where they change the pages)."""
    keys, digest = [], b""
    if self.depth is not None:
      digest = self.depth.page_key()
    if self.position_logprobs:  # A chain no other request shares: no hit, every position run.
      digest = b"positions" + np.int64(self.request_id).tobytes()
    tokens = np.asarray(self.prompt_tokens, np.int64)
    for k in range(len(tokens) // page_size):
      page = tokens[k * page_size : (k + 1) * page_size].tobytes()
      digest = hashlib.blake2b(digest + page, digest_size=8).digest()
      keys.append(int.from_bytes(digest, "little") >> 1)
    return keys


@dataclasses.dataclass
class Generation:
  """One request's result."""

  request_id: int
  prompt: str
  text: str  # Generated text (stop token / string excluded).
  tokens: list[int]  # Generated token ids (a stop token included).
  logprobs: list[float]  # log p(token) under the model, per generated token.
  finish_reason: str  # 'length', 'stop_token' or 'stop_string'.
  cached_prompt_tokens: int  # Prefix-cache hit at first admission.
  num_preemptions: int
  ttft_s: float  # First token time - arrival, on the engine's clock.
  latency_s: float  # Finish - arrival.
  prompt_len: int = 0
  # Position -> logits (EngineConfig.record_logits): what tests compare with a reference.
  logits: dict = dataclasses.field(default_factory=dict, repr=False)
  # Position p -> (log p(token p + 1), top ids, their logprobs), for position_logprobs requests.
  positions: dict = dataclasses.field(default_factory=dict, repr=False)
  # Recurrences of the call that produced each generated token (the first: its prompt's
  # last chunk), as Huginn counts compute steps.
  recurrences: list[int] = dataclasses.field(default_factory=list)
  # Self-speculative decoding: the tokens each round emitted, drafted, drafts kept.
  speculative_rounds: list[int] = dataclasses.field(default_factory=list)
  drafted_tokens: int = 0
  accepted_tokens: int = 0

  @property
  def mean_recurrences(self) -> float | None:
    return float(np.mean(self.recurrences)) if self.recurrences else None

  def record(self) -> dict:
    """The result as generations.jsonl stores it (recorded logits and positions left out)."""
    skip = ("logits", "positions", "prompt_len")
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


@dataclasses.dataclass(frozen=True)
class TokenEvent:
  """One generated token of a request, as `Engine.step` reports it (a stream's next chunk)."""

  request_id: int
  token: int
  logprob: float
  top: tuple[list[int], list[float]] | None  # The position's top ids and logprobs, if recorded.
  text: str  # The request's whole generated text so far (stop strings cut).
  finish_reason: str | None
  num_generated: int  # Tokens generated so far, this one included.
  # On the first token of a position_logprobs request: its prompt positions' records.
  prompt_positions: dict | None = None
  recurrences: int = 0  # Recurrences of the call that produced the token.


@dataclasses.dataclass(frozen=True)
class Failure:
  """A request the engine gave up on (it gets no further event)."""

  request_id: int
  message: str
  # True when a step failed on the device and the page pool was rebuilt: every request in
  # flight failed with it. False: this request's own data failed a step.
  pool_lost: bool = False


@dataclasses.dataclass
class StepOutput:
  """What one `Engine.step` did: the time it ended, its tokens, finished and failed requests."""

  now: float
  tokens: list[TokenEvent] = dataclasses.field(default_factory=list)
  finished: list[Generation] = dataclasses.field(default_factory=list)
  failed: list[Failure] = dataclasses.field(default_factory=list)
