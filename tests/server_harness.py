"""A server on 127.0.0.1 in a thread of this process, for tests and benchmarks.

The same app and engine loop as `configs/serve.py` runs, on a real socket, so clients talk HTTP
to it; only the process is shared, which lets a test look at the engine loop (pages in use)
directly and saves a second JAX start-up and compilation.
"""

from __future__ import annotations

import asyncio
import threading
import time

from looped.server import program
from looped.server.engine_loop import EngineLoop


class ServerThread:
  """`with ServerThread(app, loop) as s:` serves on s.url until the block ends."""

  def __init__(self, app, loop: EngineLoop, *, start_timeout_s: float = 60.0):
    import uvicorn

    self.loop = loop
    self._sock = program.bind("127.0.0.1", 0)
    self.port = self._sock.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
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
