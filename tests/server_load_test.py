"""200 concurrent HTTP requests against the server: random lengths, shared prefixes, greedy and
seeded sampling, streamed and not, some cancelled mid-stream, some malformed, some hostile
(values the engine cannot hold, lone surrogates, deep JSON, oversized bodies and batches, a
client that leaves mid-body).

Reference: the engine's own batch mode (Engine.generate) on the well-formed requests, whose
tokens the engine tests check against each request decoded alone (engine_reference.py); a
token depends only on its request (and its seed), not on the batch, preemptions or prefix
hits, so the server's interleaving must not change a single token. Tiny random model, shared
layout, a pool small enough to preempt.
"""

import dataclasses
import random
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped.data.tokenizers import BytesTokenizer
from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import init_params
from looped.model.looped_lm import LoopedLM
from looped.server import client, program
from server_harness import ServerThread

_TIMEOUT_S = 120
_MODEL = dataclasses.replace(testing.TINY_MODEL, vocab_size=257, max_seq_len=64)
_PREFIXES = ["You are a helpful ", "import numpy as np\n", "Once upon a time, ", "SELECT * FROM t "]
_MALFORMED = [
  b'{"prompt": "abc", "max_tokens": 0}',
  b'{"prompt": "abc", "temperature": NaN}',
  b'{"prompt": "abc", "frequency_penalty": 1}',
  b'{"prompt": "abc", "max_tokens": "7"}',
  b'{"prompt": "\xc3\x28"}',
  b'{"prompt": [1, 2, 999]}',
  b'{"prompt": "' + b"y" * 70 + b'"}',
  b'{"prompt": "abc", "max_tokens": 63}',
  b'{"prompt": "abc", "n": 3}',
  b'{"prompt": "abc"',
]


_MAX_BODY = 1 << 15
_HOSTILE = [
  (b'{"prompt": "abc", "max_tokens": 3, "top_k": 1099511627776}', 400),
  (b'{"prompt": "abc", "max_tokens": 3, "top_k": 2147483648}', 400),
  (b'{"prompt": "abc\\ud800def"}', 400),
  (b"[" * 30_000, 400),
  (b'{"prompt": "' + b"z" * (_MAX_BODY + 1) + b'"}', 413),
  (b'{"prompt": [' + b'"ab", ' * 256 + b'"ab"]}', 400),
  (None, None),  # Declares 1,000 bytes, sends 34, leaves.
]


def _leave_mid_body(port: int) -> tuple:
  with socket.create_connection(("127.0.0.1", port), timeout=_TIMEOUT_S) as sock:
    sock.sendall(
      b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      b'Content-Length: 1000\r\n\r\n{"prompt": "abc", "max_tokens": 2}'
    )
  return ("left",)


def _engine(params, tok):
  return Engine(
    LoopedLM(_MODEL),
    params,
    EngineConfig(
      share_kv=True,
      num_pages=40,  # 160 tokens: under 3 requests at their longest, so requests are preempted.
      page_size=4,
      max_num_batched_tokens=32,
      max_num_seqs=8,
      prefill_block=4,  # One page: the prompts' shared heads are hits up to their last page.
      row_buckets=(8,),
      token_buckets=(32,),
      column_buckets=(16,),
      top_logprobs=5,
    ),
    decode=tok.decode,
  )


class ServerLoadTest(absltest.TestCase):
  def test_200_concurrent_requests(self):
    tok = BytesTokenizer()
    params = init_params(LoopedLM(_MODEL), jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    rng = random.Random(0)
    jobs = []
    for i in range(200):
      roll = rng.random()
      kind = (
        "malformed"
        if roll < 0.12
        else "hostile"
        if roll < 0.17
        else "cancel"
        if roll < 0.29
        else "good"
      )
      if kind == "malformed":
        jobs.append({"kind": kind, "raw": rng.choice(_MALFORMED)})
        continue
      if kind == "hostile":
        raw, status = rng.choice(_HOSTILE)
        jobs.append({"kind": kind, "raw": raw, "status": status})
        continue
      prefix = rng.choice(_PREFIXES) if rng.random() < 0.8 else ""
      suffix = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 12)))
      body = {"prompt": prefix + suffix, "max_tokens": rng.randint(1, 16), "temperature": 0}
      if rng.random() < 0.3:
        body.update(temperature=0.8, top_k=rng.choice([0, 5]), top_p=0.9, seed=i)
      if rng.random() < 0.2:
        body["logprobs"] = 2  # Recorded per position: such requests skip the prefix cache.
      if kind == "cancel":
        body.update(max_tokens=30, ignore_eos=True)
      stream = rng.random() < (0.5 if kind == "cancel" else 0.4)
      jobs.append({"kind": kind, "body": body, "stream": stream})

    app, loop = program.serve_engine(
      _engine(params, tok), tok, "tiny", max_waiting=256, max_logprobs=5, max_body_bytes=_MAX_BODY
    )
    results = [None] * len(jobs)
    with ServerThread(app, loop) as server:
      url = server.url + "/v1/completions"
      start = threading.Barrier(32)

      def run(i):
        job = jobs[i]
        if i < 32:
          start.wait(_TIMEOUT_S)  # The first 32 arrive together.
        if job["kind"] == "hostile" and job["raw"] is None:
          results[i] = _leave_mid_body(server.port)
        elif job["kind"] in ("malformed", "hostile"):
          results[i] = client.request(url, "POST", raw=job["raw"], timeout_s=_TIMEOUT_S)
        elif job["kind"] == "cancel" and not job["stream"]:
          try:  # Gives up (closes the connection) before the 30 tokens can be done.
            client.request(url, "POST", job["body"], timeout_s=0.3)
            results[i] = ("completed",)
          except TimeoutError:
            results[i] = ("gave up",)
        elif not job["stream"]:
          results[i] = client.request(url, "POST", job["body"], timeout_s=_TIMEOUT_S)
        else:
          stream = client.Stream(url, job["body"], timeout_s=_TIMEOUT_S)
          chunks = []
          for chunk in stream:
            chunks.append(chunk)
            if job["kind"] == "cancel" and len(chunks) == 2:
              break
          stream.close()
          results[i] = (stream.status, chunks, stream.done)

      with ThreadPoolExecutor(32) as pool:
        list(pool.map(run, range(len(jobs))))
      server.wait_idle()
      self.assertEqual(loop.pages_in_use(), 0)
      loop.engine.pool.check()
      self.assertEqual(client.request(server.url + "/health"), (200, {"status": "ok"}))
      metrics = loop.metrics

    good = [i for i, j in enumerate(jobs) if j["kind"] == "good"]
    cancelled = [i for i, j in enumerate(jobs) if j["kind"] == "cancel"]
    malformed = [i for i, j in enumerate(jobs) if j["kind"] == "malformed"]
    self.assertGreater(min(len(good), len(cancelled), len(malformed)), 15)
    for i in malformed:
      status, body = results[i]
      self.assertEqual(status, 400, (jobs[i], body))
      self.assertIn("error", body)
    hostile = [i for i, j in enumerate(jobs) if j["kind"] == "hostile"]
    self.assertGreater(len(hostile), 4)
    for i in hostile:
      if jobs[i]["raw"] is None:
        self.assertEqual(results[i], ("left",))
        continue
      status, body = results[i]
      self.assertEqual(status, jobs[i]["status"], (jobs[i]["raw"][:60], body))
      self.assertIsInstance(body["error"]["message"], str)

    # The reference: the same well-formed requests in the engine's batch mode.
    requests = []
    for i in good:
      b = jobs[i]["body"]
      sampling = SamplingParams(
        max_new_tokens=b["max_tokens"],
        temperature=b["temperature"],
        top_k=b.get("top_k", 0),
        top_p=b.get("top_p", 1.0),
        seed=b.get("seed", 0),  # Greedy ignores it (the server draws one when none is given).
        stop_token_ids=(tok.eos_id,),
      )
      requests.append(GenRequest(i, tuple(int(t) for t in tok.encode(b["prompt"])), sampling))
    reference = _engine(params, tok).generate(requests)
    finish = {"length": "length", "stop_token": "stop", "stop_string": "stop"}
    for i, want in zip(good, reference):
      if jobs[i]["stream"]:
        status, chunks, done = results[i]
        self.assertTrue(done, jobs[i])
        text = "".join(c["choices"][0]["text"] for c in chunks)
        reason = chunks[-1]["choices"][0]["finish_reason"]
        logprobs = [
          lp
          for c in chunks
          if c["choices"][0]["logprobs"]
          for lp in c["choices"][0]["logprobs"]["token_logprobs"]
        ]
      else:
        status, body = results[i]
        text, reason = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
        logprobs = (body["choices"][0]["logprobs"] or {}).get("token_logprobs", [])
      self.assertEqual(status, 200, jobs[i])
      self.assertEqual(text, want.text, jobs[i])
      self.assertEqual(reason, finish[want.finish_reason], jobs[i])
      if "logprobs" in jobs[i]["body"]:
        np.testing.assert_allclose(logprobs, want.logprobs, atol=1e-5)

    # Every cancelled request either was aborted or had finished before its client left.
    for i in cancelled:
      self.assertIn(results[i][0], (200, "gave up", "completed"))
    aborted = metrics.counter("looped:requests_aborted_total")
    finished = sum(
      metrics.counter("vllm:request_success_total", finished_reason=r) for r in ("stop", "length")
    )
    self.assertEqual(finished + aborted, len(good) + len(cancelled))
    self.assertGreater(aborted, 0)
    self.assertGreater(loop.stats.num_preemptions, 0)
    self.assertGreater(loop.stats.first_cached_tokens, 0)


if __name__ == "__main__":
  absltest.main()
