"""The server driven from its own OpenAPI document by an API fuzzer, and its request parser by a
property test.

schemathesis (a maintained OpenAPI fuzzer built on hypothesis) sends requests the document
allows (positive) and requests it forbids (negative) to every route: no response may be a 5xx,
every response must match the document (status, content type, JSON schema), every forbidden
request must be refused with a 4xx, the server must stay healthy and no KV page may be held at
the end. The document says every optional field is nullable, so null (meaning the default) is
among what it sends. The number of cases is bounded and derandomized, so a run is the same every
time. The parsers themselves also take arbitrary bytes, arbitrary JSON and integers beyond
int()'s digit limit in every field: each is parsed or refused by name, never an exception.
"""

import json
import string

import hypothesis
import schemathesis
from absl.testing import absltest
from hypothesis import strategies as st
from schemathesis import checks as st_checks
from schemathesis.generation import GenerationMode

from looped.data.tokenizers import BytesTokenizer
from looped.server import chat, client, openapi, program, protocol
from server_harness import ServerThread, tiny_engine

_CASES = 30  # Per route and mode.
_SETTINGS = hypothesis.settings(
  max_examples=_CASES,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=list(hypothesis.HealthCheck),
)
_CHECKS = [
  st_checks.not_a_server_error,
  st_checks.status_code_conformance,
  st_checks.content_type_conformance,
  st_checks.response_schema_conformance,
]


class ServerFuzzTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    engine, tok = tiny_engine(row_buckets=(4,), token_buckets=(16,))
    app, cls.loop = program.serve_engine(
      engine, tok, "tiny", max_waiting=16, max_logprobs=5, max_body_bytes=1 << 16
    )
    cls.server = ServerThread(app, cls.loop).__enter__()

  @classmethod
  def tearDownClass(cls):
    cls.server.__exit__(None, None, None)
    super().tearDownClass()

  def _run(self, operation, mode, checks, statuses: dict) -> None:
    @_SETTINGS
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
      response = case.call(base_url=self.server.url, timeout=60)
      statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
      case.validate_response(response, checks=checks)

    run()

  def _fuzz(self, mode: GenerationMode) -> dict:
    """Runs every route's cases in `mode`; returns status counts per route."""
    schema = schemathesis.openapi.from_url(self.server.url + "/openapi.json")
    seen = {}
    for result in schema.get_all_operations():
      operation = result.ok()
      if mode == GenerationMode.NEGATIVE and operation.method.upper() != "POST":
        continue  # No body or parameter to make invalid.
      checks = _CHECKS + ([st_checks.negative_data_rejection] if mode.is_negative else [])
      self._run(operation, mode, checks, seen.setdefault(operation.label, {}))
    self.server.wait_idle()
    self.assertEqual(self.loop.pages_in_use(), 0)
    self.assertEqual(client.request(self.server.url + "/health"), (200, {"status": "ok"}))
    return seen

  def test_every_field_at_its_boundaries(self):
    """schemathesis' coverage phase: for every field, its boundary values and values just
    outside them (each enum value, each bound, a wrong type), deterministically."""
    schema = schemathesis.openapi.from_url(self.server.url + "/openapi.json")
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    seen = {}
    for result in schema.get_all_operations():
      operation = result.ok()
      config = schema.config.generation_for(operation=operation)
      for case in schema.iter_coverage_cases(
        operation, generation_modes=modes, generation_config=config
      ):
        response = case.call(base_url=self.server.url, timeout=60)
        negative = case.meta.generation.mode.is_negative
        key = (operation.label, "negative" if negative else "positive")
        seen.setdefault(key, {}).setdefault(response.status_code, 0)
        seen[key][response.status_code] += 1
        checks = _CHECKS + ([st_checks.negative_data_rejection] if negative else [])
        case.validate_response(response, checks=checks)
    self.server.wait_idle()
    self.assertEqual(self.loop.pages_in_use(), 0)
    self.assertGreater(seen[("POST /v1/completions", "positive")].get(200, 0), 10, seen)
    self.assertGreater(sum(seen[("POST /v1/completions", "negative")].values()), 50, seen)
    self.assertGreater(seen[("POST /v1/chat/completions", "positive")].get(200, 0), 5, seen)
    self.assertGreater(sum(seen[("POST /v1/chat/completions", "negative")].values()), 50, seen)
    self.assertFalse([s for counts in seen.values() for s in counts if s >= 500], seen)

  def test_requests_the_document_allows(self):
    seen = self._fuzz(GenerationMode.POSITIVE)
    completions = seen["POST /v1/completions"]
    self.assertGreater(completions.get(200, 0), 0, completions)  # Some were served...
    self.assertFalse([s for counts in seen.values() for s in counts if s >= 500], seen)
    chats = seen["POST /v1/chat/completions"]
    self.assertGreater(sum(chats.values()), _CASES // 2, chats)

  def test_requests_the_document_forbids(self):
    seen = self._fuzz(GenerationMode.NEGATIVE)
    completions = seen["POST /v1/completions"]
    self.assertGreater(sum(completions.values()), _CASES // 2, completions)
    self.assertFalse([s for counts in seen.values() for s in counts if s >= 500], seen)
    chats = seen["POST /v1/chat/completions"]
    self.assertGreater(sum(chats.values()), _CASES // 2, chats)


def _json_values(depth: int = 3):
  leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
  return st.recursive(
    leaves,
    lambda inner: (
      st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
  )


_LIMITS = protocol.Limits("tiny", 32, 257, 5, 32, 4, max_batch=4)
_TEMPLATE = chat.ChatTemplate(chat.DEFAULT_TEMPLATE, "default")


def _valid_bodies():
  """Bodies every field of which is valid on its own (the parser may still refuse a
  combination, e.g. a prompt plus max_tokens over the context)."""
  text = st.text(alphabet=string.printable, min_size=1, max_size=10)
  ids = st.lists(st.integers(0, 256), min_size=1, max_size=10)
  return st.fixed_dictionaries(
    {"prompt": text | ids | st.lists(text | ids, min_size=1, max_size=4)},
    optional={  # Null is every optional field's default.
      "max_tokens": st.integers(1, 40) | st.none(),
      "temperature": st.floats(0, 5) | st.none(),
      "top_p": st.floats(0, 1, exclude_min=True) | st.none(),
      "top_k": st.integers(-1, 257) | st.none(),
      "seed": st.integers(0, 2**31 - 1) | st.none(),
      "stop": text | st.lists(text, min_size=1, max_size=4) | st.none(),
      "logprobs": st.integers(0, 5) | st.none(),
      "echo": st.booleans() | st.none(),
      "ignore_eos": st.booleans() | st.none(),
      "user": st.text(max_size=5) | st.none(),
      "n": st.just(1) | st.none(),
      "stream": st.just(False) | st.none(),
    },
  )


def _huge_integer_bodies():
  """(endpoint, raw body, the field to be named) with an integer beyond int()'s digit limit
  (4,300) in one of the endpoint's fields, or inside a prompt or a message (json.dumps cannot
  write one)."""
  digits = st.integers(4301, 6000).map(lambda n: b"-" * (n % 2) + b"7" * n)
  heads = {
    "completions": b'"prompt": "a"',
    "chat": b'"messages": [{"role": "user", "content": "a"}]',
  }
  names = [("completions", n) for n in sorted(protocol.FIELDS - {"prompt"})]
  names += [("chat", n) for n in sorted(protocol.CHAT_FIELDS - {"messages"})]
  field = st.builds(
    lambda at, d: (at[0], b'{%s, "%s": %s}' % (heads[at[0]], at[1].encode(), d), at[1]),
    st.sampled_from(names),
    digits,
  )
  nested = st.builds(
    lambda case, d: (case[0], case[1] % d, case[2]),
    st.sampled_from(
      [
        ("completions", b'{"prompt": [1, %s]}', "prompt"),
        ("completions", b'{"prompt": ["a", [%s]]}', "prompt"),
        ("chat", b'{"messages": [{"role": "user", "content": %s}]}', "messages[0].content"),
        ("chat", b'{"messages": [{"role": %s, "content": "a"}]}', "messages[0].role"),
        (
          "chat",
          b'{"messages": [{"role": "user", "content": [{"type": "text", "text": %s}]}]}',
          "messages[0].content[0].text",
        ),
      ]
    ),
    digits,
  )
  return field | nested


class ParserPropertyTest(absltest.TestCase):
  @hypothesis.settings(max_examples=400, deadline=None, derandomize=True, database=None)
  @hypothesis.given(st.binary(max_size=64) | _json_values().map(lambda v: json.dumps(v).encode()))
  def test_any_body_is_parsed_or_refused_by_name(self, raw):
    try:
      protocol.parse(raw, BytesTokenizer(), _LIMITS)
    except protocol.RequestError as e:
      self.assertIn(e.status, (400, 404))
      self.assertTrue(str(e))

  @hypothesis.settings(max_examples=400, deadline=None, derandomize=True, database=None)
  @hypothesis.given(_valid_bodies())
  def test_a_valid_body_keeps_its_values_and_fits_the_engine(self, body):
    try:
      parsed = protocol.parse(json.dumps(body).encode(), BytesTokenizer(), _LIMITS)
    except protocol.RequestError as e:
      # Only a combination may be refused: the context or the pool, a streamed batch.
      self.assertIn(e.param, ("prompt", "max_tokens"), str(e))
      return
    given = lambda name, default: default if body.get(name) is None else body[name]
    self.assertEqual(parsed.max_tokens, given("max_tokens", 16))
    self.assertEqual(parsed.top_k, max(given("top_k", 0), 0))
    self.assertLessEqual(parsed.top_k, _LIMITS.vocab_size)
    self.assertTrue(0 <= parsed.seed < 2**31)
    for p in parsed.prompts:
      self.assertLessEqual(len(p.tokens) + parsed.max_tokens, _LIMITS.max_model_len)
      self.assertTrue(all(0 <= t < _LIMITS.vocab_size for t in p.tokens))
    if isinstance(body["prompt"], str):
      self.assertEqual(parsed.prompts[0].text, body["prompt"])

  @hypothesis.settings(max_examples=400, deadline=None, derandomize=True, database=None)
  @hypothesis.given(st.binary(max_size=64) | _json_values().map(lambda v: json.dumps(v).encode()))
  def test_any_chat_body_is_parsed_or_refused_by_name(self, raw):
    try:
      protocol.parse_chat(raw, BytesTokenizer(), _LIMITS, _TEMPLATE.render)
    except protocol.RequestError as e:
      self.assertIn(e.status, (400, 404))
      self.assertTrue(str(e))

  @hypothesis.settings(max_examples=200, deadline=None, derandomize=True, database=None)
  @hypothesis.given(_huge_integer_bodies())
  def test_huge_integers_are_refused_by_name(self, case):
    endpoint, raw, name = case
    with self.assertRaises(protocol.RequestError) as e:
      if endpoint == "completions":
        protocol.parse(raw, BytesTokenizer(), _LIMITS)
      else:
        protocol.parse_chat(raw, BytesTokenizer(), _LIMITS, _TEMPLATE.render)
    self.assertEqual((e.exception.status, e.exception.param), (400, name), str(e.exception))
    self.assertLess(len(str(e.exception)), 400)


class OpenApiDocumentTest(absltest.TestCase):
  def test_is_valid_openapi(self):
    schema = schemathesis.openapi.from_dict(openapi.document(_LIMITS))
    labels = {r.ok().label for r in schema.get_all_operations()}
    self.assertIn("POST /v1/completions", labels)
    self.assertIn("POST /v1/chat/completions", labels)


if __name__ == "__main__":
  absltest.main()
