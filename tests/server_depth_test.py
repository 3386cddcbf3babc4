"""Test-time depth over HTTP, on the converted tiny Huginn: a completion asking for its own
`recurrences`, `exit_criterion` and `exit_threshold` (the openai client's extra_body) returns the
tokens configs/generate.py gives with the same settings, `usage` carries their mean recurrences,
`/metrics` a histogram of recurrences per token, every page is free afterwards; bad values are a
400 naming the field, and the OpenAPI document lists the fields."""

import os

import convert_golden_test as golden_lib
import openai
from absl.testing import absltest

import looped_testing as testing
from configs import generate as generate_config
from configs import serve as serve_config
from looped import programs
from looped.server import client, program
from server_harness import ServerThread

_PROMPTS = ("the loop runs the same", "a recurrent depth model")
_NEW = 6
# Settings under which the tiny random Huginn exits its tokens at several depths, deeper than
# it was trained (R = 4).
_DEPTH = {"recurrences": 6, "exit_criterion": "kl", "exit_threshold": 0.25}


class ServedDepthTest(testing.TempDirTestCase):
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
    config.gen.max_recurrences = 8
    for key, value in _DEPTH.items():
      testing.set_field(config, f"gen.{key}", value)
    return programs.run(config, os.path.join(self.tmp, "gen"))["generations"]

  def _server(self):
    config = serve_config.get_config()
    config.serve.checkpoint = self.converted
    config.serve.warmup = False
    config.serve.max_recurrences = 8
    config.serve.model_name = "huginn"
    program.validate(config)
    return program.build(config)

  def test_served_depth_is_the_generate_programs(self):
    generations = self._generate()
    self.assertGreater(len({d for g in generations for d in g.recurrences}), 1)
    app, loop = self._server()
    with ServerThread(app, loop) as server:
      api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
      for prompt, gen in zip(_PROMPTS, generations):
        out = api.completions.create(
          model="huginn",
          prompt=prompt,
          max_tokens=_NEW,
          temperature=0,
          extra_body={**_DEPTH, "ignore_eos": True},
        )
        self.assertEqual(out.choices[0].text, gen.text, prompt)
        mean = out.usage.model_extra["mean_recurrences"]
        self.assertAlmostEqual(mean, sum(gen.recurrences) / len(gen.recurrences))
      # The same prompt at the served default (the model's R = 4) runs 4 per token.
      status, plain = client.request(
        server.url + "/v1/completions",
        "POST",
        {"prompt": _PROMPTS[0], "max_tokens": 2, "temperature": 0},
      )
      self.assertEqual((status, plain["usage"]["mean_recurrences"]), (200, 4.0))
      status, text = client.request(server.url + "/metrics")
      buckets = {
        line.split('le="')[1].split('"')[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("looped:recurrences_per_token_bucket")
      }
      tokens = sum(len(g.recurrences) for g in generations) + 2
      self.assertEqual(buckets["+Inf"], tokens)
      depths = [d for g in generations for d in g.recurrences] + [4, 4]
      for le in ("2", "4", "6"):
        self.assertEqual(buckets[le], sum(d <= float(le) for d in depths))
      for body, param in (
        ({"recurrences": 9}, "recurrences"),
        ({"recurrences": -1}, "recurrences"),
        ({"exit_criterion": "entropy"}, "exit_criterion"),
        ({"exit_criterion": "gate"}, "exit_criterion"),  # Huginn has no exit gate.
        ({"exit_criterion": "argmax-stability", "exit_threshold": 1.5}, "exit_threshold"),
        ({"exit_threshold": -0.1}, "exit_threshold"),
        ({"min_recurrences": 99}, "min_recurrences"),
      ):
        status, reply = client.request(
          server.url + "/v1/completions", "POST", {"prompt": "the", "max_tokens": 1, **body}
        )
        self.assertEqual((status, reply["error"]["param"]), (400, param), body)
      status, document = client.request(server.url + "/openapi.json")
      fields = str(document)
      for name in ("recurrences", "exit_criterion", "exit_threshold", "mean_recurrences"):
        self.assertIn(name, fields)
    self.assertEqual(loop.pages_in_use(), 0)


if __name__ == "__main__":
  absltest.main()
