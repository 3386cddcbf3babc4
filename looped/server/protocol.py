"""Parses and checks a `/v1/completions` body before anything reaches the engine.

Every field is checked by hand rather than by a schema library so that each refusal is one
sentence naming the field (`param` in OpenAI's error object), and so a body the engine could
choke on (NaN temperature, bad token ids, a prompt longer than the context) is a 400 in the
request's own handler: the engine loop only ever sees requests it can serve.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from typing import Any

from looped.engine import sampling

FIELDS = frozenset(
  {
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "echo",
    "ignore_eos",
    "user",
  }
)
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


def _integer(body: dict, field: str, default: int | None, lo: int, hi: int | None = None):
  value = body.get(field, default)
  if value is None and default is None:
    return None
  if not is_int(value):
    raise RequestError(f"{field} must be an integer, got {value!r}.", field)
  if value < lo or (hi is not None and value > hi):
    bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
    raise RequestError(f"{field} must be {bounds}, got {value}.", field)
  return value


def _number(body: dict, field: str, default: float) -> float:
  value = body.get(field, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise RequestError(f"{field} must be a number, got {value!r}.", field)
  if not math.isfinite(value):
    raise RequestError(f"{field} must be a finite number, got {value!r}.", field)
  return float(value)


def _boolean(body: dict, field: str, default: bool) -> bool:
  value = body.get(field, default)
  if not isinstance(value, bool):
    raise RequestError(f"{field} must be true or false, got {value!r}.", field)
  return value


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


def _prompts(value: Any, tokenizer, limits: Limits) -> list[Prompt]:
  """A string, a list of token ids, or a list of either (a batch)."""

  def one(item: Any, where: str) -> Prompt:
    if isinstance(item, str):
      if not item:
        raise RequestError(f"{where} is empty.", "prompt")
      tokens = tuple(int(t) for t in tokenizer.encode(check_text(item, where, "prompt")))
      return Prompt(tokens, item)
    if isinstance(item, list) and item and all(is_int(t) for t in item):
      bad = [t for t in item if not 0 <= t < limits.vocab_size]
      if bad:
        raise RequestError(
          f"{where} holds token id {bad[0]}; ids must lie in [0, {limits.vocab_size}).", "prompt"
        )
      return Prompt(tuple(item), tokenizer.decode(item))
    raise RequestError(f"{where} must be a non-empty string or list of token ids.", "prompt")

  if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
    if len(value) > limits.max_batch:
      raise RequestError(
        f"prompt is a batch of {len(value)} prompts; this server takes at most "
        f"{limits.max_batch} in one request (serve.max_waiting).",
        "prompt",
      )
    return [one(v, f"prompt[{i}]") for i, v in enumerate(value)]
  return [one(value, "prompt")]


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


def parse(raw: bytes, tokenizer, limits: Limits) -> Completion:
  """The checked request, or RequestError naming the first bad field."""
  body = json_object(raw)
  unknown = sorted(set(body) - FIELDS)
  if unknown:
    raise RequestError(
      f"unknown or unsupported field {unknown[0]!r} (supported: {', '.join(sorted(FIELDS))}).",
      unknown[0],
    )
  model = body.get("model", limits.model_name)
  if model != limits.model_name:
    raise RequestError(
      f"model {model!r} is not served here (this server serves {limits.model_name!r}).",
      "model",
      status=404,
    )
  if "prompt" not in body:
    raise RequestError("prompt is required.", "prompt")
  prompts = _prompts(body["prompt"], tokenizer, limits)
  max_tokens = _integer(body, "max_tokens", 16, 1)
  temperature = _number(body, "temperature", 1.0)
  if not 0 <= temperature <= sampling.MAX_TEMPERATURE:
    raise RequestError(
      f"temperature must be in [0, {sampling.MAX_TEMPERATURE:g}], got {temperature}.", "temperature"
    )
  top_p = _number(body, "top_p", 1.0)
  if not 0 < top_p <= 1:
    raise RequestError(f"top_p must be in (0, 1], got {top_p}.", "top_p")
  # -1 (vLLM's off) and 0 both mean all tokens; more than the vocabulary is not a top-k.
  top_k = _integer(body, "top_k", 0, -1, limits.vocab_size)
  seed = _integer(body, "seed", None, 0, 2**31 - 1)
  stop = body.get("stop")
  if stop is None:
    stop = ()
  elif isinstance(stop, str):
    stop = (stop,)
  elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
    stop = tuple(stop)
  else:
    raise RequestError(f"stop must be a string or a list of strings, got {stop!r}.", "stop")
  if len(stop) > MAX_STOP_STRINGS or not all(stop):
    raise RequestError(f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings.", "stop")
  for i, s in enumerate(stop):
    if len(s) > MAX_STOP_CHARS:
      raise RequestError(f"stop[{i}] is {len(s)} characters; at most {MAX_STOP_CHARS}.", "stop")
    check_text(s, f"stop[{i}]", "stop")
  n = body.get("n", 1)
  if not is_int(n) or n != 1:
    raise RequestError(f"n must be 1 (one completion per prompt), got {n!r}.", "n")
  stream = _boolean(body, "stream", False)
  options = body.get("stream_options")
  options = {} if options is None else options
  if not isinstance(options, dict) or set(options) - {"include_usage"}:
    raise RequestError("stream_options may only hold include_usage.", "stream_options")
  include_usage = _boolean(options, "include_usage", False)
  logprobs = _integer(body, "logprobs", None, 0, limits.max_logprobs)
  echo = _boolean(body, "echo", False)
  ignore_eos = _boolean(body, "ignore_eos", False)
  user = body.get("user", "")
  if not isinstance(user, str):
    raise RequestError(f"user must be a string, got {user!r}.", "user")
  if stream and len(prompts) > 1:
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
  return Completion(
    prompts=tuple(prompts),
    max_tokens=max_tokens,
    temperature=temperature,
    top_p=top_p,
    top_k=max(top_k, 0),
    seed=secrets.randbelow(2**31) if seed is None else seed,
    stop=stop,
    stream=stream,
    include_usage=include_usage,
    logprobs=logprobs,
    echo=echo,
    ignore_eos=ignore_eos,
  )
