"""Self-speculative decoding over HTTP, on the converted tiny Huginn, unshared and greedy: a
completion asking for `speculative_recurrences` and `speculative_tokens` (the openai client's
extra_body) returns the tokens configs/generate.py gives with the same `gen.speculative_*`
settings (and plain decoding's), `usage` carries the tokens its rounds drafted and kept,
`/metrics` vLLM's spec-decode counters; a chat takes the fields too; bad values, and the engine's
refusals, are a 400 naming the field; every page is free afterwards. The parser's rules for the
server's own speculation are checked on their own."""

import dataclasses
import json
import os

import convert_golden_test as golden_lib
import openai
from absl.testing import absltest

import looped_testing as testing
from configs import generate as generate_config
from configs import serve as serve_config
from looped import programs
from looped.data.tokenizers import BytesTokenizer
from looped.engine.requests import DepthParams, GenRequest
from looped.engine.speculative import SpeculativeParams
from looped.server import chat as chat_lib
from looped.server import client, openapi, program, protocol
from server_harness import ServerThread

_PROMPTS = ("the loop runs the same", "a recurrent depth model")
_NEW = 12
# Draft depth and lookahead under which the tiny random Huginn (R = 4) keeps some drafts and
# rejects others (6 of 51 drafted tokens kept over _PROMPTS).
_SPEC = {"speculative_recurrences": 2, "speculative_tokens": 4}
_COUNTERS = {
  "vllm:spec_decode_num_drafts_total": "rounds",
  "vllm:spec_decode_num_draft_tokens_total": "drafted_tokens",
  "vllm:spec_decode_num_accepted_tokens_total": "accepted_tokens",
}


def _counter(text: str, name: str) -> float:
  (line,) = [line for line in text.splitlines() if line.startswith(name + "{")]
  return float(line.split()[-1])


class ServedSpeculationTest(testing.TempDirTestCase):
  def setUp(self):
    super().setUp()
    self.converted = os.path.join(self.tmp, "huginn")
    golden_lib.convert("huginn_tiny", self.converted)

  def _generate(self) -> list:
    config = generate_config.get_config()
    config.gen.checkpoint = self.converted
    testing.set_field(config, "gen.prompts", _PROMPTS)
    config.gen.max_new_tokens = _NEW
    config.gen.stop_at_eos = False
    config.gen.share_kv = False
    for key, value in _SPEC.items():
      testing.set_field(config, f"gen.{key}", value)
    return programs.run(config, os.path.join(self.tmp, "gen"))["generations"]

  def _server(self):
    # Huginn's chat template renders a one-line chat in 80 tokens, past the tiny model's 64-token
    # context: without it the server renders the default transcript (chat_lib.DEFAULT_TEMPLATE).
    path = os.path.join(self.converted, chat_lib.TOKENIZER_CONFIG)
    with open(path) as f:
      tokenizer_config = json.load(f)
    del tokenizer_config["chat_template"]
    with open(path, "w") as f:
      json.dump(tokenizer_config, f)
    config = serve_config.get_config()
    config.serve.checkpoint = self.converted
    config.serve.warmup = False
    config.serve.share_kv = False
    config.serve.model_name = "huginn"
    program.validate(config)
    return program.build(config)

  def _complete(self, server, body: dict) -> tuple[int, dict]:
    return client.request(
      server.url + "/v1/completions", "POST", {"prompt": _PROMPTS[0], "max_tokens": 4, **body}
    )

  def test_served_speculation_is_the_generate_programs(self):
    generations = self._generate()
    self.assertGreater(sum(g.accepted_tokens for g in generations), 0)
    self.assertLess(
      sum(g.accepted_tokens for g in generations), sum(g.drafted_tokens for g in generations)
    )
    app, loop = self._server()
    with ServerThread(app, loop) as server:
      api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
      totals = dict.fromkeys(_COUNTERS.values(), 0)
      for prompt, gen in zip(_PROMPTS, generations):
        out = api.completions.create(
          model="huginn",
          prompt=prompt,
          max_tokens=_NEW,
          temperature=0,
          extra_body={**_SPEC, "ignore_eos": True},
        )
        self.assertEqual(out.choices[0].text, gen.text, prompt)
        usage = out.usage.model_extra
        self.assertEqual(
          (usage["drafted_tokens"], usage["accepted_tokens"]),
          (gen.drafted_tokens, gen.accepted_tokens),
        )
        totals["rounds"] += len(gen.speculative_rounds)
        totals["drafted_tokens"] += gen.drafted_tokens
        totals["accepted_tokens"] += gen.accepted_tokens
      # Unshared greedy speculation emits plain decoding's tokens; a plain request has no
      # speculative usage.
      status, plain = self._complete(
        server, {"max_tokens": _NEW, "temperature": 0, "ignore_eos": True}
      )
      self.assertEqual((status, plain["choices"][0]["text"]), (200, generations[0].text))
      self.assertNotIn("drafted_tokens", plain["usage"])
      _, text = client.request(server.url + "/metrics")
      for name, key in _COUNTERS.items():
        self.assertEqual(_counter(text, name), totals[key], name)
      self._check_chat(server, api, totals)
      self._check_refusals(server, loop)
    self.assertEqual(loop.pages_in_use(), 0)

  def _check_chat(self, server, api, totals: dict) -> None:
    """A streamed chat with speculation: its usage chunk counts its drafts, which the metrics
    add to the completions' totals (its rounds are not in its usage)."""
    chat = [{"role": "user", "content": _PROMPTS[1]}]
    events = list(
      api.chat.completions.create(
        model="huginn",
        messages=chat,
        max_tokens=_NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**_SPEC, "ignore_eos": True},
      )
    )
    usage = events[-1].usage.model_extra
    self.assertGreater(usage["drafted_tokens"], 0)
    self.assertLessEqual(usage["accepted_tokens"], usage["drafted_tokens"])
    _, text = client.request(server.url + "/metrics")
    for name, key in _COUNTERS.items():
      grew = _counter(text, name) - totals[key]
      if key == "rounds":
        self.assertGreater(grew, 0)
      else:
        self.assertEqual(grew, usage[key], name)

  def _check_refusals(self, server, loop) -> None:
    for body, param in (
      ({"speculative_recurrences": -1}, "speculative_recurrences"),
      ({"speculative_recurrences": 5}, "speculative_recurrences"),  # Above R = 4.
      ({"speculative_recurrences": 3, "recurrences": 2}, "speculative_recurrences"),
      ({"speculative_recurrences": 2, "exit_criterion": "kl"}, "speculative_recurrences"),
      ({"speculative_recurrences": "2"}, "speculative_recurrences"),
      ({"speculative_tokens": 0}, "speculative_tokens"),
      ({"speculative_tokens": 9}, "speculative_tokens"),  # Above the engine's lookahead, 8.
    ):
      status, reply = self._complete(server, body)
      self.assertEqual((status, reply["error"]["param"]), (400, param), body)
    status, _ = self._complete(server, {"speculative_recurrences": None, "exit_criterion": "kl"})
    self.assertEqual(status, 200)
    # The engine's own refusal comes in the handler's call (a 400), not from the loop thread.
    request = GenRequest(
      10**6,
      (1, 2, 3),
      depth=DepthParams(exit_criterion="kl"),
      speculative=SpeculativeParams(2, 4),
    )
    with self.assertRaisesRegex(ValueError, "fixed depths"):
      loop.submit([request], [lambda event: None])


_LIMITS = protocol.Limits(
  "tiny", 32, 257, 5, 32, 4, max_recurrences=8, trained_recurrences=4, max_speculative_tokens=8
)


def _parse(limits: protocol.Limits, chat: bool = False, **fields) -> protocol.Completion:
  tokenizer = BytesTokenizer()
  if chat:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, **fields}
    render = lambda messages: messages[-1]["content"]
    return protocol.parse_chat(json.dumps(body).encode(), tokenizer, limits, render)
  body = {"prompt": "x", "max_tokens": 1, **fields}
  return protocol.parse(json.dumps(body).encode(), tokenizer, limits)


class SpeculationFieldsTest(absltest.TestCase):
  def _refused(self, limits, param: str, pattern: str, **fields) -> None:
    for chat in (False, True):
      with self.assertRaisesRegex(protocol.RequestError, pattern) as e:
        _parse(limits, chat, **fields)
      self.assertEqual((e.exception.param, e.exception.status), (param, 400), fields)

  def test_the_request_over_the_servers_setting(self):
    server = dataclasses.replace(_LIMITS, speculative=SpeculativeParams(2, 3))
    for chat in (False, True):
      self.assertIsNone(_parse(server, chat).speculative)  # The engine's default applies.
      self.assertIsNone(_parse(server, chat, speculative_tokens=None).speculative)
      got = _parse(server, chat, speculative_tokens=5).speculative
      self.assertEqual(got, SpeculativeParams(2, 5))
      got = _parse(server, chat, speculative_recurrences=6, recurrences=6).speculative
      self.assertEqual(got, SpeculativeParams(6, 3))
      off = _parse(server, chat, speculative_recurrences=0, exit_criterion="kl").speculative
      self.assertEqual(off, SpeculativeParams(0, 3))

  def test_a_clash_with_the_servers_speculation_names_the_requests_field(self):
    server = dataclasses.replace(_LIMITS, speculative=SpeculativeParams(3, 4))
    self._refused(server, "recurrences", r"\(the server's\) must be at most the 2", recurrences=2)
    self._refused(server, "exit_criterion", "fixed depths", exit_criterion="kl")
    self._refused(
      _LIMITS, "speculative_recurrences", "must be at most the 4", speculative_recurrences=5
    )
    # The request's recurrences 0 is the model's trained R, which bounds the draft.
    _parse(_LIMITS, speculative_recurrences=4, recurrences=0)

  def test_the_document_lists_the_fields_and_usage_keys(self):
    document = openapi.document(_LIMITS)
    for path in ("/v1/completions", "/v1/chat/completions"):
      post = document["paths"][path]["post"]
      fields = post["requestBody"]["content"]["application/json"]["schema"]["properties"]
      self.assertEqual(
        (fields["speculative_recurrences"]["maximum"], fields["speculative_tokens"]["maximum"]),
        (_LIMITS.max_recurrences, _LIMITS.max_speculative_tokens),
      )
      self.assertTrue(fields["speculative_recurrences"]["nullable"])
      ok = post["responses"]["200"]["content"]["application/json"]["schema"]
      usage = ok["properties"]["usage"]
      self.assertLessEqual({"drafted_tokens", "accepted_tokens"}, set(usage["properties"]))
      self.assertNotIn("drafted_tokens", usage["required"])

  def test_a_server_that_does_not_speculate_says_so(self):
    plain = dataclasses.replace(_LIMITS, speculates=False)
    self._refused(plain, "speculative_recurrences", "does not speculate", speculative_recurrences=1)
    self.assertEqual(_parse(plain, speculative_recurrences=0).speculative, SpeculativeParams(0))


if __name__ == "__main__":
  absltest.main()
