"""Requests a hostile or broken client sends, each refused alone with OpenAI's JSON error object
while the other requests go on; and a server that is ready only once it has compiled.

Each case reproduces a way a client could hurt every other client of the server:
- a sampling value the engine cannot hold (top_k = 2^40) used to fail every request of its step;
- a lone surrogate, or JSON nested 100,000 deep, used to answer a plain-text 500;
- a large body was read and parsed on the event loop, which stalled /health;
- a batch over max_waiting got a retryable 429 that could never succeed;
- a client that closes before its declared body is complete left a traceback in the log;
- the server announced itself before any step shape was compiled;
- an integer beyond int()'s 4,300 digits (anywhere, /tokenize and /detokenize included) or a
  400-digit temperature answered a 500;
- null in an optional field (what clients other than the openai package send for "default")
  was a 400;
- a 1 MB unknown field name was echoed back whole in the error;
- malformed HTTP got uvicorn's plain-text 400; a body that stopped arriving was waited for
  forever;
- streaming clients that stopped reading kept the engine generating every token they asked
  for, ahead of the requests of clients that read;
- and the chat endpoint's messages are checked like every other field.
"""

import dataclasses
import json
import logging
import socket
import threading
import time
from unittest import mock

from absl.testing import absltest

from looped.data.tokenizers import BytesTokenizer
from looped.engine import engine as engine_lib
from looped.server import client, guards, program, protocol
from server_harness import TINY_SERVED_MODEL, ServerThread, tiny_engine

_TIMEOUT_S = 120
_MAX_BODY = 1 << 16
_BODY_TIMEOUT_S = 2.0  # Far more than a body on 127.0.0.1 takes, however loaded the machine.
_DIGITS = 5000  # More than int() reads (sys.get_int_max_str_digits: 4,300).


def _raw_http(port: int, head: bytes, body: bytes = b"", close_early: bool = False) -> bytes:
  """Sends bytes as they are on a new connection; returns what the server answered (b'' when
  the client hangs up first)."""
  with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT_S) as sock:
    sock.sendall(head + body)
    if close_early:
      return b""
    sock.shutdown(socket.SHUT_WR) if not body else None
    chunks = []
    while chunk := sock.recv(65536):
      chunks.append(chunk)
  return b"".join(chunks)


def _status_and_json(response: bytes) -> tuple[int, dict]:
  head, _, body = response.partition(b"\r\n\r\n")
  status = int(head.split(b" ")[1])
  return status, json.loads(body)


class HostileRequestsTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    engine, cls.tok = tiny_engine()
    app, cls.loop = program.serve_engine(
      engine,
      cls.tok,
      "tiny",
      max_waiting=8,
      max_logprobs=5,
      max_body_bytes=_MAX_BODY,
      body_timeout_s=_BODY_TIMEOUT_S,
    )
    cls.server = ServerThread(app, cls.loop).__enter__()
    cls.url = cls.server.url

  @classmethod
  def tearDownClass(cls):
    cls.server.__exit__(None, None, None)
    super().tearDownClass()

  def tearDown(self):
    self.server.wait_idle()
    self.assertEqual(self.loop.pages_in_use(), 0)
    self.assertEqual(client.request(self.url + "/health"), (200, {"status": "ok"}))
    super().tearDown()

  def _post(self, raw: bytes, path="/v1/completions"):
    return client.request(self.url + path, "POST", raw=raw, timeout_s=_TIMEOUT_S)

  def _assert_error(self, result, status, pattern, param="absent"):
    got_status, body = result
    self.assertEqual(got_status, status, body)
    self.assertIsInstance(body, dict, body)  # JSON, never plain text.
    self.assertRegex(body["error"]["message"], pattern)
    self.assertIn("type", body["error"])
    if param != "absent":
      self.assertEqual(body["error"]["param"], param)

  def test_an_unservable_sampling_value_fails_alone(self):
    # Streams in flight when the bad request arrives: each must finish with all its tokens.
    streams = [
      client.Stream(
        self.url + "/v1/completions",
        {
          "prompt": p,
          "max_tokens": 12,
          "temperature": 0,
          "ignore_eos": True,
          "stream_options": {"include_usage": True},
        },
        timeout_s=_TIMEOUT_S,
      )
      for p in ("abc", "defg", "hi", "jklmn")
    ]
    for top_k in (1099511627776, 2147483648, 258):
      bad = json.dumps({"prompt": "abc", "max_tokens": 3, "top_k": top_k}).encode()
      self._assert_error(self._post(bad), 400, r"top_k must be in \[-1, 257\]", "top_k")
    for stream in streams:
      chunks = list(stream)
      stream.close()
      self.assertTrue(stream.done)
      self.assertFalse([c for c in chunks if "error" in c])
      self.assertEqual(chunks[-2]["choices"][0]["finish_reason"], "length")
      self.assertEqual(chunks[-1]["usage"]["completion_tokens"], 12)

  def test_a_lone_surrogate_is_a_400(self):
    raw = b'{"prompt": "abc\\ud800def", "max_tokens": 2}'
    self._assert_error(self._post(raw), 400, "lone surrogate .*U\\+D800", "prompt")
    self._assert_error(self._post(raw, "/tokenize"), 400, "lone surrogate", "prompt")
    stop = b'{"prompt": "abc", "max_tokens": 2, "stop": ["\\udfff"]}'
    self._assert_error(self._post(stop), 400, "stop\\[0\\] holds a lone surrogate", "stop")

  def test_deep_json_is_a_400(self):
    deep = 60_000  # Under the body limit, far over the parser's depth.
    self._assert_error(self._post(b"[" * deep), 400, "nests JSON .* too deeply")
    self._assert_error(self._post(b'{"prompt": ' + b"[" * deep), 400, "too deeply")

  def test_a_body_over_the_limit_is_a_413_before_it_is_read(self):
    declared = (
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Content-Length: 20000000\r\n\r\n"
    )
    status, body = _status_and_json(_raw_http(self.server.port, declared, b"{"))
    self.assertEqual(status, 413)
    self.assertRegex(body["error"]["message"], f"over {_MAX_BODY} bytes")
    # No length declared: the body is read up to the limit, then refused.
    chunk = b'{"prompt": "' + b"a" * (_MAX_BODY + 100) + b'"}'
    chunked = (
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Transfer-Encoding: chunked\r\n\r\n"
    )
    body = b"%x\r\n" % len(chunk) + chunk + b"\r\n0\r\n\r\n"
    status, payload = _status_and_json(_raw_http(self.server.port, chunked, body))
    self.assertEqual(status, 413)
    self.assertEqual(payload["error"]["type"], "invalid_request_error")

  def test_parsing_runs_off_the_event_loop(self):
    # The parse of one request is held until /health has answered: on the event loop it
    # would block /health, which would then time out.
    release = threading.Event()
    original = protocol.parse

    def held_parse(*args):
      release.wait(_TIMEOUT_S)
      return original(*args)

    results = {}
    with mock.patch.object(protocol, "parse", held_parse):
      sender = threading.Thread(
        target=lambda: results.setdefault(
          "completion", self._post(b'{"prompt": "abc", "max_tokens": 2, "temperature": 0}')
        )
      )
      sender.start()
      time.sleep(0.2)
      results["health"] = client.request(self.url + "/health", timeout_s=10)
      release.set()
      sender.join(_TIMEOUT_S)
    self.assertEqual(results["health"], (200, {"status": "ok"}))
    self.assertEqual(results["completion"][0], 200)

  def test_a_batch_over_max_waiting_is_a_400_not_a_429(self):
    raw = json.dumps({"prompt": ["ab"] * 9, "max_tokens": 1}).encode()
    self._assert_error(self._post(raw), 400, "at most 8 in one request", "prompt")
    ok = json.dumps({"prompt": ["ab"] * 8, "max_tokens": 1}).encode()
    self.assertEqual(self._post(ok)[0], 200)

  def test_a_client_that_leaves_mid_body_leaves_no_traceback(self):
    head = (
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Content-Length: 1000\r\n\r\n"
    )
    # uvicorn logs an application's exception on its own logger, which does not propagate.
    with self.assertLogs("uvicorn.error", level=logging.DEBUG) as logs:
      logging.getLogger("uvicorn.error").debug("capturing")
      _raw_http(self.server.port, head, b'{"prompt": "abc", "max_tokens": 2}', close_early=True)
      time.sleep(0.5)
    self.assertEqual([r.getMessage() for r in logs.records], ["capturing"])

  def test_every_error_is_openai_json(self):
    self._assert_error(client.request(self.url + "/v1/nothing"), 404, "no route /v1/nothing")
    self._assert_error(client.request(self.url + "/v1/completions"), 405, "GET is not allowed")
    with mock.patch.object(self.tok, "decode", side_effect=RuntimeError("boom")):
      self._assert_error(self._post(b'{"tokens": [1, 2]}', "/detokenize"), 500, "RuntimeError")

  def test_huge_integers_are_400s_naming_the_field(self):
    huge, negative = b"9" * _DIGITS, b"-" + b"9" * _DIGITS
    fields = [f.name for f in protocol.REQUEST if f.name not in ("prompt", "stop", "user")]
    for name in fields + ["stop", "user"]:
      for digits in (huge, negative):
        raw = b'{"prompt": "ab", "%s": %s}' % (name.encode(), digits)
        self._assert_error(self._post(raw), 400, f"{_DIGITS} digits|may only hold", name)
    # 400 digits: an int() like any other, but no float holds it.
    for name in ("temperature", "top_p"):
      raw = b'{"prompt": "ab", "%s": 1%s}' % (name.encode(), b"0" * 400)
      self._assert_error(self._post(raw), 400, f"{name} must be in", name)
    raw = b'{"prompt": [1, %s, 2]}' % huge
    self._assert_error(self._post(raw), 400, "list of token ids", "prompt")
    raw = b'{"prompt": ["ab", [%s]]}' % huge
    self._assert_error(self._post(raw), 400, r"prompt\[1\] must be", "prompt")
    self._assert_error(self._post(b'{"prompt": %s}' % huge, "/tokenize"), 400, "string", "prompt")
    raw = b'{"tokens": [1, %s]}' % huge
    self._assert_error(self._post(raw, "/detokenize"), 400, "token ids", "tokens")
    chat_path = "/v1/chat/completions"
    for name, where in (("max_tokens", "max_tokens"), ("top_logprobs", "top_logprobs")):
      raw = b'{"messages": [{"role": "user", "content": "a"}], "%s": %s}' % (name.encode(), huge)
      self._assert_error(self._post(raw, chat_path), 400, f"{_DIGITS} digits", where)
    raw = b'{"messages": [{"role": "user", "content": %s}]}' % huge
    self._assert_error(self._post(raw, chat_path), 400, "string", "messages[0].content")
    raw = b'{"messages": [{"role": "user", "content": "a"}], "unknown": %s}' % huge
    self._assert_error(self._post(raw, chat_path), 400, "unknown", "unknown")

  def test_null_means_the_default(self):
    """Every optional field of both endpoints, null: served as if absent (a seeded request's
    text is the same), as OpenAI's API and vLLM do."""
    endpoints = (
      ("/v1/completions", protocol.REQUEST, {"prompt": "ab", "max_tokens": 4}),
      (
        "/v1/chat/completions",
        protocol.CHAT_REQUEST,
        {"messages": [{"role": "user", "content": "a"}]},
      ),
    )
    post = lambda path, body: client.request(self.url + path, "POST", body, timeout_s=_TIMEOUT_S)
    checked = 0
    for path, fields, base in endpoints:
      seeded = {**base, "seed": 7}
      for f in fields:
        if f.required or not f.nullable:
          continue
        status, got = post(path, {**seeded, f.name: None})
        self.assertEqual(status, 200, (path, f.name, got))
        if f.name != "seed":  # A null seed is a random one, as an absent one.
          status, want = post(path, {k: v for k, v in seeded.items() if k != f.name})
          self.assertEqual(status, 200, want)
          self.assertEqual(got["choices"], want["choices"], (path, f.name))
          self.assertEqual(got["usage"], want["usage"], (path, f.name))
        checked += 1
    self.assertGreater(checked, 25)

  def test_error_messages_quote_a_bounded_prefix(self):
    long = "x" * (_MAX_BODY - 1000)
    cases = [
      ({"prompt": "ab", long: 1}, "/v1/completions", 400),
      ({"prompt": "ab", "model": long}, "/v1/completions", 404),
      ({"prompt": "ab", "max_tokens": long}, "/v1/completions", 400),
      ({"prompt": "ab", "stop": [long, 1]}, "/v1/completions", 400),
      ({"messages": [{"role": long, "content": "a"}]}, "/v1/chat/completions", 400),
      ({"messages": [{"role": "user", "content": "a", long: 1}]}, "/v1/chat/completions", 400),
      ({"messages": [{"role": "user", "content": [long]}]}, "/v1/chat/completions", 400),
    ]
    for body, path, status in cases:
      got, out = client.request(self.url + path, "POST", body, timeout_s=_TIMEOUT_S)
      self.assertEqual(got, status, out)
      error = out["error"]
      self.assertNotIn("x" * protocol.QUOTE_CHARS, error["message"])  # A prefix at most.
      self.assertLess(len(error["message"]), 1000, error["message"][:1000])
      self.assertLessEqual(len(error["param"] or ""), 2 * protocol.QUOTE_CHARS)
    # A 1 MB name, parsed alone (this server's body limit is smaller).
    body = json.dumps({"prompt": "ab", "y" * (1 << 20): 1}).encode()
    limits = protocol.Limits("tiny", 32, 257, 5, 32, 4)
    with self.assertRaises(protocol.RequestError) as e:
      protocol.parse(body, self.tok, limits)
    self.assertNotIn("y" * protocol.QUOTE_CHARS, str(e.exception))
    self.assertLess(len(str(e.exception)), 1000)
    self.assertEqual(len(e.exception.param), protocol.QUOTE_CHARS)
    status, out = client.request(self.url + "/" + "z" * 8000)
    self.assertEqual(status, 404)
    self.assertLess(len(out["error"]["message"]), 200)

  def test_malformed_http_is_openai_json(self):
    port = self.server.port
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    for raw in (
      b"GARBAGE\r\n\r\n",
      head + b"Content-Length: 12x\r\n\r\n",
      head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n",
      head + b"Bad Header: x\r\n\r\n",
    ):
      status, body = _status_and_json(_raw_http(port, raw))
      self.assertEqual(status, 400)
      self.assertRegex(body["error"]["message"], "malformed")
      self.assertEqual(body["error"]["type"], "invalid_request_error")
    # A Content-Length of 5,000 digits: over the body limit, refused before its body.
    raw = head + b"Content-Length: " + b"9" * _DIGITS + b"\r\n\r\n{}"
    status, body = _status_and_json(_raw_http(port, raw))
    self.assertIn(status, (400, 413))
    self.assertIn("error", body)

  def test_a_body_that_stops_arriving_times_out(self):
    port = self.server.port
    declared = (
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Content-Length: 100\r\n\r\n"
    )
    chunked = (
      b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
      b'5\r\n{"mes\r\n'
    )
    for head, body in ((declared, b'{"prompt'), (chunked, b"")):
      with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT_S) as sock:
        sock.sendall(head + body)  # ... and nothing more, without closing.
        answer = b""
        while chunk := sock.recv(65536):
          answer += chunk
      status, payload = _status_and_json(answer)
      self.assertEqual(status, 408)
      self.assertRegex(payload["error"]["message"], "serve.body_timeout_s")
    # A head that stops arriving (or never starts): the connection is closed, unanswered.
    for partial in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-"):
      with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT_S) as sock:
        sock.sendall(partial)
        self.assertEqual(sock.recv(65536), b"")

  def test_bad_chat_messages_are_400s_naming_the_field(self):
    user = {"role": "user", "content": "a"}
    cases = [
      ({}, "messages"),
      ({"messages": None}, "messages"),
      ({"messages": []}, "messages"),
      ({"messages": "hi"}, "messages"),
      ({"messages": [1]}, "messages[0]"),
      ({"messages": [user, user, {"role": "tool", "content": "x"}]}, "messages[2].role"),
      ({"messages": [{"content": "x"}]}, "messages[0].role"),
      ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
      ({"messages": [{"role": "user"}]}, "messages[0].content"),
      ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
      ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
      ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
      (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0]",
      ),
      ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0].content[0]"),
      (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
        "messages[0].content[0].text",
      ),
      ({"messages": [{**user, "tool_calls": []}]}, "messages[0].tool_calls"),
      ({"messages": [{**user, "name": 5}]}, "messages[0].name"),
      ({"messages": [user], "top_logprobs": 2}, "top_logprobs"),
      ({"messages": [user], "logprobs": True, "top_logprobs": 9}, "top_logprobs"),
      ({"messages": [user], "logprobs": "yes"}, "logprobs"),
      ({"messages": [user], "max_completion_tokens": 0}, "max_completion_tokens"),
      ({"messages": [user], "max_tokens": 40}, "max_tokens"),
      ({"messages": [{"role": "user", "content": "x" * 40}]}, "messages"),  # Over the context.
      ({"messages": [user], "echo": True}, "echo"),
      ({"messages": [user], "model": "other"}, "model"),
    ]
    for body, param in cases:
      status, out = client.request(
        self.url + "/v1/chat/completions", "POST", body, timeout_s=_TIMEOUT_S
      )
      self.assertIn(status, (400, 404), (body, out))
      self.assertEqual(out["error"]["param"], param, (body, out))
      self.assertIn(param.split(".")[-1].split("[")[0], out["error"]["message"], (body, out))
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'
    status, out = self._post(raw, "/v1/chat/completions")
    self.assertEqual((status, out["error"]["param"]), (400, "messages[0].content"))
    # Text parts are the text they join: the same greedy reply.
    replies = []
    for content in ("ab\ncd", [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]):
      body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 3}
      status, out = client.request(
        self.url + "/v1/chat/completions", "POST", body, timeout_s=_TIMEOUT_S
      )
      self.assertEqual(status, 200, out)
      replies.append((out["choices"], out["usage"]))
    self.assertEqual(replies[0], replies[1])

  def test_the_openapi_document_is_served(self):
    status, doc = client.request(self.url + "/openapi.json")
    self.assertEqual(status, 200)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    props = body["content"]["application/json"]["schema"]["properties"]
    self.assertEqual(set(props), set(protocol.FIELDS))
    self.assertEqual(props["top_k"]["maximum"], 257)


def _counter(url: str, name: str) -> float:
  """A metric's value from /metrics (0 when absent)."""
  status, text = client.request(url + "/metrics")
  assert status == 200, text
  values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)]
  return sum(values)


class StalledStreamsTest(absltest.TestCase):
  """Streaming clients that send a request and never read: once the connection's buffers are
  full and stream_backlog tokens wait, each request is cancelled, so the engine generates a
  bounded number of tokens for them (not their max_tokens) and serves the clients that read."""

  _BACKLOG = 8
  _STALLED = 6
  _MAX_TOKENS = 1000
  _BODY = {"prompt": "ab", "max_tokens": _MAX_TOKENS, "temperature": 0, "ignore_eos": True,
           "logprobs": 5}  # fmt: skip

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    model = dataclasses.replace(TINY_SERVED_MODEL, max_seq_len=1024)
    engine, _ = tiny_engine(
      model,
      num_pages=512,
      page_size=16,
      max_num_seqs=cls._STALLED,
      row_buckets=(cls._STALLED,),
      token_buckets=(16,),
      column_buckets=(64,),
    )
    app, cls.loop = program.serve_engine(
      engine, BytesTokenizer(), "tiny", max_waiting=16, max_logprobs=5,
      stream_backlog=cls._BACKLOG,
    )  # fmt: skip
    cls.server = ServerThread(app, cls.loop).__enter__()

  @classmethod
  def tearDownClass(cls):
    cls.server.__exit__(None, None, None)
    super().tearDownClass()

  def _stalled_client(self) -> socket.socket:
    """A client that sends a streamed request and never reads (the smallest receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", self.server.port))
    body = json.dumps({**self._BODY, "stream": True}).encode()
    sock.sendall(
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return sock

  def test_clients_that_stop_reading_cost_a_bounded_number_of_tokens(self):
    url = self.server.url
    # A client that reads: every token's event, whose sizes bound what a connection can hold.
    stream = client.Stream(url + "/v1/completions", self._BODY, timeout_s=_TIMEOUT_S)
    chunks = list(stream)
    stream.close()
    self.assertTrue(stream.done)
    self.assertEqual(chunks[-1]["choices"][0]["finish_reason"], "length")
    sizes = [len(f"data: {json.dumps(c)}\n\n") for c in chunks]
    tokens = lambda: (
      _counter(url, "vllm:time_to_first_token_seconds_count")
      + _counter(url, "vllm:inter_token_latency_seconds_count")
    )
    before = tokens()
    clients = [self._stalled_client() for _ in range(self._STALLED)]
    try:
      # A request sent behind them, while they hold every row, is served.
      body = {"prompt": "cd", "max_tokens": 8, "temperature": 0}
      status, reply = client.request(url + "/v1/completions", "POST", body, timeout_s=_TIMEOUT_S)
      self.assertEqual(status, 200, reply)
      self.assertEqual(reply["usage"]["completion_tokens"], 8)
      deadline = time.monotonic() + _TIMEOUT_S  # Until the engine has nothing left to do.
      while self.loop.num_running() or self.loop.num_waiting() or self.loop.pending_cancels():
        self.assertLess(time.monotonic(), deadline)
        time.sleep(0.01)
      self.assertEqual(_counter(url, "looped:streams_stalled_total"), self._STALLED)
      self.assertEqual(self.loop.pages_in_use(), 0)  # Freed with the clients still connected.
      # What one connection holds before its stream waits: the client's receive buffer, the
      # server's send buffer (both as the kernel reports them, over what they hold) and the
      # transport's buffer, plus one event; then the backlog, and a token or two generated
      # while the cancel reaches the engine.
      held = (
        clients[0].getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        + self.server._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        + guards.WRITE_BUFFER_BYTES
        + max(sizes)
      )
      bound = held // min(sizes) + self._BACKLOG + 2
      self.assertLess(bound, self._MAX_TOKENS)  # Else this test would show nothing.
      stalled = tokens() - before - 8
      self.assertLessEqual(stalled, self._STALLED * bound)
    finally:
      for sock in clients:
        sock.close()
    self.server.wait_idle()
    self.assertEqual(self.loop.pages_in_use(), 0)


class ReadinessTest(absltest.TestCase):
  def test_health_and_requests_wait_for_warm_up(self):
    engine, tok = tiny_engine(row_buckets=(4,), token_buckets=(4, 16), column_buckets=(4,))
    release = threading.Event()
    original = engine.start_warmup

    def held_warmup(on_shape=None):
      release.wait(_TIMEOUT_S)
      return original(on_shape)

    engine.start_warmup = held_warmup
    compiling = threading.Event()

    def held_background(warm):  # The background compiles wait for `compiling`.
      def warmup(shapes):
        if threading.current_thread().name == "engine-compile":
          compiling.wait(_TIMEOUT_S)
        return warm(shapes)

      return warmup

    executor = engine.executor
    executor.warmup = held_background(executor.warmup)
    executor.warmup_speculative = held_background(executor.warmup_speculative)
    app, loop = program.serve_engine(
      engine, tok, "tiny", max_waiting=8, max_logprobs=5, warmup=True
    )
    server = ServerThread(app, loop)
    server._timeout = 0.5
    with self.assertRaisesRegex(RuntimeError, "did not start"):
      server.__enter__()  # Listening, but not ready.
    status, body = client.request(server.url + "/health")
    self.assertEqual(status, 503)
    self.assertRegex(body["error"]["message"], "warming up")
    raw = b'{"prompt": "abc", "max_tokens": 2}'
    status, body = client.request(server.url + "/v1/completions", "POST", raw=raw)
    self.assertEqual(status, 503)
    release.set()
    server._timeout = _TIMEOUT_S
    deadline = time.monotonic() + _TIMEOUT_S
    while not loop.ready.is_set():
      self.assertLess(time.monotonic(), deadline)
      time.sleep(0.05)
    try:
      self.assertEqual(client.request(server.url + "/health"), (200, {"status": "ok"}))
      # Ready once the shapes every call fits are compiled; the rest compile in the background.
      self.assertEqual(loop.warmup_shapes, len(engine_lib.cover_shapes(engine.step_shapes())))
      shapes = len(engine.step_shapes()) + len(engine.speculative_shapes())
      rest = shapes - loop.warmup_shapes
      self.assertGreater(rest, 0)  # Else the gauge below would show nothing.
      self.assertEqual(_counter(server.url, "looped:step_shapes_pending"), rest)
      compiling.set()
      engine.compile_thread.join(_TIMEOUT_S)  # The background compiles done.
      self.assertEqual(_counter(server.url, "looped:step_shapes_pending"), 0)
      compiled = engine.executor.steps.num_compiles
      status, body = client.request(server.url + "/v1/completions", "POST", raw=raw)
      self.assertEqual(status, 200, body)
      self.assertEqual(engine.executor.steps.num_compiles, compiled)  # Nothing compiled.
    finally:
      server.__exit__(None, None, None)


if __name__ == "__main__":
  absltest.main()
