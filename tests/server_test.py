"""The HTTP server against independent references, on a trained smoke model, both layouts.

A real server (uvicorn on 127.0.0.1, in a thread) serves the model configs/generate.py restores;
greedy completions must equal the batch program's tokens and logprobs, streamed chunks must
concatenate to the non-streamed text, and echoed prompt logprobs must equal token-by-token
decoding of the restored params (no engine). The openai client and lm-evaluation-harness's
`local-completions` parsing read the responses as they would in use; so do the openai client's
chat API and lm-evaluation-harness's `local-chat-completions` (a chat of this bytes-tokenizer
model is rendered with chat.DEFAULT_TEMPLATE and answered as the completion of that prompt).
"""

import json
import math
import os
import tempfile
import threading
import time

import engine_reference
import jax
import jax.numpy as jnp
import numpy as np
import openai
from absl.testing import absltest, parameterized

import looped_testing as testing
from configs import generate as generate_config
from configs import serve as serve_config
from looped import programs
from looped.data.tokenizers import BytesTokenizer
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM
from looped.server import chat, client, program
from looped.server.app import token_text
from looped.train import trainer
from server_harness import ServerThread

_TRAIN = {
  "train.num_steps": 3,
  "train.checkpoint_every": 3,
  "train.log_every": 3,
  "train.eval_every": 3,
  "train.warmup_steps": 1,
}
_PROMPTS = ["def f(x):", "import os", "class A:", "for i in range("]
_NEW = 8
_LAYOUTS = {"shared": True, "unshared": False}
_TIMEOUT_S = 120
_BLOCK = serve_config.get_config("smoke").serve.prefill_block  # The served prefill block.


def _serve_config(checkpoint, share_kv, **overrides):
  config = serve_config.get_config("smoke")
  config.model.max_seq_len = testing.TINY_RUN_OVERRIDES["model.max_seq_len"]
  config.serve.checkpoint = checkpoint
  config.serve.share_kv = share_kv
  config.serve.warmup = False  # Compiles only the shapes it meets (warm-up: server_hostile_test).
  for key, value in overrides.items():
    testing.set_field(config, key, value)
  return config


def _reference_logprobs(model, params, prompt, num_new, share_kv):
  """log_softmax at each position as the server computes it (docs/design.md §3: the prompt in
  prefill blocks, each later token on its own), each request alone on the model's dense cache
  (engine_reference.py): row t is the distribution of token t + 1, for the prompt and the
  first num_new - 1 greedy tokens."""
  request = GenRequest(0, tuple(prompt), SamplingParams(max_new_tokens=num_new))
  _, logits = engine_reference.block_reference(
    model.cfg, params, [request], share_kv=share_kv, block=_BLOCK
  )
  rows = [logits[0][p] for p in sorted(logits[0])]
  return np.stack([np.asarray(jax.nn.log_softmax(jnp.asarray(r, jnp.float32))) for r in rows])


def _lm_eval_parse_logprobs(choice, ctxlen):
  """lm-evaluation-harness LocalCompletionsAPI.parse_logprobs, for one choice (same fields,
  same slicing: the prompt's continuation tokens, without the one generated token)."""
  token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
  top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
  is_greedy = all(tok == max(top.values()) for tok, top in zip(token_logprobs, top_logprobs))
  return sum(token_logprobs), is_greedy


def _lm_eval_chat_payload(messages, gen_kwargs: dict, model: str, seed: int = 1234) -> dict:
  """lm-evaluation-harness 0.4.13 LocalChatCompletion._create_payload for a generate_until
  request (the same pops and defaults; its EOS string is None without a tokenizer)."""
  gen_kwargs = dict(gen_kwargs)
  gen_kwargs.pop("do_sample", False)
  if "max_tokens" in gen_kwargs:
    max_tokens = gen_kwargs.pop("max_tokens")
  else:
    max_tokens = gen_kwargs.pop("max_gen_toks", 256)
  temperature = gen_kwargs.pop("temperature", 0)
  stop = gen_kwargs.pop("until", None) or []
  stop = [stop] if isinstance(stop, str) else stop
  return {
    "messages": messages,
    "model": model,
    "max_tokens": max_tokens,
    "temperature": temperature,
    "stop": stop[:4],
    "seed": seed,
    **gen_kwargs,
  }


def _lm_eval_parse_generations(out: dict) -> list[str]:
  """lm-evaluation-harness 0.4.13 LocalChatCompletion.parse_generations (no think token)."""
  texts = [None] * len(out["choices"])
  for choice in out["choices"]:
    texts[choice["index"]] = choice["message"]["content"]
  return texts


class ServerTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.train_dir = os.path.join(cls._tmp.name, "train")
    config = testing.smoke_config(_TRAIN)
    trainer.run(config, cls.train_dir)
    cls.model = LoopedLM(model_lib.from_config(config.model))
    cls.params = testing.saved_params(config.model, cls.train_dir)
    cls.tok = BytesTokenizer()
    cls.generations, cls.servers = {}, {}
    for name, share in _LAYOUTS.items():
      gen = generate_config.get_config("smoke")
      gen.model.max_seq_len = testing.TINY_RUN_OVERRIDES["model.max_seq_len"]
      gen.gen.checkpoint = cls.train_dir
      testing.set_field(gen, "gen.prompts", tuple(_PROMPTS))
      gen.gen.max_new_tokens = _NEW
      gen.gen.share_kv = share
      workdir = os.path.join(cls._tmp.name, f"gen_{name}")
      programs.run(gen, workdir)
      with open(os.path.join(workdir, "generations.jsonl")) as f:
        cls.generations[name] = [json.loads(line) for line in f]
      app, loop = program.build(_serve_config(cls.train_dir, share, **{"serve.max_waiting": 4}))
      cls.servers[name] = ServerThread(app, loop).__enter__()

  @classmethod
  def tearDownClass(cls):
    for server in cls.servers.values():
      server.__exit__(None, None, None)
    cls._tmp.cleanup()
    super().tearDownClass()

  def tearDown(self):
    for server in self.servers.values():  # Every page is free after every test.
      server.wait_idle()
      self.assertEqual(server.loop.pages_in_use(), 0)
    super().tearDown()

  def _post(self, layout, body, **kw):
    url = self.servers[layout].url + "/v1/completions"
    return client.request(url, "POST", body, timeout_s=_TIMEOUT_S, **kw)

  def _greedy(self, prompt, **extra):
    return {"prompt": prompt, "max_tokens": _NEW, "temperature": 0, **extra}

  @parameterized.parameters("shared", "unshared")
  def test_greedy_completions_equal_the_generate_program(self, layout):
    for prompt, want in zip(_PROMPTS, self.generations[layout]):
      status, body = self._post(layout, self._greedy(prompt, logprobs=0))
      self.assertEqual(status, 200, body)
      choice = body["choices"][0]
      self.assertEqual(choice["text"], want["text"])
      self.assertEqual(
        choice["logprobs"]["tokens"], [token_text(self.tok, t) for t in want["tokens"]]
      )
      np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want["logprobs"], atol=1e-5)
      reason = {"length": "length", "stop_token": "stop", "stop_string": "stop"}
      self.assertEqual(choice["finish_reason"], reason[want["finish_reason"]])
      self.assertEqual(body["usage"]["completion_tokens"], len(want["tokens"]))
      self.assertEqual(body["usage"]["prompt_tokens"], len(self.tok.encode(prompt)))
    # A batch of prompts in one request: one choice per prompt, in order.
    status, body = self._post(layout, self._greedy(_PROMPTS))
    self.assertEqual(status, 200, body)
    self.assertEqual([c["index"] for c in body["choices"]], list(range(len(_PROMPTS))))
    self.assertEqual(
      [c["text"] for c in body["choices"]], [g["text"] for g in self.generations[layout]]
    )

  @parameterized.parameters("shared", "unshared")
  def test_stream_concatenates_to_the_completion(self, layout):
    url = self.servers[layout].url + "/v1/completions"
    want = self.generations[layout][0]["text"]
    # A stop string inside the greedy text: the text is cut before it, streamed or not, and
    # the stream never sends a prefix of it that it would have to take back.
    stop = want[2:4]
    for extra in ({}, {"stop": [stop]}, {"echo": True, "logprobs": 2}):
      status, full = self._post(layout, self._greedy(_PROMPTS[0], **extra))
      self.assertEqual(status, 200, full)
      stream = client.Stream(url, self._greedy(_PROMPTS[0], **extra), timeout_s=_TIMEOUT_S)
      chunks = list(stream)
      stream.close()
      self.assertTrue(stream.done)
      text = "".join(c["choices"][0]["text"] for c in chunks)
      self.assertEqual(text, full["choices"][0]["text"])
      self.assertEqual(
        chunks[-1]["choices"][0]["finish_reason"], full["choices"][0]["finish_reason"]
      )
      if "stop" in extra:
        self.assertEqual(text, want[: want.index(stop)])
        self.assertEqual(full["choices"][0]["finish_reason"], "stop")
      if "logprobs" in extra:
        streamed = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
        self.assertEqual(streamed, full["choices"][0]["logprobs"]["token_logprobs"])

  @parameterized.parameters("shared", "unshared")
  def test_echo_logprobs_equal_each_request_decoded_alone(self, layout):
    prompt = _PROMPTS[3]
    status, body = self._post(layout, self._greedy(prompt, echo=True, logprobs=3, max_tokens=4))
    self.assertEqual(status, 200, body)
    choice = body["choices"][0]
    tokens = [int(t) for t in self.tok.encode(prompt)]
    n = len(tokens)
    generated = self.generations[layout][3]["tokens"][:4]  # Greedy: the same first tokens.
    ref = _reference_logprobs(self.model, self.params, tokens, len(generated), _LAYOUTS[layout])
    lp = choice["logprobs"]
    self.assertTrue(choice["text"].startswith(prompt))
    self.assertIsNone(lp["token_logprobs"][0])
    self.assertIsNone(lp["top_logprobs"][0])
    everything = tokens + generated
    want = [ref[i - 1, everything[i]] for i in range(1, len(everything))]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4)
    for i in range(1, len(everything)):
      top = sorted(lp["top_logprobs"][i].values(), reverse=True)
      np.testing.assert_allclose(top, np.sort(ref[i - 1])[::-1][:3], atol=1e-4)
    self.assertEqual(lp["tokens"], [token_text(self.tok, t) for t in everything])
    self.assertEqual(
      lp["text_offset"], [len(self.tok.decode(everything[:i])) for i in range(len(everything))]
    )
    self.assertLen(lp["tokens"], n + len(generated))

  def test_lm_eval_local_completions_reads_loglikelihoods(self):
    # lm-eval's loglikelihood payload: token ids (context + continuation), echo, 1 new token.
    context, continuation = "for i in", " range("
    ids = [int(t) for t in self.tok.encode(context + continuation)]
    ctxlen = len(self.tok.encode(context))
    payload = {
      "model": "train",
      "prompt": [ids],
      "temperature": 0,
      "max_tokens": 1,
      "logprobs": 1,
      "seed": 1234,
      "echo": True,
    }
    for layout, share in _LAYOUTS.items():
      status, body = self._post(layout, payload)
      self.assertEqual(status, 200, body)
      choice = body["choices"][0]
      for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        self.assertLen(choice["logprobs"][field], len(ids) + 1, field)
      logprob, is_greedy = _lm_eval_parse_logprobs(choice, ctxlen)
      ref = _reference_logprobs(self.model, self.params, ids, 1, share)
      want = sum(ref[i - 1, ids[i]] for i in range(ctxlen, len(ids)))
      self.assertAlmostEqual(logprob, want, delta=1e-4)
      self.assertEqual(
        is_greedy, all(ref[i - 1].argmax() == ids[i] for i in range(ctxlen, len(ids)))
      )

  def test_tokenizer_endpoints_for_lm_eval_remote_tokenizer(self):
    # lm-eval's check_remote_tokenizer_support: /tokenizer_info has eos_token, /tokenize
    # returns a token list; its remote tokenizer then encodes and decodes through them.
    url = self.servers["shared"].url
    status, info = client.request(url + "/tokenizer_info")
    self.assertEqual(status, 200)
    self.assertIn("eos_token", info)
    self.assertEqual(info["eos_token_id"], self.tok.eos_id)  # lm-eval's prefix token.
    self.assertEqual(info["model_max_length"], 32)
    text = "déf f(x):"
    status, out = client.request(
      url + "/tokenize", "POST", {"prompt": text, "add_special_tokens": False}
    )
    self.assertEqual((status, out["tokens"]), (200, [int(t) for t in self.tok.encode(text)]))
    status, out = client.request(url + "/detokenize", "POST", {"tokens": out["tokens"]})
    self.assertEqual((status, out["prompt"]), (200, text))
    status, out = client.request(url + "/detokenize", "POST", {"tokens": [1, 999]})
    self.assertEqual((status, out["error"]["param"]), (400, "tokens"))

  def test_openai_client(self):
    for layout in _LAYOUTS:
      api = openai.OpenAI(
        base_url=self.servers[layout].url + "/v1", api_key="unused", max_retries=0
      )
      self.assertEqual([m.id for m in api.models.list().data], ["train"])
      want = self.generations[layout][1]
      out = api.completions.create(
        model="train", prompt=_PROMPTS[1], max_tokens=_NEW, temperature=0
      )
      self.assertEqual(out.choices[0].text, want["text"])
      self.assertEqual(out.usage.completion_tokens, len(want["tokens"]))
      events = api.completions.create(
        model="train", prompt=_PROMPTS[1], max_tokens=_NEW, temperature=0, stream=True
      )
      self.assertEqual("".join(e.choices[0].text for e in events), want["text"])
      with self.assertRaises(openai.BadRequestError) as e:
        api.completions.create(model="train", prompt="x", max_tokens=0)
      self.assertIn("max_tokens", str(e.exception))

  def test_openai_client_chat(self):
    # No chat template in a bytes-tokenizer checkpoint: the default transcript is the prompt.
    messages = [{"role": "user", "content": "def f("}]
    prompt = chat.ChatTemplate(chat.DEFAULT_TEMPLATE, "default").render(messages)
    for layout in _LAYOUTS:
      status, want = self._post(layout, self._greedy(prompt, max_tokens=6))
      self.assertEqual(status, 200, want)
      api = openai.OpenAI(
        base_url=self.servers[layout].url + "/v1", api_key="unused", max_retries=0
      )
      out = api.chat.completions.create(
        model="train", messages=messages, max_tokens=6, temperature=0
      )
      self.assertEqual(out.object, "chat.completion")
      self.assertEqual(out.choices[0].message.content, want["choices"][0]["text"])
      self.assertEqual(out.choices[0].finish_reason, want["choices"][0]["finish_reason"])
      self.assertEqual(out.usage.prompt_tokens, len(self.tok.encode(prompt)))
      self.assertEqual(out.usage.completion_tokens, want["usage"]["completion_tokens"])
      events = list(
        api.chat.completions.create(
          model="train",
          messages=messages,
          max_tokens=6,
          temperature=0,
          stream=True,
          stream_options={"include_usage": True},
        )
      )
      text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
      self.assertEqual(text, want["choices"][0]["text"])
      self.assertEqual(events[-1].usage.completion_tokens, out.usage.completion_tokens)
      with self.assertRaises(openai.BadRequestError) as e:
        api.chat.completions.create(model="train", messages=[{"role": "user", "content": ""}])
      self.assertIn("messages[0].content", str(e.exception))

  def test_lm_eval_local_chat_completions_generates(self):
    # lm-eval's generate_until through local-chat-completions: its payload (stop strings,
    # max_gen_toks, a seed, temperature 0) and its reading of the reply give the completion of
    # the rendered chat, cut at the stop string.
    messages = [{"role": "user", "content": "for"}]  # The 32-token context holds 8 more.
    gen_kwargs = {"until": ["):", "\n\n"], "max_gen_toks": 8, "do_sample": False}
    prompt = chat.ChatTemplate(chat.DEFAULT_TEMPLATE, "default").render(messages)
    for layout in _LAYOUTS:
      url = self.servers[layout].url + "/v1/chat/completions"
      payload = _lm_eval_chat_payload(messages, gen_kwargs, model="train")
      status, out = client.request(url, "POST", payload, timeout_s=_TIMEOUT_S)
      self.assertEqual(status, 200, out)
      status, want = self._post(
        layout, self._greedy(prompt, max_tokens=8, stop=["):", "\n\n"], seed=1234)
      )
      self.assertEqual(status, 200, want)
      self.assertEqual(_lm_eval_parse_generations(out), [want["choices"][0]["text"]])

  def test_bad_requests_get_400_naming_the_field(self):
    layout = "shared"
    good = self._greedy("x", max_tokens=2)
    cases = [
      ({**good, "best_of": 2}, "best_of"),
      ({**good, "max_tokens": "2"}, "max_tokens"),
      ({**good, "max_tokens": 0}, "max_tokens"),
      ({**good, "max_tokens": -3}, "max_tokens"),
      ({**good, "max_tokens": 40}, "max_tokens"),  # 1 + 40 > the 32-token context.
      ({**good, "prompt": "x" * 32}, "prompt"),  # Alone fills the context.
      ({**good, "prompt": ""}, "prompt"),
      ({**good, "prompt": [1, 300]}, "prompt"),  # Token id outside the vocabulary.
      ({**good, "prompt": 7}, "prompt"),
      ({k: v for k, v in good.items() if k != "prompt"}, "prompt"),
      ({**good, "temperature": -1}, "temperature"),
      ({**good, "temperature": "hot"}, "temperature"),
      ({**good, "top_p": 0}, "top_p"),
      ({**good, "top_k": 1.5}, "top_k"),
      ({**good, "seed": -1}, "seed"),
      ({**good, "stop": [1]}, "stop"),
      ({**good, "n": 2}, "n"),
      ({**good, "logprobs": 9}, "logprobs"),
      ({**good, "echo": "yes"}, "echo"),
      ({**good, "stream": 1}, "stream"),
    ]
    for body, field in cases:
      status, out = self._post(layout, body)
      self.assertEqual(status, 400, (body, out))
      self.assertEqual(out["error"]["param"], field, (body, out))
      self.assertIn(field, out["error"]["message"])
    raw = [
      (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite"),
      (b'{"prompt": "x", "max_tokens": Infinity}', "max_tokens", "integer"),
      (b'{"prompt": "\xff\xfe"}', None, "not UTF-8"),
      (b'{"prompt": ', None, "not JSON"),
      (b'["x"]', None, "JSON object"),
    ]
    for data, field, message in raw:
      status, out = self._post(layout, None, raw=data)
      self.assertEqual(status, 400, (data, out))
      self.assertEqual(out["error"]["param"], field)
      self.assertIn(message, out["error"]["message"])
    status, out = self._post(layout, {**good, "model": "other"})
    self.assertEqual((status, out["error"]["param"]), (404, "model"))
    # The server still serves, and the refusals were counted.
    status, out = self._post(layout, self._greedy(_PROMPTS[0]))
    self.assertEqual(
      (status, out["choices"][0]["text"]), (200, self.generations[layout][0]["text"])
    )
    metrics = _scrape(self.servers[layout].url)
    self.assertGreaterEqual(
      metrics['looped:requests_rejected_total{model_name="train",reason="invalid"}'],
      len(cases) + len(raw) + 1,
    )

  def test_full_queue_answers_429_and_the_queued_requests_complete(self):
    server = self.servers["unshared"]
    executor = server.loop.engine.executor
    gate = threading.Event()
    real = executor.execute

    def held(batch):  # Holds the engine inside its next step, so arrivals stay queued.
      gate.wait(_TIMEOUT_S)
      return real(batch)

    executor.execute = held
    results = []
    try:
      threads = [
        threading.Thread(target=lambda p=p: results.append(self._post("unshared", self._greedy(p))))
        for p in _PROMPTS + _PROMPTS[:1]  # One is admitted into the held step, 4 wait.
      ]
      threads[0].start()
      _until(lambda: server.loop.num_running() == 1)
      for t in threads[1:]:
        t.start()
      _until(lambda: server.loop.num_waiting() == 4)  # serve.max_waiting
      status, out = self._post("unshared", self._greedy("x"))
      self.assertEqual(status, 429)
      self.assertEqual(out["error"]["type"], "rate_limit_error")
    finally:
      gate.set()
      for t in threads:
        t.join(_TIMEOUT_S)
      executor.execute = real
    self.assertEqual(sorted(s for s, _ in results), [200] * 5)

  def test_client_gone_cancels_and_frees_pages(self):
    server = self.servers["shared"]
    executor = server.loop.engine.executor
    release = threading.Event()
    real = executor.execute
    steps = []

    def held(batch):  # After 3 steps, wait until the client has gone.
      steps.append(len(batch.seqs))
      if len(steps) > 3:
        release.wait(_TIMEOUT_S)
      return real(batch)

    executor.execute = held
    before = _scrape(server.url).get('looped:requests_aborted_total{model_name="train"}', 0)
    try:
      stream = client.Stream(
        server.url + "/v1/completions",
        self._greedy("abc", max_tokens=20, ignore_eos=True),
        timeout_s=_TIMEOUT_S,
      )
      first = next(iter(stream))
      self.assertIsNone(first["choices"][0]["finish_reason"])
      stream.close()
      # Seen pending (the engine is held) or already done (the cancel reached the engine loop
      # before its fourth step, as it can on a loaded machine).
      aborted = lambda: _scrape(server.url).get(
        'looped:requests_aborted_total{model_name="train"}', 0
      )
      _until(lambda: server.loop.pending_cancels() > 0 or aborted() > before)
    finally:
      release.set()
      executor.execute = real
    server.wait_idle()
    after = _scrape(server.url)['looped:requests_aborted_total{model_name="train"}']
    self.assertEqual(after, before + 1)
    self.assertEqual(server.loop.pages_in_use(), 0)
    self.assertLess(len(steps), 20)  # It stopped long before its 20 tokens.

  def test_metrics(self):
    server = self.servers["unshared"]
    before = _scrape(server.url)
    n = 3
    for _ in range(n):  # The same prompt again: its full pages are prefix-cache hits.
      status, _ = self._post("unshared", self._greedy("0123456789abcdefghij"))
      self.assertEqual(status, 200)
    after = _scrape(server.url)
    delta = lambda name: after[name] - before.get(name, 0)
    label = '{model_name="train"}'
    self.assertEqual(delta(f"vllm:time_to_first_token_seconds_count{label}"), n)
    self.assertEqual(delta(f"vllm:e2e_request_latency_seconds_count{label}"), n)
    self.assertEqual(delta(f"vllm:prompt_tokens_total{label}"), 20 * n)
    # Pages of 16 tokens: the first request computes 20, the next two hit the first page.
    self.assertEqual(delta(f"vllm:prefix_cache_queries_total{label}"), 20 * n)
    self.assertEqual(delta(f"vllm:prefix_cache_hits_total{label}"), 16 * (n - 1))
    generated = delta(f"vllm:generation_tokens_total{label}")
    self.assertEqual(delta(f"vllm:inter_token_latency_seconds_count{label}"), generated - n)
    self.assertEqual(after[f"vllm:num_requests_running{label}"], 0)
    self.assertEqual(after[f"vllm:num_requests_waiting{label}"], 0)
    self.assertEqual(after[f"looped:kv_pages_used{label}"], 0)
    self.assertEqual(after[f"vllm:kv_cache_usage_perc{label}"], 0)
    self.assertGreater(after[f"looped:kv_pages_total{label}"], 0)
    stats = server.loop.stats
    self.assertAlmostEqual(
      after[f"vllm:gpu_prefix_cache_hit_rate{label}"],
      stats.first_cached_tokens / stats.first_prompt_tokens,
    )
    self.assertEqual(
      after['vllm:time_to_first_token_seconds_bucket{model_name="train",le="+Inf"}'],
      after[f"vllm:time_to_first_token_seconds_count{label}"],
    )
    status, models = client.request(server.url + "/v1/models")
    self.assertEqual(
      (status, models["data"][0]["id"], models["data"][0]["max_model_len"]), (200, "train", 32)
    )
    self.assertEqual(client.request(server.url + "/health"), (200, {"status": "ok"}))


def _scrape(url: str) -> dict[str, float]:
  """Prometheus text -> {'name{labels}': value}."""
  status, text = client.request(url + "/metrics")
  assert status == 200, text
  out = {}
  for line in text.splitlines():
    if line and not line.startswith("#"):
      key, value = line.rsplit(" ", 1)
      out[key] = math.inf if value == "+Inf" else float(value)
  return out


def _until(condition, timeout_s: float = _TIMEOUT_S) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      raise TimeoutError("condition not reached")
    time.sleep(0.005)


if __name__ == "__main__":
  absltest.main()
