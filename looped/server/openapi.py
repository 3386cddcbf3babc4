"""The server's OpenAPI 3.0 document, served at /openapi.json.

Generated from protocol.py's declarations for the served model's limits (vocabulary, context,
logprobs, batch size): the completion and chat requests' field records (each field's type,
range, default, nullability and doc) and the request and response types of every route. Not
generated from handler signatures: the handlers read raw bodies so that each refusal names its
field. It tells clients what is accepted, and an API fuzzer (schemathesis,
tests/server_fuzz_test.py) sends what it allows and what it does not.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from looped.server import protocol

_PRIMITIVES = {bool: "boolean", int: "integer", float: "number", str: "string"}


def schema_of(kind: Any, limits: protocol.Limits) -> dict:
  """The JSON schema of a declared type: a primitive, list, dict, Literal, `X | None`, a
  TypedDict, an Annotated type (its metadata is extra schema, a dict or a function of Limits)
  or a tuple of protocol.Field records (a request body that refuses other fields)."""
  if isinstance(kind, tuple):
    return _request_body(kind, limits)
  origin, args = typing.get_origin(kind), typing.get_args(kind)
  if origin is typing.Annotated:
    return {**schema_of(args[0], limits), **protocol.at(args[1], limits)}
  if origin in (typing.Union, types.UnionType):
    rest = [a for a in args if a is not type(None)]
    (one,) = rest  # A union is only ever `X | None` here.
    return {**schema_of(one, limits), "nullable": True}
  if origin is list:
    return {"type": "array", "items": schema_of(args[0], limits)}
  if origin is dict:
    return {"type": "object", "additionalProperties": schema_of(args[1], limits)}
  if origin is typing.Literal:
    return {"type": _PRIMITIVES[type(args[0])], "enum": list(args)}
  if typing.is_typeddict(kind):
    return _object(kind, limits)
  if kind is Any:
    return {}
  return {"type": _PRIMITIVES[kind]}


def _object(kind: type, limits: protocol.Limits) -> dict:
  """A TypedDict's schema: every key required but those marked NotRequired."""
  hints = typing.get_type_hints(kind, include_extras=True)
  properties, required = {}, []
  for name, hint in hints.items():
    if typing.get_origin(hint) is typing.NotRequired:
      hint = typing.get_args(hint)[0]
    else:
      required.append(name)
    properties[name] = schema_of(hint, limits)
  out = {"type": "object", "required": required, "properties": properties}
  return {**out, "description": kind.__doc__} if kind.__doc__ else out


def _request_body(fields: tuple[protocol.Field, ...], limits: protocol.Limits) -> dict:
  """The schema of a body of protocol.Field records: only those fields."""
  return {
    "type": "object",
    "required": [f.name for f in fields if f.required],
    "additionalProperties": False,
    "properties": {f.name: f.schema(limits) for f in fields},
  }


_WHY = {
  400: "a field is invalid (the message names it), or the HTTP request is malformed",
  404: "another model is asked for",
  408: "the body was not complete within serve.body_timeout_s",
  413: "the body is over serve.max_body_bytes",
  429: "the queue is full (retry later)",
  503: "the server is warming up or shutting down",
}


@dataclasses.dataclass(frozen=True)
class Route:
  """One route: its body's type (None: no body), what a 200 is (its description and its
  type per media type) and the error statuses it may answer."""

  path: str
  method: str
  ok: str
  content: dict
  body: Any = None
  errors: tuple[int, ...] = ()

  def operation(self, limits: protocol.Limits) -> dict:
    ok = {"description": self.ok, "content": _content(self.content, limits)}
    error = _content({"application/json": protocol.Error}, limits)
    responses = {
      "200": ok,
      **{str(c): {"description": _WHY[c], "content": error} for c in self.errors},
    }
    if self.body is None:
      return {"responses": responses}
    body = {"required": True, "content": _content({"application/json": self.body}, limits)}
    return {"requestBody": body, "responses": responses}


def _content(by_media_type: dict, limits: protocol.Limits) -> dict:
  return {media: {"schema": schema_of(t, limits)} for media, t in by_media_type.items()}


def routes() -> tuple[Route, ...]:
  """The server's routes (app.py's), read at call time: the request fields as declared now."""
  completion = {
    "application/json": protocol.CompletionResponse,
    "text/event-stream": protocol.StreamEvent,
  }
  chat = {
    "application/json": protocol.ChatCompletionResponse,
    "text/event-stream": protocol.StreamEvent,
  }
  return (
    Route(
      "/v1/completions",
      "post",
      "the completion (a JSON object, or server-sent events with stream)",
      completion,
      body=protocol.REQUEST,
      errors=(400, 404, 408, 413, 429, 503),
    ),
    Route(
      "/v1/chat/completions",
      "post",
      "the assistant's reply (a JSON object, or server-sent events with stream)",
      chat,
      body=protocol.CHAT_REQUEST,
      errors=(400, 404, 408, 413, 429, 503),
    ),
    Route("/v1/models", "get", "the served model", {"application/json": protocol.Models}),
    Route("/health", "get", "ready", {"application/json": protocol.Health}, errors=(503,)),
    Route(
      "/tokenize",
      "post",
      "the prompt's token ids",
      {"application/json": protocol.Tokens},
      body=protocol.TokenizeRequest,
      errors=(400, 408, 413),
    ),
    Route(
      "/detokenize",
      "post",
      "the tokens' text",
      {"application/json": protocol.Detokenized},
      body=protocol.DetokenizeRequest,
      errors=(400, 408, 413),
    ),
    Route(
      "/tokenizer_info",
      "get",
      "the served tokenizer",
      {"application/json": protocol.TokenizerInfo},
    ),
    Route("/metrics", "get", "Prometheus text format", {"text/plain": str}),
  )


def document(limits: protocol.Limits) -> dict:
  """The OpenAPI document of the server's routes for the served model's limits."""
  paths = {}
  for route in routes():
    paths.setdefault(route.path, {})[route.method] = route.operation(limits)
  return {"openapi": "3.0.3", "info": {"title": "looped", "version": "1"}, "paths": paths}
