"""The server's request and response types, and the parser of a `/v1/completions` body.

Each request field is declared once, as a record in `REQUEST` (name, doc, default, range):
`parse` checks a body with the records' `check`, and openapi.py writes the OpenAPI document
from their `schema` and from the response types below, so a field added here is accepted and
documented with no second edit. Fields are checked by hand rather than by a schema library so
that each refusal is one sentence naming the field (`param` in OpenAI's error object), and so a
body the engine could choke on (NaN temperature, bad token ids, a prompt longer than the context)
is a 400 in the request's own handler: the engine loop only ever sees requests it can serve.
Rules that relate several fields (the context, the page pool, a streamed batch) are `_check_fits`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from looped.engine import sampling

MAX_STOP_STRINGS = 4  # As OpenAI's API.
MAX_STOP_CHARS = 1024  # A stop string's length: streams hold back that many characters.


class RequestError(ValueError):
  """A refusal: HTTP status, OpenAI error type and the offending field."""

  def __init__(self, message: str, param: str | None = None, status: int = 400):
    super().__init__(message)
    self.param = param
    self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the served model and engine allow."""

  model_name: str
  max_model_len: int  # Prompt + generated tokens.
  vocab_size: int
  max_logprobs: int  # Largest `logprobs` (top alternatives per token).
  max_pages: int  # KV pages in the pool: a request needing more can never run.
  page_size: int
  max_batch: int = 256  # Prompts in one request (serve.max_waiting: a batch queues at once).
  max_body_bytes: int = 1 << 22  # Request bodies over this many bytes get a 413.


@dataclasses.dataclass(frozen=True)
class Prompt:
  tokens: tuple[int, ...]
  text: str  # As given, or the decoded token ids.


@dataclasses.dataclass(frozen=True)
class Completion:
  """A checked request: one engine request per prompt."""

  prompts: tuple[Prompt, ...]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  seed: int
  stop: tuple[str, ...]
  stream: bool
  include_usage: bool
  logprobs: int | None
  echo: bool
  ignore_eos: bool


def is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def check_text(text: str, where: str, param: str) -> str:
  """`text` if it can be encoded as UTF-8; JSON allows lone surrogates (\\ud800), text does
  not, and a tokenizer would fail on them inside the engine's request."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raise RequestError(
      f"{where} holds a lone surrogate (U+{ord(text[e.start]):04X} at character {e.start}), "
      "which is not text; send UTF-8.",
      param,
    ) from None
  return text


def json_object(raw: bytes) -> dict:
  """A body's JSON object, or RequestError saying why it is not one."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise RequestError(f"the body is not UTF-8 (byte {e.start}: {e.reason}).") from None
  try:
    body = json.loads(text)
  except json.JSONDecodeError as e:
    raise RequestError(f"the body is not JSON ({e.msg} at line {e.lineno}).") from None
  except RecursionError:  # The parser's depth bound: no request nests more than 3 levels.
    raise RequestError("the body nests JSON arrays or objects too deeply.") from None
  if not isinstance(body, dict):
    raise RequestError("the body must be a JSON object.")
  return body


# A request field's bound or default: a value, or a function of the served model's Limits.
ByLimits = Any


def at(value: ByLimits, limits: Limits) -> Any:
  """A bound or default for the served model: value(limits) if it depends on it."""
  return value(limits) if callable(value) else value


def token_range(limits: Limits) -> dict:
  """The JSON-schema bounds of a token id: the vocabulary."""
  return {"minimum": 0, "maximum": limits.vocab_size - 1}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Field:
  """One request field: `check` parses the body's value (or refuses it naming the field) and
  `rule` states what it accepts as a JSON schema, for the same limits.

  default: the value of an absent field (or a function of Limits); None where the field may
  also be null, which means absent. required: the body must hold it.
  """

  name: str
  doc: str
  default: ByLimits = None
  required: bool = False

  def check(self, value: Any, limits: Limits, tokenizer) -> Any:
    raise NotImplementedError

  def rule(self, limits: Limits) -> dict:
    raise NotImplementedError

  def take(self, body: dict, limits: Limits, tokenizer) -> Any:
    """The field's parsed value in `body`."""
    if self.required and self.name not in body:
      raise RequestError(f"{self.name} is required.", self.name)
    return self.check(body.get(self.name, at(self.default, limits)), limits, tokenizer)

  def schema(self, limits: Limits) -> dict:
    """The field's JSON schema: its rule, doc and default."""
    out = {**self.rule(limits), "description": self.doc}
    if not self.required:
      default = at(self.default, limits)
      out.update({"nullable": True} if default is None else {"default": default})
    return out

  def refuse(self, message: str, status: int = 400) -> RequestError:
    return RequestError(message, self.name, status)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Integer(Field):
  """An integer in [lo, hi] (hi None: no upper bound). context_hi: the largest value the document
  states where `_check_fits` checks the bound with the prompt (one message naming both)."""

  lo: int
  hi: ByLimits = None
  context_hi: ByLimits = None

  def check(self, value: Any, limits: Limits, tokenizer) -> int | None:
    if value is None and self.default is None:
      return None
    if not is_int(value):
      raise self.refuse(f"{self.name} must be an integer, got {value!r}.")
    hi = at(self.hi, limits)
    if value < self.lo or (hi is not None and value > hi):
      bounds = f">= {self.lo}" if hi is None else f"in [{self.lo}, {hi}]"
      raise self.refuse(f"{self.name} must be {bounds}, got {value}.")
    return value

  def rule(self, limits: Limits) -> dict:
    hi = at(self.hi if self.context_hi is None else self.context_hi, limits)
    return {"type": "integer", "minimum": self.lo, **({} if hi is None else {"maximum": hi})}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Number(Field):
  """A finite number in [lo, hi], or (lo, hi] with lo_open."""

  lo: float
  hi: float
  lo_open: bool = False

  def check(self, value: Any, limits: Limits, tokenizer) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise self.refuse(f"{self.name} must be a number, got {value!r}.")
    if not math.isfinite(value):
      raise self.refuse(f"{self.name} must be a finite number, got {value!r}.")
    value = float(value)
    if not (self.lo < value if self.lo_open else self.lo <= value) or value > self.hi:
      bounds = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
      raise self.refuse(f"{self.name} must be in {bounds}, got {value}.")
    return value

  def rule(self, limits: Limits) -> dict:
    open_lo = {"exclusiveMinimum": True} if self.lo_open else {}
    return {"type": "number", "minimum": self.lo, "maximum": self.hi, **open_lo}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boolean(Field):
  def check(self, value: Any, limits: Limits, tokenizer) -> bool:
    if not isinstance(value, bool):
      raise self.refuse(f"{self.name} must be true or false, got {value!r}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "boolean"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Text(Field):
  def check(self, value: Any, limits: Limits, tokenizer) -> str:
    if not isinstance(value, str):
      raise self.refuse(f"{self.name} must be a string, got {value!r}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "string"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exactly(Field):
  """An integer field with one accepted value (`why` says why, in the refusal)."""

  why: str

  def check(self, value: Any, limits: Limits, tokenizer) -> int:
    if not is_int(value) or value != self.default:
      raise self.refuse(f"{self.name} must be {self.default} ({self.why}), got {value!r}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "integer", "enum": [self.default]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel(Field):
  """The served model's name: asking for another is a 404."""

  def check(self, value: Any, limits: Limits, tokenizer) -> str:
    if value != limits.model_name:
      raise self.refuse(
        f"model {value!r} is not served here (this server serves {limits.model_name!r}).", 404
      )
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "string", "enum": [limits.model_name]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options(Field):
  """A JSON object of its own fields (null: all at their defaults); parsed into a dict."""

  fields: tuple[Field, ...]

  def check(self, value: Any, limits: Limits, tokenizer) -> dict:
    value = {} if value is None else value
    names = [f.name for f in self.fields]
    if not isinstance(value, dict) or set(value) - set(names):
      raise self.refuse(f"{self.name} may only hold {', '.join(names)}.")
    return {f.name: f.take(value, limits, tokenizer) for f in self.fields}

  def rule(self, limits: Limits) -> dict:
    properties = {f.name: f.schema(limits) for f in self.fields}
    return {"type": "object", "additionalProperties": False, "properties": properties}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stop(Field):
  """A string or a list of at most MAX_STOP_STRINGS non-empty strings; parsed into a tuple."""

  def check(self, value: Any, limits: Limits, tokenizer) -> tuple[str, ...]:
    if value is None:
      stop = ()
    elif isinstance(value, str):
      stop = (value,)
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
      stop = tuple(value)
    else:
      raise self.refuse(f"stop must be a string or a list of strings, got {value!r}.")
    if len(stop) > MAX_STOP_STRINGS or not all(stop):
      raise self.refuse(f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings.")
    for i, s in enumerate(stop):
      if len(s) > MAX_STOP_CHARS:
        raise self.refuse(f"stop[{i}] is {len(s)} characters; at most {MAX_STOP_CHARS}.")
      check_text(s, f"stop[{i}]", self.name)
    return stop

  def rule(self, limits: Limits) -> dict:
    text = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
    return {"oneOf": [text, {"type": "array", "items": text, "maxItems": MAX_STOP_STRINGS}]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prompts(Field):
  """A string, a list of token ids, or a list of either (a batch); parsed into Prompts."""

  def check(self, value: Any, limits: Limits, tokenizer) -> tuple[Prompt, ...]:
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
      if len(value) > limits.max_batch:
        raise self.refuse(
          f"prompt is a batch of {len(value)} prompts; this server takes at most "
          f"{limits.max_batch} in one request (serve.max_waiting)."
        )
      return tuple(self._one(v, f"prompt[{i}]", limits, tokenizer) for i, v in enumerate(value))
    return (self._one(value, "prompt", limits, tokenizer),)

  def _one(self, item: Any, where: str, limits: Limits, tokenizer) -> Prompt:
    if isinstance(item, str):
      if not item:
        raise self.refuse(f"{where} is empty.")
      tokens = tuple(int(t) for t in tokenizer.encode(check_text(item, where, self.name)))
      return Prompt(tokens, item)
    if isinstance(item, list) and item and all(is_int(t) for t in item):
      bad = [t for t in item if not 0 <= t < limits.vocab_size]
      if bad:
        raise self.refuse(
          f"{where} holds token id {bad[0]}; ids must lie in [0, {limits.vocab_size})."
        )
      return Prompt(tuple(item), tokenizer.decode(item))
    raise self.refuse(f"{where} must be a non-empty string or list of token ids.")

  def rule(self, limits: Limits) -> dict:
    text = {"type": "string", "minLength": 1}
    tokens = {"type": "array", "items": {"type": "integer", **token_range(limits)}, "minItems": 1}
    batch = {"type": "array", "items": {"oneOf": [text, tokens]}, "minItems": 1}
    return {"oneOf": [text, tokens, {**batch, "maxItems": limits.max_batch}]}


# The fields of a /v1/completions body, in the order they are checked (the first bad one is
# named). A field added here is documented (openapi.py) and checked by `parse` with no other
# edit; `_completion` says what the engine does with its value.
REQUEST: tuple[Field, ...] = (
  ServedModel(
    name="model",
    doc="The served model (the only one accepted).",
    default=lambda limits: limits.model_name,
  ),
  Prompts(
    name="prompt",
    doc="A string, a list of token ids, or a batch (a list of either): one completion each.",
    required=True,
  ),
  Integer(
    name="max_tokens",
    doc="The most tokens to generate; with the prompt they must fit the model's context.",
    default=16,
    lo=1,
    context_hi=lambda limits: limits.max_model_len - 1,  # A prompt holds a token at least.
  ),
  Number(
    name="temperature",
    doc="Sampling temperature; 0 is greedy.",
    default=1.0,
    lo=0,
    hi=sampling.MAX_TEMPERATURE,
  ),
  Number(
    name="top_p",
    doc="Nucleus sampling: the smallest set of likeliest tokens whose probability reaches top_p.",
    default=1.0,
    lo=0,
    hi=1,
    lo_open=True,
  ),
  Integer(
    name="top_k",
    # -1 (vLLM's off) and 0 both mean all tokens; more than the vocabulary is not a top-k.
    doc="Sample from the k likeliest tokens; 0 or -1: from all of them.",
    default=0,
    lo=-1,
    hi=lambda limits: limits.vocab_size,
  ),
  Integer(
    name="seed",
    doc="The sampler's seed, for a repeatable completion; null: a random one.",
    lo=0,
    hi=2**31 - 1,
  ),
  Stop(name="stop", doc="Strings that end the completion when generated."),
  Exactly(name="n", doc="Completions per prompt.", default=1, why="one completion per prompt"),
  Boolean(name="stream", doc="Send tokens as server-sent events (one prompt).", default=False),
  Options(
    name="stream_options",
    doc="Options of a stream.",
    fields=(
      Boolean(
        name="include_usage", doc="Send the usage in a last chunk before [DONE].", default=False
      ),
    ),
  ),
  Integer(
    name="logprobs",
    doc="Return each token's log-probability and this many likeliest alternatives; null: none.",
    lo=0,
    hi=lambda limits: limits.max_logprobs,
  ),
  Boolean(name="echo", doc="Prefix the completion with the prompt.", default=False),
  Boolean(name="ignore_eos", doc="Generate past the end-of-sequence token.", default=False),
  Text(name="user", doc="Who sends the request (accepted, not used).", default=""),
)
FIELDS = frozenset(f.name for f in REQUEST)


def parse(raw: bytes, tokenizer, limits: Limits) -> Completion:
  """The checked request, or RequestError naming the first bad field."""
  body = json_object(raw)
  names = sorted(f.name for f in REQUEST)
  unknown = sorted(set(body) - set(names))
  if unknown:
    raise RequestError(
      f"unknown or unsupported field {unknown[0]!r} (supported: {', '.join(names)}).",
      unknown[0],
    )
  values = {f.name: f.take(body, limits, tokenizer) for f in REQUEST}
  request = _completion(values)
  _check_fits(request, limits)
  return request


def _completion(values: dict) -> Completion:
  """The Completion of a body's parsed field values."""
  seed = values["seed"]
  return Completion(
    prompts=values["prompt"],
    max_tokens=values["max_tokens"],
    temperature=values["temperature"],
    top_p=values["top_p"],
    top_k=max(values["top_k"], 0),
    seed=secrets.randbelow(2**31) if seed is None else seed,
    stop=values["stop"],
    stream=values["stream"],
    include_usage=values["stream_options"]["include_usage"],
    logprobs=values["logprobs"],
    echo=values["echo"],
    ignore_eos=values["ignore_eos"],
  )


def _check_fits(request: Completion, limits: Limits) -> None:
  """Refuses a request whose fields are valid alone but not together: a streamed batch, or a
  prompt whose completion overflows the context or the page pool."""
  prompts, max_tokens = request.prompts, request.max_tokens
  if request.stream and len(prompts) > 1:
    raise RequestError("stream takes a single prompt.", "stream")
  for i, p in enumerate(prompts):
    where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
    if len(p.tokens) >= limits.max_model_len:
      raise RequestError(
        f"{where} is {len(p.tokens)} tokens; the model's context is {limits.max_model_len} "
        "tokens, which leaves no room for a new one.",
        "prompt",
      )
    total = len(p.tokens) + max_tokens
    if total > limits.max_model_len:
      raise RequestError(
        f"max_tokens = {max_tokens} plus the {len(p.tokens)} tokens of {where} exceeds the "
        f"model's context of {limits.max_model_len} tokens.",
        "max_tokens",
      )
    pages = -(-(total - 1) // limits.page_size)
    if pages > limits.max_pages:
      raise RequestError(
        f"max_tokens = {max_tokens} with {where} needs {pages} KV pages; the pool holds "
        f"{limits.max_pages}.",
        "max_tokens",
      )


# Response (and small request) types: openapi.py writes their JSON schemas. An Annotated
# type's metadata is extra JSON schema, a dict or a function of Limits giving one.
TokenId = Annotated[int, token_range]
Count = Annotated[int, {"minimum": 0}]


class TokenizeRequest(TypedDict):
  prompt: str


class DetokenizeRequest(TypedDict):
  tokens: list[TokenId]


class Tokens(TypedDict):
  """The prompt's token ids."""

  tokens: list[TokenId]
  count: int
  max_model_len: int


class Detokenized(TypedDict):
  """The tokens' text."""

  prompt: str


class Health(TypedDict):
  """Ready."""

  status: Literal["ok"]


class ModelCard(TypedDict):
  id: str
  object: Literal["model"]
  created: int
  owned_by: str
  max_model_len: int


class Models(TypedDict):
  """The served model."""

  object: Literal["list"]
  data: list[ModelCard]


class TokenizerInfo(TypedDict):
  """The served tokenizer (vLLM's endpoint, read by lm-evaluation-harness)."""

  tokenizer_class: str
  eos_token: str | None
  eos_token_id: int
  bos_token: str | None
  pad_token: str | None
  model_max_length: int
  vocab_size: int


class Logprobs(TypedDict):
  tokens: list[str]
  token_logprobs: list[float | None]
  top_logprobs: list[dict[str, float] | None]
  text_offset: list[int]


class Choice(TypedDict):
  index: Count
  text: str
  logprobs: Logprobs | None
  finish_reason: Literal["length", "stop"]


class Usage(TypedDict):
  prompt_tokens: Count
  completion_tokens: Count
  total_tokens: Count


class CompletionResponse(TypedDict):
  """The completion of every prompt."""

  id: str
  object: Literal["text_completion"]
  created: int
  model: str
  choices: list[Choice]
  usage: Usage


class StreamEvent(TypedDict):
  """A server-sent event: a CompletionResponse chunk as JSON, or [DONE]."""

  data: str


class ErrorDetail(TypedDict):
  message: str
  type: str
  param: NotRequired[str | None]  # The refused field.
  code: NotRequired[Any | None]


class Error(TypedDict):
  """OpenAI's error object."""

  error: ErrorDetail
