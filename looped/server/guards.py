"""What stands between a client and the routes: a body-size limit and a body deadline, clients
that go away while sending, and OpenAI's JSON error object for every error, the unexpected ones
and the HTTP parser's included.

The limits are an ASGI middleware rather than checks in each route so that no route reads more
than `max_body_bytes` of any body, or waits longer than `body_timeout_s` for one: a
Content-Length over the limit is refused before a byte is read, a body that grows past it
(chunked, or a lying Content-Length) stops being read there, and a body that stops arriving is
answered 408 at its deadline. `HttpProtocol` is uvicorn's h11 connection with two changes: a
request the HTTP parser refuses (malformed, or a header over h11's size bound) gets OpenAI's
JSON error object instead of uvicorn's plain text, and a connection buffers little of its
responses (`WRITE_BUFFER_BYTES`), so a stream whose client stops reading is seen to (app.py).
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from looped.server import protocol

log = logging.getLogger(__name__)

_KINDS = {
  400: "invalid_request_error",
  404: "not_found_error",
  405: "invalid_request_error",
  408: "invalid_request_error",
  413: "invalid_request_error",
  429: "rate_limit_error",
}
# What a connection's transport holds of its responses before a send waits for the socket
# (asyncio's default is 64 KiB): with program.bind's send buffer, what a client that stopped
# reading can be sent before its stream sees it.
WRITE_BUFFER_BYTES = 16 << 10


def error_body(message: str, status: int, param: str | None = None) -> dict:
  """OpenAI's error object."""
  kind = _KINDS.get(status, "server_error")
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class _TooLarge(Exception):
  pass


class _TooSlow(Exception):
  pass


class BodyLimit:
  """Refuses bodies over max_bytes with a 413 and bodies not complete within timeout_s of the
  request's start with a 408, and ends quietly when a client disconnects before its body is
  complete (nothing can be answered to it)."""

  def __init__(self, app, max_bytes: int, timeout_s: float):
    self.app = app
    self.max_bytes = max_bytes
    self.timeout_s = timeout_s

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope.get("headers") or ())
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit():
      # More digits than the limit has is over it (int() of 5,000 digits would fail).
      digits = declared.lstrip(b"0") or b"0"
      if len(digits) > len(str(self.max_bytes)) or int(digits) > self.max_bytes:
        shown = digits.decode() if len(digits) <= 20 else f"a {len(digits)}-digit number of"
        return await self._refuse(send, 413, f"it declares {shown} bytes")
    seen = 0
    started = False
    complete = False
    deadline = asyncio.get_running_loop().time() + self.timeout_s

    async def limited_receive():
      nonlocal seen, complete
      if complete:  # Only the disconnect is left to wait for, as long as it takes.
        return await receive()
      left = deadline - asyncio.get_running_loop().time()
      try:
        message = await asyncio.wait_for(receive(), max(left, 0))
      except asyncio.TimeoutError:
        raise _TooSlow from None
      if message["type"] == "http.request":
        seen += len(message.get("body", b""))
        if seen > self.max_bytes:
          raise _TooLarge
        complete = not message.get("more_body", False)
      return message

    async def tracked_send(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, limited_receive, tracked_send)
    except _TooLarge:
      if not started:
        await self._refuse(send, 413, "it sent more")
    except _TooSlow:
      if not started:
        await self._refuse(send, 408, f"{seen} bytes arrived")
    except ClientDisconnect:
      log.debug("client disconnected before its body was complete")

  async def _refuse(self, send, status: int, what: str) -> None:
    if status == 413:
      message = f"the request body is over {self.max_bytes} bytes (serve.max_body_bytes): {what}."
    else:
      message = (
        f"the request body was not complete {self.timeout_s:g} s after the request began "
        f"(serve.body_timeout_s): {what}."
      )
    payload = json.dumps(error_body(message, status)).encode()
    await send(
      {
        "type": "http.response.start",
        "status": status,
        "headers": [
          (b"content-type", b"application/json"),
          (b"content-length", str(len(payload)).encode()),
          (b"connection", b"close"),
        ],
      }
    )
    await send({"type": "http.response.body", "body": payload})


def install(app: FastAPI, max_body_bytes: int, body_timeout_s: float) -> None:
  """Adds the body limits and JSON error handlers for routing errors and unexpected ones."""

  async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    path = protocol.bounded(request.url.path)
    message = {404: f"no route {path}", 405: f"{protocol.bounded(request.method)} is not allowed"}
    text = message.get(e.status_code, str(e.detail))
    return JSONResponse(error_body(text, e.status_code), status_code=e.status_code)

  async def unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    body = error_body(f"internal error: {type(e).__name__}", 500)
    return JSONResponse(body, status_code=500)

  app.add_exception_handler(HTTPException, http_error)
  app.add_exception_handler(Exception, unexpected)
  app.add_middleware(BodyLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)


class HttpProtocol(H11Protocol):
  """uvicorn's h11 connection (pass as uvicorn.Config(http=...)) that answers what the HTTP
  parser refuses with OpenAI's JSON error object, holds at most WRITE_BUFFER_BYTES of unsent
  response before a send waits, and closes a connection whose request head (the request line
  and headers) is not complete within uvicorn's timeout_keep_alive (5 s) of the connection
  opening or of its head's first bytes: uvicorn itself waits for a head forever, and a
  request's body deadline (BodyLimit) starts only once the head is complete."""

  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
    self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_late)

  def data_received(self, data: bytes) -> None:
    super().data_received(data)
    if self._head_timer is None and self._head_incomplete():
      self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_late)

  def connection_lost(self, exc) -> None:
    if self._head_timer is not None:
      self._head_timer.cancel()
    super().connection_lost(exc)

  def _head_incomplete(self) -> bool:
    """No request is under way, and the connection is new or holds part of a request's head."""
    fresh = self.cycle is None
    return self.conn.their_state is h11.IDLE and (fresh or bool(self.conn.trailing_data[0]))

  def _head_late(self) -> None:
    self._head_timer = None
    if self._head_incomplete() and not self.transport.is_closing():
      log.debug("closing a connection whose request head did not arrive in time")
      self.transport.close()

  def send_400_response(self, msg: str) -> None:
    """What uvicorn sends for a request h11 cannot parse, as JSON; the connection closes."""
    payload = json.dumps(error_body(f"the HTTP request is malformed: {msg}", 400)).encode()
    headers = [
      (b"content-type", b"application/json"),
      (b"content-length", str(len(payload)).encode()),
      (b"connection", b"close"),
    ]
    for event in (
      h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
      h11.Data(data=payload),
      h11.EndOfMessage(),
    ):
      self.transport.write(self.conn.send(event))
    self.transport.close()
