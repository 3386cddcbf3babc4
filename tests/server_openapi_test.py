"""The OpenAPI document is generated from protocol.py: the completion and chat requests'
properties are their declared fields, a field added there is documented and parsed with no
second edit, every bound (and nullability) the document states is the one the parser checks,
and the response types' keys are the documented ones."""

import dataclasses
import json
from typing import Annotated, Literal, NotRequired, TypedDict
from unittest import mock

from absl.testing import absltest

from looped.data.tokenizers import BytesTokenizer
from looped.server import openapi, protocol

_LIMITS = protocol.Limits("tiny", 32, 257, 5, 32, 4, max_batch=4)


def _request_schema(limits: protocol.Limits = _LIMITS, path: str = "/v1/completions") -> dict:
  post = openapi.document(limits)["paths"][path]["post"]
  return post["requestBody"]["content"]["application/json"]["schema"]


def _ok_schema(path: str, method: str, media: str = "application/json") -> dict:
  route = openapi.document(_LIMITS)["paths"][path][method]
  return route["responses"]["200"]["content"][media]["schema"]


def _parse(**fields):
  body = {"prompt": "x", "max_tokens": 1, **fields}
  return protocol.parse(json.dumps(body).encode(), BytesTokenizer(), _LIMITS)


def _parse_chat(**fields):
  """A chat whose template is its last message's content: a 1-token prompt, as _parse's (with
  logprobs, so that top_logprobs may be set)."""
  body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "logprobs": True}
  body.update(fields)
  render = lambda messages: messages[-1]["content"]
  return protocol.parse_chat(json.dumps(body).encode(), BytesTokenizer(), _LIMITS, render)


def _check_documented_bounds(test, schema: dict, parse) -> int:
  """Parses each value on and just past every bound, enum and nullability of a request schema:
  the first accepted, the others refused naming the field; returns how many were checked."""
  checked = 0
  for name, prop in schema["properties"].items():
    kind = prop.get("type")
    step = 1 if kind == "integer" else 0.5
    accepted, refused = [], []
    if "minimum" in prop:
      lo = prop["minimum"]
      (refused if prop.get("exclusiveMinimum") else accepted).append(lo)
      refused.append(lo - step)
    if "maximum" in prop:
      accepted.append(prop["maximum"])
      refused.append(prop["maximum"] + step)
    accepted += prop.get("enum", [])
    if kind == "boolean":
      accepted += [True, False]
      refused.append("yes")
    (accepted if prop.get("nullable") else refused).append(None)
    for value in accepted:  # max_tokens' maximum leaves room for the 1-token prompt alone.
      parse(**{name: value})
    for value in refused:
      with test.assertRaises(protocol.RequestError, msg=(name, value)) as e:
        parse(**{name: value})
      test.assertEqual(e.exception.param, name, (name, value))
    checked += len(accepted) + len(refused)
  return checked


class RequestDocumentTest(absltest.TestCase):
  def test_properties_are_the_declared_fields(self):
    schema = _request_schema()
    self.assertEqual(list(schema["properties"]), [f.name for f in protocol.REQUEST])
    self.assertEqual(set(schema["properties"]), protocol.FIELDS)
    self.assertEqual(schema["required"], ["prompt"])
    self.assertFalse(schema["additionalProperties"])
    for f in protocol.REQUEST:
      self.assertEqual(schema["properties"][f.name]["description"], f.doc)

  def test_a_field_added_to_the_request_is_documented_and_parsed(self):
    added = protocol.Integer(
      name="beams", doc="Beams searched.", default=1, lo=1, hi=lambda limits: limits.max_batch
    )
    with mock.patch.object(protocol, "REQUEST", protocol.REQUEST + (added,)):
      prop = _request_schema()["properties"]["beams"]
      self.assertEqual(
        prop,
        {
          "type": "integer",
          "minimum": 1,
          "maximum": _LIMITS.max_batch,
          "nullable": True,
          "default": 1,
          "description": "Beams searched.",
        },
      )
      _parse(beams=_LIMITS.max_batch)  # Not an unknown field any more.
      with self.assertRaises(protocol.RequestError) as e:
        _parse(beams=_LIMITS.max_batch + 1)
      self.assertEqual(e.exception.param, "beams")
    with self.assertRaises(protocol.RequestError) as e:
      _parse(beams=1)
    self.assertIn("unknown", str(e.exception))

  def test_every_documented_bound_is_what_the_parser_checks(self):
    """Each numeric bound, enum value and nullability the document states: the value on the
    bound is accepted, the one just past it refused naming the field."""
    self.assertGreater(_check_documented_bounds(self, _request_schema(), _parse), 40)

  def test_every_documented_chat_bound_is_what_the_chat_parser_checks(self):
    schema = _request_schema(path="/v1/chat/completions")
    self.assertEqual(list(schema["properties"]), [f.name for f in protocol.CHAT_REQUEST])
    self.assertEqual(schema["required"], ["messages"])
    self.assertFalse(schema["additionalProperties"])
    self.assertGreater(_check_documented_bounds(self, schema, _parse_chat), 40)
    # The fields both endpoints take are documented alike.
    completion = _request_schema()["properties"]
    for name in ("temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "user"):
      self.assertEqual(schema["properties"][name], completion[name], name)

  def test_limits_reach_the_document(self):
    bigger = protocol.Limits("other", 64, 300, 7, 32, 4, max_batch=9)
    props = _request_schema(bigger)["properties"]
    self.assertEqual(props["model"]["enum"], ["other"])
    self.assertEqual(props["max_tokens"]["maximum"], 63)
    self.assertEqual(props["top_k"]["maximum"], 300)
    self.assertEqual(props["logprobs"]["maximum"], 7)
    self.assertEqual(props["prompt"]["oneOf"][1]["items"]["maximum"], 299)
    self.assertEqual(props["prompt"]["oneOf"][2]["maxItems"], 9)


class ResponseDocumentTest(absltest.TestCase):
  def test_response_keys_are_the_declared_types(self):
    routes = [
      ("/v1/completions", "post", protocol.CompletionResponse),
      ("/v1/chat/completions", "post", protocol.ChatCompletionResponse),
      ("/v1/models", "get", protocol.Models),
      ("/health", "get", protocol.Health),
      ("/tokenize", "post", protocol.Tokens),
      ("/detokenize", "post", protocol.Detokenized),
      ("/tokenizer_info", "get", protocol.TokenizerInfo),
    ]
    for path, method, kind in routes:
      schema = _ok_schema(path, method)
      self.assertEqual(list(schema["properties"]), list(kind.__annotations__), path)
      self.assertEqual(schema["required"], list(kind.__annotations__), path)
    choice = _ok_schema("/v1/completions", "post")["properties"]["choices"]["items"]
    self.assertEqual(list(choice["properties"]), list(protocol.Choice.__annotations__))

  def test_schema_of_a_declared_type(self):
    class Inner(TypedDict):
      """An inner object."""

      ids: list[Annotated[int, lambda limits: {"maximum": limits.vocab_size}]]

    class Outer(TypedDict):
      kind: Literal["a", "b"]
      inner: Inner | None
      scores: dict[str, float]
      note: NotRequired[str]

    self.assertEqual(
      openapi.schema_of(Outer, _LIMITS),
      {
        "type": "object",
        "required": ["kind", "inner", "scores"],
        "properties": {
          "kind": {"type": "string", "enum": ["a", "b"]},
          "inner": {
            "type": "object",
            "description": "An inner object.",
            "required": ["ids"],
            "properties": {
              "ids": {"type": "array", "items": {"type": "integer", "maximum": 257}},
            },
            "nullable": True,
          },
          "scores": {"type": "object", "additionalProperties": {"type": "number"}},
          "note": {"type": "string"},
        },
      },
    )


class ChatDepthTest(absltest.TestCase):
  def test_chat_takes_the_depth_fields(self):
    """A chat request's recurrences and exit reach its Completion as a completion's do, with
    the same bounds (the server's max_recurrences) and errors naming the field."""
    limits = dataclasses.replace(_LIMITS, max_recurrences=8)
    render = lambda messages: messages[-1]["content"]
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    depth = {"recurrences": 2, "exit_criterion": "kl", "exit_threshold": 0.01}
    chat = lambda **f: protocol.parse_chat(
      json.dumps({**body, **f}).encode(), BytesTokenizer(), limits, render
    )
    got = chat(**depth).depth
    want = protocol.parse(
      json.dumps({"prompt": "x", "max_tokens": 1, **depth}).encode(), BytesTokenizer(), limits
    ).depth
    self.assertEqual(got, want)
    self.assertEqual((got.recurrences, got.exit_criterion, got.exit_threshold), (2, "kl", 0.01))
    self.assertIsNone(chat().depth)  # None given: the server's settings.
    with self.assertRaises(protocol.RequestError) as e:
      chat(recurrences=9)
    self.assertEqual(e.exception.param, "recurrences")


if __name__ == "__main__":
  absltest.main()
