"""What stands between a client and the routes: a body-size limit, clients that go away while
sending, and OpenAI's JSON error object for every error, the unexpected ones included.

The limit is an ASGI middleware rather than a check in each route so that no route reads more
than `max_body_bytes` of any body: a Content-Length over the limit is refused before a byte is
read, and a body that grows past it (chunked, or a lying Content-Length) stops being read there.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

_KINDS = {
  400: "invalid_request_error",
  404: "not_found_error",
  405: "invalid_request_error",
  413: "invalid_request_error",
  429: "rate_limit_error",
}


def error_body(message: str, status: int, param: str | None = None) -> dict:
  """OpenAI's error object."""
  kind = _KINDS.get(status, "server_error")
  return {"error": {"message": message, "type": kind, "param": param, "code": None}}


class _TooLarge(Exception):
  pass


class BodyLimit:
  """Refuses bodies over max_bytes with a 413, and ends quietly when a client disconnects
  before its body is complete (nothing can be answered to it)."""

  def __init__(self, app, max_bytes: int):
    self.app = app
    self.max_bytes = max_bytes

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    headers = dict(scope.get("headers") or ())
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
      return await self._refuse(send, f"declares {int(declared)}")
    seen = 0
    started = False

    async def limited_receive():
      nonlocal seen
      message = await receive()
      if message["type"] == "http.request":
        seen += len(message.get("body", b""))
        if seen > self.max_bytes:
          raise _TooLarge
      return message

    async def tracked_send(message):
      nonlocal started
      started = started or message["type"] == "http.response.start"
      await send(message)

    try:
      await self.app(scope, limited_receive, tracked_send)
    except _TooLarge:
      if not started:
        await self._refuse(send, "sent more")
    except ClientDisconnect:
      log.debug("client disconnected before its body was complete")

  async def _refuse(self, send, what: str) -> None:
    body = error_body(
      f"the request body is over {self.max_bytes} bytes (serve.max_body_bytes): it {what}.", 413
    )
    payload = json.dumps(body).encode()
    await send(
      {
        "type": "http.response.start",
        "status": 413,
        "headers": [
          (b"content-type", b"application/json"),
          (b"content-length", str(len(payload)).encode()),
          (b"connection", b"close"),
        ],
      }
    )
    await send({"type": "http.response.body", "body": payload})


def install(app: FastAPI, max_body_bytes: int) -> None:
  """Adds the body limit and JSON error handlers for routing errors and unexpected ones."""

  async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    message = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed"}
    text = message.get(e.status_code, str(e.detail))
    return JSONResponse(error_body(text, e.status_code), status_code=e.status_code)

  async def unexpected(request: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error on %s", request.url.path)
    body = error_body(f"internal error: {type(e).__name__}", 500)
    return JSONResponse(body, status_code=500)

  app.add_exception_handler(HTTPException, http_error)
  app.add_exception_handler(Exception, unexpected)
  app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
