"""The server's request and response types, and the parsers of `/v1/completions` and
`/v1/chat/completions` bodies.

Each request field is declared once, as a record in `REQUEST` or `CHAT_REQUEST` (name, doc,
default, range; the fields the two share are the same records): `parse` and `parse_chat` check a
body with the records' `check`, and openapi.py writes the OpenAPI document from their `schema`
and from the response types below, so a field added here is accepted and documented with no
second edit. As in OpenAI's API, `null` in an optional field means its default. Fields are
checked by hand rather than by a schema library so that each refusal is one sentence naming the
field (`param` in OpenAI's error object) and quoting at most QUOTE_CHARS of the value, and so a
body the engine could choke on (NaN temperature, bad token ids, a prompt longer than the context,
an integer of 5,000 digits) is a 400 in the request's own handler: the engine loop only ever sees
requests it can serve. Rules that relate several fields (the context, the page pool, a streamed
batch) are `_check_fits`.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import reprlib
import secrets
from collections.abc import Callable
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from looped.engine import sampling
from looped.engine.requests import DepthParams
from looped.engine.speculative import SpeculativeParams
from looped.model import adaptive

MAX_STOP_STRINGS = 4  # As OpenAI's API.
MAX_STOP_CHARS = 1024  # A stop string's length: streams hold back that many characters.
QUOTE_CHARS = 80  # The most characters of a client's value an error message quotes.


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
  body_timeout_s: float = 60.0  # A body not complete this long after the request began: 408.
  stream_backlog: int = 64  # Tokens a stream may have waiting for its client before it is aborted.
  max_recurrences: int = 0  # The most recurrences a request may ask for (the engine's loop).
  exit_gate: bool = False  # The model has an exit gate (exit_criterion 'gate').
  depth: DepthParams = DepthParams()  # The server's depth settings (serve.recurrences, ...).
  trained_recurrences: int = 0  # The model's R, what recurrences 0 runs (0: max_recurrences).
  # Self-speculative decoding: whether the engine runs speculative rounds (adaptive depth, one
  # device), the most tokens a request may draft per round (the engine's max lookahead) and the
  # server's own setting (serve.speculative_recurrences, serve.speculative_tokens).
  speculates: bool = True
  max_speculative_tokens: int = 8
  speculative: SpeculativeParams = SpeculativeParams()


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
  depth: DepthParams | None = None  # The request's own depth settings (None: the server's).
  # The request's own speculation (None: the server's, GenRequest.speculative).
  speculative: SpeculativeParams | None = None


class HugeInteger:
  """A JSON integer with more digits than Python's int() reads (sys.get_int_max_str_digits,
  4,300): `json_object` parses it into this, so the field holding it is refused by name
  instead of the parser failing on the whole body."""

  def __init__(self, digits: int):
    self.digits = digits

  def __repr__(self) -> str:
    return f"<an integer of {self.digits} digits>"


def _read_int(text: str) -> int | HugeInteger:
  try:
    return int(text)
  except ValueError:
    return HugeInteger(len(text.lstrip("-")))


_REPR = reprlib.Repr()
_REPR.maxlevel = 2
_REPR.maxstring = _REPR.maxlong = _REPR.maxother = QUOTE_CHARS // 2
for _kind in ("tuple", "list", "array", "dict", "set", "frozenset", "deque"):
  setattr(_REPR, f"max{_kind}", 4)


def quote(value: Any) -> str:
  """A client's value as an error message quotes it: a repr cut to QUOTE_CHARS characters (a
  1 MB field name or a 4,000-digit number is not echoed back whole)."""
  text = _REPR.repr(value)
  return text if len(text) <= QUOTE_CHARS else text[: QUOTE_CHARS - 3] + "..."


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
  except RecursionError:  # The parser's depth bound: a valid request nests 5 levels at most.
    raise RequestError("the body nests JSON arrays or objects too deeply.") from None
  except ValueError:  # An integer over int()'s digit limit: read again, keeping it apart.
    body = json.loads(text, parse_int=_read_int)
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
class Field(abc.ABC):
  """One request field: `check` parses the body's value (or refuses it naming the field) and
  `rule` states what it accepts as a JSON schema, for the same limits.

  default: the value of an absent or null field (or a function of Limits); None: the field has
  no value then. required: the body must hold it, not null. nullable: null means the default
  (else null is checked as a value).
  """

  name: str
  doc: str
  default: ByLimits = None
  required: bool = False
  nullable: bool = True

  @abc.abstractmethod
  def check(self, value: Any, limits: Limits, tokenizer) -> Any:
    """The parsed value, or RequestError naming the field (each kind of field its own)."""

  @abc.abstractmethod
  def rule(self, limits: Limits) -> dict:
    """The JSON schema of what `check` accepts under these limits."""

  def take(self, body: dict, limits: Limits, tokenizer) -> Any:
    """The field's parsed value in `body`: null is its default, as in OpenAI's API."""
    if self.name in body and (body[self.name] is not None or not self.nullable):
      return self.check(body[self.name], limits, tokenizer)
    if self.required:
      raise RequestError(f"{self.name} is required.", self.name)
    return self.check(at(self.default, limits), limits, tokenizer)

  def schema(self, limits: Limits) -> dict:
    """The field's JSON schema: its rule, doc and default (a nullable optional field says so;
    an enum then lists null, as OpenAPI 3.0 asks)."""
    out = {**self.rule(limits), "description": self.doc}
    if not self.required:
      default = at(self.default, limits)
      out.update({} if default is None else {"default": default})
      if self.nullable:
        out["nullable"] = True
        if "enum" in out:
          out["enum"] = [*out["enum"], None]
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
      raise self.refuse(f"{self.name} must be an integer, got {quote(value)}.")
    hi = at(self.hi, limits)
    if value < self.lo or (hi is not None and value > hi):
      bounds = f">= {self.lo}" if hi is None else f"in [{self.lo}, {hi}]"
      raise self.refuse(f"{self.name} must be {bounds}, got {quote(value)}.")
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
      raise self.refuse(f"{self.name} must be a number, got {quote(value)}.")
    bounds = f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"
    try:
      number = float(value)
    except OverflowError:  # An integer beyond any float: 400 digits of temperature.
      raise self.refuse(f"{self.name} must be in {bounds}, got {quote(value)}.") from None
    if not math.isfinite(number):
      raise self.refuse(f"{self.name} must be a finite number, got {number!r}.")
    if not (self.lo < number if self.lo_open else self.lo <= number) or number > self.hi:
      raise self.refuse(f"{self.name} must be in {bounds}, got {quote(value)}.")
    return number

  def rule(self, limits: Limits) -> dict:
    open_lo = {"exclusiveMinimum": True} if self.lo_open else {}
    return {"type": "number", "minimum": self.lo, "maximum": self.hi, **open_lo}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Boolean(Field):
  def check(self, value: Any, limits: Limits, tokenizer) -> bool:
    if not isinstance(value, bool):
      raise self.refuse(f"{self.name} must be true or false, got {quote(value)}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "boolean"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Text(Field):
  def check(self, value: Any, limits: Limits, tokenizer) -> str:
    if not isinstance(value, str):
      raise self.refuse(f"{self.name} must be a string, got {quote(value)}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "string"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Exactly(Field):
  """An integer field with one accepted value (`why` says why, in the refusal)."""

  why: str

  def check(self, value: Any, limits: Limits, tokenizer) -> int:
    if not is_int(value) or value != self.default:
      raise self.refuse(f"{self.name} must be {self.default} ({self.why}), got {quote(value)}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "integer", "enum": [self.default]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel(Field):
  """The served model's name: asking for another is a 404. Not nullable: OpenAI's API requires
  a model, and a null one names none."""

  nullable: bool = False

  def check(self, value: Any, limits: Limits, tokenizer) -> str:
    if not isinstance(value, str):
      raise self.refuse(f"model must be a string, got {quote(value)}.")
    if value != limits.model_name:
      raise self.refuse(
        f"model {quote(value)} is not served here (this server serves {limits.model_name!r}).",
        404,
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
      raise self.refuse(f"stop must be a string or a list of strings, got {quote(value)}.")
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
          f"{where} holds token id {quote(bad[0])}; ids must lie in [0, {limits.vocab_size})."
        )
      return Prompt(tuple(item), tokenizer.decode(item))
    raise self.refuse(f"{where} must be a non-empty string or list of token ids.")

  def rule(self, limits: Limits) -> dict:
    text = {"type": "string", "minLength": 1}
    tokens = {"type": "array", "items": {"type": "integer", **token_range(limits)}, "minItems": 1}
    batch = {"type": "array", "items": {"oneOf": [text, tokens]}, "minItems": 1}
    return {"oneOf": [text, tokens, {**batch, "maxItems": limits.max_batch}]}


# The roles a chat message may have: what every chat template renders. Tool calls and their
# results ('tool', 'function') are not served.
CHAT_ROLES = ("system", "user", "assistant")
MESSAGE_KEYS = ("role", "content", "name")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Messages(Field):
  """A chat: a non-empty list of {role, content, name?}, where content is a non-empty string or
  a non-empty list of OpenAI's text parts ({"type": "text", "text": ...}, joined with newlines,
  as vLLM does; image or audio parts are refused). Parsed into a tuple of dicts with string
  content, which is what a chat template renders. A refusal names the message's key, e.g.
  `messages[2].role`."""

  def check(self, value: Any, limits: Limits, tokenizer) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
      raise self.refuse(f"messages must be a non-empty list of messages, got {quote(value)}.")
    return tuple(self._message(m, f"messages[{i}]") for i, m in enumerate(value))

  def _message(self, message: Any, where: str) -> dict:
    if not isinstance(message, dict):
      raise RequestError(
        f"{where} must be an object with a role and a content, got {quote(message)}.", where
      )
    for key in message:
      if key not in MESSAGE_KEYS:
        name = bounded(key)
        raise RequestError(
          f"{where}.{name} is not supported (a message holds {', '.join(MESSAGE_KEYS)}).",
          f"{where}.{name}",
        )
    role = message.get("role")
    if role not in CHAT_ROLES:
      raise RequestError(
        f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {quote(role)}.",
        f"{where}.role",
      )
    out = {"role": role, "content": self._content(message.get("content"), f"{where}.content")}
    name = message.get("name")
    if name is not None:
      if not isinstance(name, str):
        raise RequestError(f"{where}.name must be a string, got {quote(name)}.", f"{where}.name")
      out["name"] = check_text(name, f"{where}.name", f"{where}.name")
    return out

  def _content(self, content: Any, where: str) -> str:
    if isinstance(content, str):
      if not content:
        raise RequestError(f"{where} is empty.", where)
      return check_text(content, where, where)
    if not isinstance(content, list) or not content:
      raise RequestError(
        f"{where} must be a non-empty string or list of text parts, got {quote(content)}.", where
      )
    texts = []
    for j, part in enumerate(content):
      at_part = f"{where}[{j}]"
      kind = part.get("type") if isinstance(part, dict) else None
      if kind != "text" or set(part) != {"type", "text"}:
        if isinstance(kind, str) and kind != "text":
          message = f"{at_part} is a {quote(kind)} part; only text parts are served."
        else:
          message = f'{at_part} must be {{"type": "text", "text": ...}}, got {quote(part)}.'
        raise RequestError(message, at_part)
      text = part["text"]
      if not isinstance(text, str) or not text:
        raise RequestError(
          f"{at_part}.text must be a non-empty string, got {quote(text)}.", f"{at_part}.text"
        )
      texts.append(check_text(text, f"{at_part}.text", f"{at_part}.text"))
    return "\n".join(texts)

  def rule(self, limits: Limits) -> dict:
    part = {
      "type": "object",
      "required": ["type", "text"],
      "additionalProperties": False,
      "properties": {
        "type": {"type": "string", "enum": ["text"]},
        "text": {"type": "string", "minLength": 1},
      },
    }
    content = {"type": "array", "items": part, "minItems": 1}
    message = {
      "type": "object",
      "required": ["role", "content"],
      "additionalProperties": False,
      "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES)},
        "content": {"oneOf": [{"type": "string", "minLength": 1}, content]},
        "name": {"type": "string", "nullable": True},
      },
    }
    return {"type": "array", "items": message, "minItems": 1}


# The fields both endpoints take, one record each: a change here changes both.
MODEL = ServedModel(
  name="model",
  doc="The served model (the only one accepted).",
  default=lambda limits: limits.model_name,
)
TEMPERATURE = Number(
  name="temperature",
  doc="Sampling temperature; 0 is greedy.",
  default=1.0,
  lo=0,
  hi=sampling.MAX_TEMPERATURE,
)
TOP_P = Number(
  name="top_p",
  doc="Nucleus sampling: the smallest set of likeliest tokens whose probability reaches top_p.",
  default=1.0,
  lo=0,
  hi=1,
  lo_open=True,
)
TOP_K = Integer(
  name="top_k",
  # -1 (vLLM's off) and 0 both mean all tokens; more than the vocabulary is not a top-k.
  doc="Sample from the k likeliest tokens; 0 or -1: from all of them.",
  default=0,
  lo=-1,
  hi=lambda limits: limits.vocab_size,
)
SEED = Integer(
  name="seed",
  doc="The sampler's seed, for a repeatable completion; null: a random one.",
  lo=0,
  hi=2**31 - 1,
)
STOP = Stop(name="stop", doc="Strings that end the completion when generated.")
N = Exactly(name="n", doc="Completions per prompt.", default=1, why="one completion per prompt")
STREAM = Boolean(
  name="stream", doc="Send tokens as server-sent events (one prompt).", default=False
)
STREAM_OPTIONS = Options(
  name="stream_options",
  doc="Options of a stream.",
  fields=(
    Boolean(
      name="include_usage", doc="Send the usage in a last chunk before [DONE].", default=False
    ),
  ),
)
IGNORE_EOS = Boolean(
  name="ignore_eos", doc="Generate past the end-of-sequence token.", default=False
)
USER = Text(name="user", doc="Who sends the request (accepted, not used).", default="")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Choice(Field):
  """One of `choices` (strings, or a function of Limits giving them: what the served model
  takes); null or absent: the default (None: no value)."""

  choices: ByLimits

  def check(self, value: Any, limits: Limits, tokenizer) -> str | None:
    if value is None and self.default is None:
      return None
    choices = at(self.choices, limits)
    if not isinstance(value, str) or value not in choices:
      raise self.refuse(f"{self.name} must be one of {', '.join(choices)}, got {quote(value)}.")
    return value

  def rule(self, limits: Limits) -> dict:
    return {"type": "string", "enum": list(at(self.choices, limits))}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptionalNumber(Number):
  """A Number whose absence (null or absent, default None) is a value of its own."""

  def check(self, value: Any, limits: Limits, tokenizer) -> float | None:
    return None if value is None else super().check(value, limits, tokenizer)


# Test-time depth (docs/design.md §3, "Depth at test time"): a request's own recurrences and
# exit; an absent one keeps the server's setting (serve.recurrences, serve.exit_criterion, ...),
# and a request naming a criterion without a threshold gets that criterion's default.
DEPTH_FIELDS = ("recurrences", "exit_criterion", "exit_threshold", "min_recurrences")
RECURRENCES = Integer(
  name="recurrences",
  doc="Recurrences per token, at most the server's serve.max_recurrences (0: the model's R); "
  "null: the server's setting.",
  lo=0,
  hi=lambda limits: limits.max_recurrences,
)
EXIT_CRITERION = Choice(
  name="exit_criterion",
  doc="Per-token exit: 'none', Huginn's criteria or Ouro's 'gate' (a model with an exit gate); "
  "null: the server's setting.",
  choices=lambda limits: tuple(c for c in adaptive.CRITERIA if c != "gate" or limits.exit_gate),
)
EXIT_THRESHOLD = OptionalNumber(
  name="exit_threshold",
  doc="The exit criterion's threshold (the gate's in (0, 1], argmax-stability's a whole "
  "number); null: the criterion's default.",
  lo=0,
  hi=1e6,
)
MIN_RECURRENCES = Integer(
  name="min_recurrences",
  doc="No exit before this many recurrences; null: the server's setting.",
  lo=0,
  hi=lambda limits: limits.max_recurrences,
)


def depth_of(values: dict, limits: Limits) -> DepthParams | None:
  """A request's depth settings (the server's with the request's fields over them; None when
  it gives none), or RequestError naming the field that makes them unservable."""
  given = {k: values.get(k) for k in DEPTH_FIELDS if values.get(k) is not None}
  if not given:
    return None
  if "exit_criterion" in given and "exit_threshold" not in given:
    given["exit_threshold"] = None  # The request's criterion's default, not the server's.
  depth = dataclasses.replace(limits.depth, **given)
  try:
    depth.check(limits.max_recurrences, limits.exit_gate)
  except adaptive.DepthError as e:
    raise RequestError(str(e), e.field) from None
  return depth


# Self-speculative decoding (looped/engine/speculative.py): a request's draft depth and lookahead;
# an absent one keeps the server's setting (serve.speculative_recurrences, ...).
SPECULATIVE_FIELDS = ("speculative_recurrences", "speculative_tokens")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftRecurrences(Integer):
  """speculative_recurrences: an Integer whose refusal, on a server that cannot speculate, says
  so rather than quoting a range of [0, 0]."""

  def check(self, value: Any, limits: Limits, tokenizer) -> int | None:
    if is_int(value) and value > 0 and not limits.speculates:
      raise self.refuse(
        f"{self.name} = {value}: this server does not speculate (the engine needs adaptive "
        "depth and one device); send 0 or null."
      )
    return super().check(value, limits, tokenizer)


SPECULATIVE_RECURRENCES = DraftRecurrences(
  name="speculative_recurrences",
  doc="Self-speculative decoding: each round drafts speculative_tokens tokens at this many "
  "recurrences and verifies them at the request's recurrences, which bound it (0: off); null: "
  "the server's setting.",
  lo=0,
  hi=lambda limits: limits.max_recurrences if limits.speculates else 0,
)
SPECULATIVE_TOKENS = Integer(
  name="speculative_tokens",
  doc="Self-speculative decoding: tokens drafted, then verified, per round (k); null: the "
  "server's setting.",
  lo=1,
  hi=lambda limits: limits.max_speculative_tokens,
)


def speculative_of(
  values: dict, depth: DepthParams | None, limits: Limits
) -> SpeculativeParams | None:
  """A request's speculation (the server's with the request's fields over it; None when it
  gives none, so the server's applies), or RequestError naming the field that makes it
  unservable with the request's depth (the engine's rules, Engine._speculative_of): the
  request's speculative_recurrences, or else the depth field that clashes with the server's."""
  given = {k: values[k] for k in SPECULATIVE_FIELDS if values.get(k) is not None}
  spec = SpeculativeParams(
    given.get("speculative_recurrences", limits.speculative.recurrences),
    given.get("speculative_tokens", limits.speculative.tokens),
  )
  if spec.enabled:
    _check_speculative(spec, "speculative_recurrences" in given, depth or limits.depth, limits)
  return spec if given else None


def _check_speculative(
  spec: SpeculativeParams, mine: bool, depth: DepthParams, limits: Limits
) -> None:
  """speculative_of's refusals; mine: the request gave speculative_recurrences (else the
  server's setting clashes with the request's depth fields, which are named)."""
  verify = depth.recurrences or limits.trained_recurrences or limits.max_recurrences
  whose = "" if mine else " (the server's)"
  if spec.recurrences > verify:
    raise RequestError(
      f"speculative_recurrences = {spec.recurrences}{whose} must be at most the {verify} "
      "recurrences that verify its drafts (the request's recurrences); 0: off.",
      "speculative_recurrences" if mine else "recurrences",
    )
  if depth.exits or depth.continuous_compute:
    raise RequestError(
      f"speculative_recurrences = {spec.recurrences}{whose} drafts and verifies at fixed "
      "depths: it takes exit_criterion 'none' and no continuous compute (speculative_recurrences "
      "0 turns it off).",
      "speculative_recurrences" if mine else "exit_criterion",
    )


# The fields of a /v1/completions body, in the order they are checked (the first bad one is
# named). A field added here is documented (openapi.py) and checked by `parse` with no other
# edit; `_completion` says what the engine does with its value.
REQUEST: tuple[Field, ...] = (
  MODEL,
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
  TEMPERATURE,
  TOP_P,
  TOP_K,
  SEED,
  STOP,
  N,
  STREAM,
  STREAM_OPTIONS,
  Integer(
    name="logprobs",
    doc="Return each token's log-probability and this many likeliest alternatives; null: none.",
    lo=0,
    hi=lambda limits: limits.max_logprobs,
  ),
  Boolean(name="echo", doc="Prefix the completion with the prompt.", default=False),
  IGNORE_EOS,
  USER,
  RECURRENCES,
  EXIT_CRITERION,
  EXIT_THRESHOLD,
  MIN_RECURRENCES,
  SPECULATIVE_RECURRENCES,
  SPECULATIVE_TOKENS,
)
FIELDS = frozenset(f.name for f in REQUEST)

# The fields of a /v1/chat/completions body: the chat is rendered with the served model's chat
# template into one prompt (`parse_chat`); the sampling fields are the completions' records.
CHAT_REQUEST: tuple[Field, ...] = (
  MODEL,
  Messages(
    name="messages",
    doc="The chat so far: a list of {role, content, name?}; content is a string or text parts.",
    required=True,
  ),
  Integer(
    name="max_tokens",
    doc="The most tokens to generate; null: up to the model's context.",
    lo=1,
    context_hi=lambda limits: limits.max_model_len - 1,
  ),
  Integer(
    name="max_completion_tokens",
    doc="OpenAI's newer name for max_tokens; it wins where both are given.",
    lo=1,
    context_hi=lambda limits: limits.max_model_len - 1,
  ),
  TEMPERATURE,
  TOP_P,
  TOP_K,
  SEED,
  STOP,
  N,
  STREAM,
  STREAM_OPTIONS,
  Boolean(name="logprobs", doc="Return each generated token's log-probability.", default=False),
  Integer(
    name="top_logprobs",
    doc="With logprobs: this many likeliest alternatives per token; null: none.",
    lo=0,
    hi=lambda limits: limits.max_logprobs,
  ),
  IGNORE_EOS,
  USER,
  RECURRENCES,
  EXIT_CRITERION,
  EXIT_THRESHOLD,
  MIN_RECURRENCES,
  SPECULATIVE_RECURRENCES,
  SPECULATIVE_TOKENS,
)
CHAT_FIELDS = frozenset(f.name for f in CHAT_REQUEST)


def bounded(name: str) -> str:
  """A client's name (an unknown field's) cut to QUOTE_CHARS characters."""
  return name if len(name) <= QUOTE_CHARS else name[: QUOTE_CHARS - 3] + "..."


def _values(raw: bytes, fields: tuple[Field, ...], limits: Limits, tokenizer) -> dict:
  """Each field's parsed value in a body, or RequestError naming the first bad or unknown one."""
  body = json_object(raw)
  names = sorted(f.name for f in fields)
  unknown = sorted(set(body) - set(names))
  if unknown:
    name = bounded(unknown[0])
    raise RequestError(
      f"unknown or unsupported field {name!r} (supported: {', '.join(names)}).", name
    )
  return {f.name: f.take(body, limits, tokenizer) for f in fields}


def parse(raw: bytes, tokenizer, limits: Limits) -> Completion:
  """The checked request, or RequestError naming the first bad field."""
  values = _values(raw, REQUEST, limits, tokenizer)
  request = _with_depth(_completion(values), values, limits)
  _check_fits(request, limits)
  return request


def parse_chat(
  raw: bytes, tokenizer, limits: Limits, render: Callable[[tuple[dict, ...]], str]
) -> Completion:
  """The checked chat request as one completion of the prompt `render` (the served model's chat
  template) makes of its messages, or RequestError naming the first bad field."""
  values = _values(raw, CHAT_REQUEST, limits, tokenizer)
  if values["top_logprobs"] is not None and not values["logprobs"]:
    raise RequestError("top_logprobs needs logprobs: true.", "top_logprobs")
  try:
    text = render(values["messages"])
  except Exception as e:  # The template's own refusal (raise_exception) or its failure.
    raise RequestError(
      f"the chat template cannot render these messages: {quote(str(e) or type(e).__name__)}",
      "messages",
    ) from None
  tokens = tuple(int(t) for t in tokenizer.encode(check_text(text, "the chat", "messages")))
  if not tokens:
    raise RequestError("the chat template renders these messages as no text.", "messages")
  max_tokens = values["max_completion_tokens"] or values["max_tokens"]
  top = values["top_logprobs"]
  request = _completion(
    {
      **values,
      "prompt": (Prompt(tokens, text),),
      "max_tokens": max_tokens or max(1, limits.max_model_len - len(tokens)),
      "logprobs": (top or 0) if values["logprobs"] else None,
      "echo": False,
    }
  )
  request = _with_depth(request, values, limits)
  given = "max_completion_tokens" if values["max_completion_tokens"] else "max_tokens"
  _check_fits(request, limits, prompt_param="messages", tokens_param=given)
  return request


def _with_depth(request: Completion, values: dict, limits: Limits) -> Completion:
  """The request with its depth and speculation settings (depth_of, speculative_of)."""
  depth = depth_of(values, limits)
  speculative = speculative_of(values, depth, limits)
  return dataclasses.replace(request, depth=depth, speculative=speculative)


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


def _check_fits(
  request: Completion,
  limits: Limits,
  prompt_param: str = "prompt",
  tokens_param: str = "max_tokens",
) -> None:
  """Refuses a request whose fields are valid alone but not together: a streamed batch, or a
  prompt whose completion overflows the context or the page pool. prompt_param, tokens_param:
  the fields the prompt and max_tokens came from (a chat's prompt is its messages)."""
  prompts, max_tokens = request.prompts, request.max_tokens
  if request.stream and len(prompts) > 1:
    raise RequestError("stream takes a single prompt.", "stream")
  for i, p in enumerate(prompts):
    where = prompt_param if len(prompts) == 1 else f"prompt[{i}]"
    if len(p.tokens) >= limits.max_model_len:
      raise RequestError(
        f"{where} is {len(p.tokens)} tokens; the model's context is {limits.max_model_len} "
        "tokens, which leaves no room for a new one.",
        prompt_param,
      )
    total = len(p.tokens) + max_tokens
    if total > limits.max_model_len:
      raise RequestError(
        f"{tokens_param} = {max_tokens} plus the {len(p.tokens)} tokens of {where} exceeds the "
        f"model's context of {limits.max_model_len} tokens.",
        tokens_param,
      )
    pages = -(-(total - 1) // limits.page_size)
    if pages > limits.max_pages:
      raise RequestError(
        f"{tokens_param} = {max_tokens} with {where} needs {pages} KV pages; the pool holds "
        f"{limits.max_pages}.",
        tokens_param,
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
  # Mean recurrences of the calls that produced the completion's tokens (test-time depth).
  mean_recurrences: NotRequired[float | None]
  # Self-speculative decoding, when it is on for the request (its fields or the server's
  # setting): tokens its rounds drafted, and drafts the verifier kept (0 if no round ran).
  drafted_tokens: NotRequired[Count]
  accepted_tokens: NotRequired[Count]


class CompletionResponse(TypedDict):
  """The completion of every prompt."""

  id: str
  object: Literal["text_completion"]
  created: int
  model: str
  choices: list[Choice]
  usage: Usage


class TopLogprob(TypedDict):
  token: str
  logprob: float
  bytes: list[int] | None  # The token's UTF-8 bytes; null for one that is not text alone.


class TokenLogprob(TypedDict):
  token: str
  logprob: float
  bytes: list[int] | None
  top_logprobs: list[TopLogprob]


class ChatLogprobs(TypedDict):
  content: list[TokenLogprob]


class ChatMessage(TypedDict):
  role: Literal["assistant"]
  content: str


class ChatChoice(TypedDict):
  index: Count
  message: ChatMessage
  logprobs: ChatLogprobs | None
  finish_reason: Literal["length", "stop"]


class ChatCompletionResponse(TypedDict):
  """The assistant's reply."""

  id: str
  object: Literal["chat.completion"]
  created: int
  model: str
  choices: list[ChatChoice]
  usage: Usage


class ChatDelta(TypedDict):
  role: NotRequired[Literal["assistant"]]  # The first chunk's.
  content: NotRequired[str]


class ChatChunkChoice(TypedDict):
  index: Count
  delta: ChatDelta
  logprobs: ChatLogprobs | None
  finish_reason: Literal["length", "stop"] | None


class ChatCompletionChunk(TypedDict):
  """A streamed chat's event (StreamEvent.data); the usage chunk has no choices."""

  id: str
  object: Literal["chat.completion.chunk"]
  created: int
  model: str
  choices: list[ChatChunkChoice]
  usage: NotRequired[Usage]


class StreamEvent(TypedDict):
  """A server-sent event: a CompletionResponse or ChatCompletionChunk chunk as JSON, or
  [DONE]."""

  data: str


class ErrorDetail(TypedDict):
  message: str
  type: str
  param: NotRequired[str | None]  # The refused field.
  code: NotRequired[Any | None]


class Error(TypedDict):
  """OpenAI's error object."""

  error: ErrorDetail
