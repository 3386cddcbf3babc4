"""A minimal blocking HTTP client for the server (tests, benchmarks/serve_replay.py).

Standard library only (http.client), so a load generator needs no client package and can close
a stream's socket mid-response to test cancellation.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any


def _connection(url: str, timeout_s: float) -> http.client.HTTPConnection:
  parts = urllib.parse.urlsplit(url)
  return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)


def request(
  url: str, method: str = "GET", body: Any = None, *, raw: bytes | None = None, timeout_s=60.0
) -> tuple[int, Any]:
  """(status, parsed JSON or text) of one request; `raw` sends bytes as they are."""
  conn = _connection(url, timeout_s)
  try:
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    conn.request(method, urllib.parse.urlsplit(url).path or "/", body=data, headers=headers)
    response = conn.getresponse()
    payload = response.read().decode("utf-8")
    kind = response.getheader("Content-Type", "")
    return response.status, json.loads(payload) if "json" in kind else payload
  finally:
    conn.close()


class Stream:
  """A streamed completion: iterate over its events (parsed `data:` objects); `close()` drops
  the connection (the server then cancels the request). `status` and `error` are set when the
  server refused it."""

  def __init__(self, url: str, body: dict, timeout_s: float = 60.0):
    self.conn = _connection(url, timeout_s)
    self.conn.request(
      "POST",
      urllib.parse.urlsplit(url).path,
      body=json.dumps({**body, "stream": True}).encode(),
      headers={"Content-Type": "application/json"},
    )
    self.response = self.conn.getresponse()
    self.status = self.response.status
    self.error = None if self.status == 200 else json.loads(self.response.read())
    self.done = False  # Saw `[DONE]`.

  def __iter__(self) -> Iterator[dict]:
    if self.error is not None:
      return
    for line in self.response:
      line = line.decode("utf-8").rstrip("\r\n")
      if not line.startswith("data: "):
        continue
      data = line[len("data: ") :]
      if data == "[DONE]":
        self.done = True
        return
      yield json.loads(data)

  def close(self) -> None:
    """Closes the socket itself: the response's file object would otherwise keep it open."""
    if self.conn.sock is not None:
      try:
        self.conn.sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    self.response.close()
    self.conn.close()


def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
  """Polls /health until it answers 200."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      if request(url + "/health", timeout_s=5)[0] == 200:
        return
    except OSError:
      pass
    if time.monotonic() > deadline:
      raise TimeoutError(f"{url} did not become healthy in {timeout_s} s.")
    time.sleep(0.1)
