"""Requests a hostile or broken client sends, each refused alone with OpenAI's JSON error object
while the other requests go on; and a server that is ready only once it has compiled.

Each case reproduces a way a client could hurt every other client of the server:
- a sampling value the engine cannot hold (top_k = 2^40) used to fail every request of its step;
- a lone surrogate, or JSON nested 100,000 deep, used to answer a plain-text 500;
- a large body was read and parsed on the event loop, which stalled /health;
- a batch over max_waiting got a retryable 429 that could never succeed;
- a client that closes before its declared body is complete left a traceback in the log;
- the server announced itself before any step shape was compiled.
"""

import json
import logging
import socket
import threading
import time
from unittest import mock

from absl.testing import absltest

from looped.engine import engine as engine_lib
from looped.server import client, program, protocol
from server_harness import ServerThread, tiny_engine

_TIMEOUT_S = 120
_MAX_BODY = 1 << 16


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

  def test_the_openapi_document_is_served(self):
    status, doc = client.request(self.url + "/openapi.json")
    self.assertEqual(status, 200)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]
    props = body["content"]["application/json"]["schema"]["properties"]
    self.assertEqual(set(props), set(protocol.FIELDS))
    self.assertEqual(props["top_k"]["maximum"], 257)


class ReadinessTest(absltest.TestCase):
  def test_health_and_requests_wait_for_warm_up(self):
    engine, tok = tiny_engine(row_buckets=(4,), token_buckets=(4, 16), column_buckets=(4,))
    release = threading.Event()
    original = engine.start_warmup

    def held_warmup(on_shape=None):
      release.wait(_TIMEOUT_S)
      return original(on_shape)

    engine.start_warmup = held_warmup
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
      engine.compile_thread.join(_TIMEOUT_S)  # The background compiles done.
      compiled = engine.executor.steps.num_compiles
      status, body = client.request(server.url + "/v1/completions", "POST", raw=raw)
      self.assertEqual(status, 200, body)
      self.assertEqual(engine.executor.steps.num_compiles, compiled)  # Nothing compiled.
    finally:
      server.__exit__(None, None, None)


if __name__ == "__main__":
  absltest.main()
