"""A server on 127.0.0.1 in a thread of this process, for tests and benchmarks.

The same app and engine loop as `configs/serve.py` runs, on a real socket, so clients talk HTTP
to it; only the process is shared, which lets a test look at the engine loop (pages in use)
directly and saves a second JAX start-up and compilation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp

import looped_testing as testing
from looped.data.tokenizers import BytesTokenizer
from looped.engine.engine import Engine, EngineConfig
from looped.model import init_params
from looped.model.looped_lm import LoopedLM
from looped.server import guards, program
from looped.server.engine_loop import EngineLoop

# A tiny random model with the bytes vocabulary: requests are text, steps take milliseconds.
TINY_SERVED_MODEL = dataclasses.replace(testing.TINY_MODEL, vocab_size=257, max_seq_len=32)


def tiny_engine(model_config=TINY_SERVED_MODEL, **config) -> tuple[Engine, BytesTokenizer]:
  """An engine on model_config's random params (TINY_SERVED_MODEL; shared layout, 32 pages of 4
  tokens, up to 4 rows of 16 tokens a step, top-5 logprobs; `config` overrides EngineConfig
  fields) and its tokenizer."""
  tok = BytesTokenizer()
  model = LoopedLM(model_config)
  params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  fields = dict(
    share_kv=True,
    num_pages=32,
    page_size=4,
    max_num_batched_tokens=16,
    max_num_seqs=4,
    top_logprobs=5,
  )
  return Engine(model, params, EngineConfig(**{**fields, **config}), decode=tok.decode), tok


class ServerThread:
  """`with ServerThread(app, loop) as s:` serves on s.url until the block ends."""

  def __init__(self, app, loop: EngineLoop, *, start_timeout_s: float = 60.0):
    import uvicorn

    self.loop = loop
    self._sock = program.bind("127.0.0.1", 0)
    self.port = self._sock.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    config = uvicorn.Config(
      app, http=guards.HttpProtocol, log_level="warning", lifespan="off", access_log=False
    )
    self.server = uvicorn.Server(config)
    self._timeout = start_timeout_s
    self._thread = threading.Thread(
      target=lambda: asyncio.run(self.server.serve(sockets=[self._sock])),
      name="uvicorn",
      daemon=True,
    )

  def __enter__(self) -> ServerThread:
    self._thread.start()
    deadline = time.monotonic() + self._timeout
    while not (self.server.started and self.loop.ready.is_set()):
      if time.monotonic() > deadline or not self._thread.is_alive():
        raise RuntimeError("the server did not start (or warm up).")
      time.sleep(0.01)
    return self

  def __exit__(self, *exc) -> None:
    self.server.should_exit = True
    self._thread.join(30)
    self.loop.stop(30)

  def wait_idle(self, timeout_s: float = 30.0) -> None:
    """Until no request is queued or running (cancellations are processed asynchronously) and
    no HTTP handler is left: one still waiting for an engine event would never end."""
    deadline = time.monotonic() + timeout_s
    state = self.server.server_state
    while (
      self.loop.num_running()
      or self.loop.num_waiting()
      or self.loop.pending_cancels()
      or state.tasks
      or state.connections
    ):
      if time.monotonic() > deadline:
        raise TimeoutError(
          f"not idle: {self.loop.num_running()} running, {self.loop.num_waiting()} waiting, "
          f"{len(state.tasks)} handlers, {len(state.connections)} connections."
        )
      time.sleep(0.01)
