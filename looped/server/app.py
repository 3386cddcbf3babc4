"""The HTTP layer: OpenAI's `/v1/completions`, `/v1/chat/completions` and `/v1/models`,
`/health`, `/metrics`.

Handlers parse and check a request (protocol.py; a chat is rendered into one prompt with the
model's chat template, chat.py), hand one engine request per prompt to the engine loop and turn
its events into OpenAI's response objects or server-sent events, in the shape of the endpoint
(`_TEXT`, `_CHAT`). A task per request watches for the client going away and cancels the
request, which frees its pages; a stream whose client stops reading is cancelled once
`Limits.stream_backlog` of its tokens wait to be sent (`_Call`). `create_app` routes each
endpoint to one method of `_Routes`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.server import chat, guards, openapi, protocol
from looped.server.engine_loop import Done, EngineLoop, Failed, QueueFull, Token, Warming

_FINISH = {"length": "length", "stop_token": "stop", "stop_string": "stop"}


def token_text(tokenizer, token: int) -> str:
  """A token's text; one that is not text by itself (part of a UTF-8 character, EOS) is named
  'token_id:N' (vLLM's convention), so top_logprobs keys stay distinct."""
  text = tokenizer.decode([token])
  return text if text and "\ufffd" not in text else f"token_id:{token}"


class TextStream:
  """Deltas of a growing text that never take back what was sent: text that a stop string may
  still cut, or a trailing incomplete UTF-8 character, is held back until it is settled."""

  def __init__(self, stop: Sequence[str]):
    self.hold = max((len(s) for s in stop), default=1) - 1
    self.sent = 0

  def delta(self, text: str, final: bool) -> str:
    end = len(text) if final else len(text) - self.hold
    if not final:
      while end > self.sent and text[end - 1] == "\ufffd":
        end -= 1
    out = text[self.sent : end] if end > self.sent else ""
    self.sent += len(out)
    return out


class _Logprobs:
  """OpenAI's legacy logprobs object (/v1/completions), built token by token."""

  def __init__(self, tokenizer, k: int):
    self.tokenizer, self.k = tokenizer, k
    self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []

  def add(self, token: int, logprob: float | None, top, offset: int) -> None:
    self.tokens.append(token_text(self.tokenizer, token))
    self.token_logprobs.append(logprob)
    if top is None or not self.k:
      self.top_logprobs.append(None if top is None else {})
    else:
      ids, lps = top
      self.top_logprobs.append(
        {token_text(self.tokenizer, i): lp for i, lp in zip(ids[: self.k], lps[: self.k])}
      )
    self.text_offset.append(offset)

  def payload(self) -> protocol.Logprobs:
    out = {
      "tokens": self.tokens,
      "token_logprobs": self.token_logprobs,
      "top_logprobs": self.top_logprobs,
      "text_offset": self.text_offset,
    }
    self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
    return out


class _ChatLogprobs:
  """The chat API's logprobs object ({"content": [{token, logprob, bytes, top_logprobs}]}),
  built token by token."""

  def __init__(self, tokenizer, k: int):
    self.tokenizer, self.k = tokenizer, k
    self.content: list[protocol.TokenLogprob] = []

  def _entry(self, token: int, logprob: float) -> protocol.TopLogprob:
    text = token_text(self.tokenizer, token)
    raw = None if text.startswith("token_id:") else list(text.encode("utf-8"))
    return {"token": text, "logprob": logprob, "bytes": raw}

  def add(self, token: int, logprob: float, top, offset: int) -> None:
    del offset  # The chat object has none.
    ids, lps = top if top is not None else ((), ())
    alternatives = [self._entry(i, lp) for i, lp in zip(ids[: self.k], lps[: self.k])]
    self.content.append({**self._entry(token, logprob), "top_logprobs": alternatives})

  def payload(self) -> protocol.ChatLogprobs:
    out, self.content = {"content": self.content}, []
    return out


def _prompt_logprobs(out: _Logprobs, prompt: protocol.Prompt, positions: dict, tokenizer) -> None:
  """Echoed prompt tokens: token p's logprob comes from position p - 1 (none for the first)."""
  for p, token in enumerate(prompt.tokens):
    before = positions.get(p - 1)
    offset = len(tokenizer.decode(list(prompt.tokens[:p])))
    out.add(token, None if before is None else before[0], before and before[1:], offset)


def _error(e: protocol.RequestError) -> JSONResponse:
  """OpenAI's error object, with the error's status."""
  return JSONResponse(guards.error_body(str(e), e.status, e.param), status_code=e.status)


async def _field(request: Request, name: str, valid, message: str, then=None):
  """Field `name` of a JSON object body, or then(value); protocol.RequestError (naming the
  field) when the body is not a JSON object or valid(value) is false. Parsed and checked on a
  worker thread: a large body does not hold the event loop (/health, the streams in flight)."""

  def parse(raw: bytes):
    value = protocol.json_object(raw).get(name)
    if not valid(value):
      raise protocol.RequestError(message, name)
    return value if then is None else then(value)

  return await asyncio.to_thread(parse, await request.body())


async def _watch_disconnect(request: Request, on_gone) -> None:
  """Returns when the client disconnects (calling on_gone) or the response is complete."""
  while True:
    message = await request.receive()
    if message["type"] == "http.disconnect":
      on_gone()
      return


def create_app(
  loop: EngineLoop,
  tokenizer,
  limits: protocol.Limits,
  *,
  stop_token_ids: tuple[int, ...],
  chat_template: chat.ChatTemplate | None = None,
) -> FastAPI:
  """stop_token_ids: tokens that end a request unless it sets ignore_eos (the tokenizer's EOS).
  chat_template: what renders a chat's messages (None: the tokenizer's, chat.for_tokenizer)."""
  app = FastAPI(title="looped", docs_url=None, redoc_url=None, openapi_url=None)
  guards.install(app, limits.max_body_bytes, limits.body_timeout_s)
  template = chat_template or chat.for_tokenizer(tokenizer)
  routes = _Routes(loop, tokenizer, limits, stop_token_ids, template)
  app.add_api_route("/health", routes.health, methods=["GET"])
  app.add_api_route("/openapi.json", routes.openapi, methods=["GET"])
  app.add_api_route("/v1/models", routes.models, methods=["GET"])
  app.add_api_route("/tokenizer_info", routes.tokenizer_info, methods=["GET"])
  app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
  app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
  app.add_api_route("/metrics", routes.prometheus, methods=["GET"])
  app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
  app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
  return app


class _Routes:
  """One handler per endpoint, over what they share: the engine loop, the tokenizer, the chat
  template, the limits and the request-id counter."""

  def __init__(
    self, loop: EngineLoop, tokenizer, limits: protocol.Limits, stop_token_ids, chat_template
  ):
    self.loop, self.tokenizer, self.limits = loop, tokenizer, limits
    self.stop_token_ids = stop_token_ids
    self.chat_template = chat_template
    self.metrics = loop.metrics
    self.ids = itertools.count()
    self.created = int(time.time())
    self.document = openapi.document(limits)

  def _refuse(self, e: protocol.RequestError, reason: str) -> JSONResponse:
    """A refused completion: counted by reason, answered with OpenAI's error object."""
    self.metrics.inc("looped:requests_rejected_total", reason=reason)
    return _error(e)

  async def health(self) -> Response:
    if not self.loop.alive():
      return JSONResponse(guards.error_body("the engine is not running.", 503), status_code=503)
    if not self.loop.ready.is_set():
      message = f"warming up: compiling step shapes ({self.loop.warmup_progress})."
      return JSONResponse(guards.error_body(message, 503), status_code=503)
    return JSONResponse({"status": "ok"})

  async def openapi(self) -> JSONResponse:
    return JSONResponse(self.document)

  async def models(self) -> JSONResponse:
    card = {
      "id": self.limits.model_name,
      "object": "model",
      "created": self.created,
      "owned_by": "looped",
      "max_model_len": self.limits.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})

  # vLLM's tokenizer endpoints: lm-evaluation-harness's `local-completions` finds them and then
  # tokenizes with the served model's own tokenizer (its "remote" tokenizer backend).
  async def tokenizer_info(self) -> JSONResponse:
    tokenizer = self.tokenizer
    eos = tokenizer.decode([tokenizer.eos_id]) or None  # The bytes tokenizer's EOS has no text.
    return JSONResponse(
      {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": eos,
        # Not vLLM's: lm-eval finds the EOS id by tokenizing eos_token, which the bytes and
        # SentencePiece EOS lack, so a client passes this one (its custom_prefix_token_id).
        "eos_token_id": int(tokenizer.eos_id),
        "bos_token": None,
        "pad_token": None,
        "model_max_length": self.limits.max_model_len,
        "vocab_size": self.limits.vocab_size,
      }
    )

  async def tokenize(self, request: Request) -> JSONResponse:
    def encode(prompt: str) -> list[int]:
      return [
        int(t) for t in self.tokenizer.encode(protocol.check_text(prompt, "prompt", "prompt"))
      ]

    try:
      tokens = await _field(
        request, "prompt", lambda p: isinstance(p, str), "prompt must be a string.", encode
      )
    except protocol.RequestError as e:
      return _error(e)
    return JSONResponse(
      {"tokens": tokens, "count": len(tokens), "max_model_len": self.limits.max_model_len}
    )

  async def detokenize(self, request: Request) -> JSONResponse:
    vocab = self.limits.vocab_size
    try:
      text = await _field(
        request,
        "tokens",
        lambda ts: isinstance(ts, list) and all(protocol.is_int(t) and 0 <= t < vocab for t in ts),
        f"tokens must be a list of token ids in [0, {vocab}).",
        self.tokenizer.decode,
      )
    except protocol.RequestError as e:
      return _error(e)
    return JSONResponse({"prompt": text})

  async def prometheus(self) -> PlainTextResponse:
    return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

  async def completions(self, request: Request) -> Response:
    try:  # Off the event loop: /health and streams go on while a large body is checked.
      params = await asyncio.to_thread(
        protocol.parse, await request.body(), self.tokenizer, self.limits
      )
    except protocol.RequestError as e:
      return self._refuse(e, "invalid")
    return await self._serve(request, params, _TEXT)

  async def chat_completions(self, request: Request) -> Response:
    try:  # The template renders on the worker thread too.
      params = await asyncio.to_thread(
        protocol.parse_chat,
        await request.body(),
        self.tokenizer,
        self.limits,
        self.chat_template.render,
      )
    except protocol.RequestError as e:
      return self._refuse(e, "invalid")
    return await self._serve(request, params, _CHAT)

  async def _serve(self, request: Request, params: protocol.Completion, shape) -> Response:
    """Submits one engine request per prompt, then streams the first one's tokens or answers
    with every prompt's choice once all are done, in the endpoint's shape."""
    sampling = SamplingParams(
      max_new_tokens=params.max_tokens,
      temperature=params.temperature,
      top_k=params.top_k,
      top_p=params.top_p,
      seed=params.seed,
      stop_token_ids=() if params.ignore_eos else self.stop_token_ids,
      stop_strings=params.stop,
    )
    # Echo needs every prompt position's logprob, top alternatives every token's.
    positions = params.logprobs is not None and (params.echo or params.logprobs > 0)
    engine_requests = [
      GenRequest(
        next(self.ids),
        p.tokens,
        sampling,
        prompt_text=p.text,
        position_logprobs=positions,
        depth=params.depth,
        speculative=params.speculative,
      )
      for p in params.prompts
    ]
    backlog = self.limits.stream_backlog if params.stream else None
    call = _Call(self.loop, engine_requests, backlog, self.metrics)
    try:
      self.loop.submit(engine_requests, call.sinks(asyncio.get_running_loop()))
    except QueueFull as e:
      return self._refuse(
        protocol.RequestError(f"the server is busy: {e}", None, 429), "queue_full"
      )
    except Warming as e:
      return _error(protocol.RequestError(str(e), None, 503))
    except ValueError as e:  # The engine's own checks (protocol.parse should have caught it).
      return self._refuse(protocol.RequestError(str(e)), "invalid")
    call.watcher = asyncio.ensure_future(_watch_disconnect(request, call.gone))
    head = {
      "id": f"{shape.id_prefix}{uuid.uuid4().hex}",
      "object": shape.object,
      "created": int(time.time()),
      "model": self.limits.model_name,
    }
    spec = self.limits.speculative if params.speculative is None else params.speculative
    usage = functools.partial(_usage, speculating=spec.enabled)
    if params.stream:
      head = {**head, "object": shape.chunk_object}
      stream = _stream(params, call, head, self.tokenizer, shape, usage)
      return StreamingResponse(stream, media_type="text/event-stream")
    return await _answer(params, call, head, self.tokenizer, shape, usage)


class _Call:
  """The engine requests of one HTTP request: an event queue each, which have finished, and the
  cancel of the others when the client goes away or, streaming, falls behind.

  backlog: for a stream, the most token events that may wait in its queue (sent by the engine,
  not yet written to the client's connection); one more cancels the request, frees its pages and
  queues an error event after the waiting tokens. A stream's events wait there only once the
  connection's buffers are full (the server's send buffer, bounded in program.bind, and the
  client's receive buffer), that is when its client has stopped reading: such a client holds
  the engine for a bounded number of tokens, not for its whole max_tokens."""

  def __init__(self, loop: EngineLoop, requests: list[GenRequest], backlog, metrics):
    self.loop, self.requests, self.backlog, self.metrics = loop, requests, backlog, metrics
    self.queues = [asyncio.Queue() for _ in requests]
    self.finished: set[int] = set()
    self.watcher: asyncio.Future | None = None

  def sinks(self, aio: asyncio.AbstractEventLoop) -> list:
    """Thread-safe sinks for the engine loop: each event is queued on the event loop."""
    return [
      lambda event, i=i: aio.call_soon_threadsafe(self._deliver, i, event)
      for i in range(len(self.requests))
    ]

  def _deliver(self, i: int, event) -> None:
    queue, rid = self.queues[i], self.requests[i].request_id
    queue.put_nowait(event)
    if self.backlog is not None and isinstance(event, Token) and rid not in self.finished:
      if queue.qsize() > self.backlog:
        self.finished.add(rid)
        self.loop.cancel(rid)
        self.metrics.inc("looped:streams_stalled_total")
        message = (
          f"the client stopped reading: {queue.qsize()} tokens were waiting to be sent "
          f"(serve.stream_backlog = {self.backlog}), so the request was cancelled."
        )
        queue.put_nowait(Failed(408, message))

  def gone(self) -> None:
    """Cancels what is unfinished; a handler waiting for it gets a Failed and returns."""
    for r, q in zip(self.requests, self.queues):
      if r.request_id not in self.finished:
        self.finished.add(r.request_id)
        self.loop.cancel(r.request_id)
        q.put_nowait(Failed(499, "the client disconnected."))

  def close(self) -> None:
    if self.watcher is not None:
      self.watcher.cancel()


class _TextShape:
  """/v1/completions' objects: a choice's `text` and the legacy logprobs object."""

  id_prefix, object, chunk_object = "cmpl-", "text_completion", "text_completion"
  logprobs = _Logprobs

  def choice(self, index: int, text: str, logprobs, finish_reason: str) -> protocol.Choice:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

  def opening(self) -> dict | None:
    return None

  def chunk(self, text: str, logprobs, finish_reason: str | None) -> protocol.Choice:
    return self.choice(0, text, logprobs, finish_reason)


class _ChatShape:
  """/v1/chat/completions' objects: the assistant's `message`, in a stream a first chunk with
  its role and then `delta`s of its content; the chat logprobs object."""

  id_prefix, object, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"
  logprobs = _ChatLogprobs

  def choice(self, index: int, text: str, logprobs, finish_reason: str) -> protocol.ChatChoice:
    message = {"role": "assistant", "content": text}
    return {
      "index": index,
      "message": message,
      "logprobs": logprobs,
      "finish_reason": finish_reason,
    }

  def opening(self) -> protocol.ChatChunkChoice:
    delta = {"role": "assistant", "content": ""}
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

  def chunk(self, text: str, logprobs, finish_reason: str | None) -> protocol.ChatChunkChoice:
    delta = {"content": text} if text or finish_reason is None else {}
    return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


_TEXT, _CHAT = _TextShape(), _ChatShape()


async def _answer(params, call: _Call, head: dict, tokenizer, shape, usage) -> JSONResponse:
  """The non-streaming response: every prompt's choice and the usage (usage(prompts, dones),
  `_usage`) once all are done, or the first failure's error (cancelling the rest)."""
  try:
    choices, dones = [], []
    for i, (prompt, r, q) in enumerate(zip(params.prompts, call.requests, call.queues)):
      while not isinstance(event := await q.get(), (Done, Failed)):
        pass
      call.finished.add(r.request_id)
      if isinstance(event, Failed):
        call.gone()
        return JSONResponse(guards.error_body(event.message, event.status), event.status)
      choices.append(_choice(i, params, prompt, event, tokenizer, shape))
      dones.append(event)
  except asyncio.CancelledError:
    call.gone()
    raise
  finally:
    call.close()
  return JSONResponse({**head, "choices": choices, "usage": usage(params.prompts, dones)})


def _usage(prompts, dones: Sequence[Done], speculating: bool) -> protocol.Usage:
  """A completion's usage over its choices: OpenAI's counts, the mean recurrences of the calls
  that produced its tokens (None without any) and, when speculation is on for the request,
  the tokens its rounds drafted and the drafts kept (0 when no round ran)."""
  prompt_tokens = sum(len(p.tokens) for p in prompts)
  completion_tokens = sum(len(d.tokens) for d in dones)
  recurrences = [r for d in dones for r in d.recurrences]
  usage = {
    "prompt_tokens": prompt_tokens,
    "completion_tokens": completion_tokens,
    "total_tokens": prompt_tokens + completion_tokens,
    "mean_recurrences": sum(recurrences) / len(recurrences) if recurrences else None,
  }
  if speculating:
    usage["drafted_tokens"] = sum(d.drafted_tokens for d in dones)
    usage["accepted_tokens"] = sum(d.accepted_tokens for d in dones)
  return usage


def _choice(index: int, params, prompt: protocol.Prompt, done: Done, tokenizer, shape) -> dict:
  prefix = prompt.text if params.echo else ""
  logprobs = None
  if params.logprobs is not None:
    out = shape.logprobs(tokenizer, params.logprobs)
    if params.echo:
      _prompt_logprobs(out, prompt, done.positions, tokenizer)
    start = len(prompt.text)
    n_prompt = len(prompt.tokens)
    for j, (token, lp) in enumerate(zip(done.tokens, done.logprobs)):
      top = done.positions.get(n_prompt - 1 + j)
      offset = start + len(tokenizer.decode(done.tokens[:j]))
      out.add(token, lp, None if top is None else top[1:], offset)
    logprobs = out.payload()
  return shape.choice(index, prefix + done.text, logprobs, _FINISH[done.finish_reason])


async def _stream(params, call: _Call, head: dict, tokenizer, shape, usage) -> AsyncIterator[str]:
  """Server-sent events: a chunk per generated token (its text may be held back, see
  TextStream; with echo the first also carries the prompt; a chat's opens with the role), the
  finish reason on the last, the usage chunk if asked for (usage: `_usage`), then `[DONE]`."""
  prompt = params.prompts[0]
  request, queue = call.requests[0], call.queues[0]
  text = TextStream(params.stop)
  generated: list[int] = []
  out = None if params.logprobs is None else shape.logprobs(tokenizer, params.logprobs)

  def event(choice) -> str:
    return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

  try:
    if (opening := shape.opening()) is not None:
      yield event(opening)
    while True:
      item = await queue.get()
      if isinstance(item, Failed):
        yield f"data: {json.dumps(guards.error_body(item.message, item.status))}\n\n"
        break
      if isinstance(item, Done):
        call.finished.add(request.request_id)
        logprobs = None if out is None else out.payload()
        delta = text.delta(item.text, final=True)
        yield event(shape.chunk(delta, logprobs, _FINISH[item.finish_reason]))
        if params.include_usage:
          last = {**head, "choices": [], "usage": usage(params.prompts[:1], [item])}
          yield f"data: {json.dumps(last)}\n\n"
        break
      prefix = ""
      if not generated and params.echo:
        prefix = prompt.text
        if out is not None:
          _prompt_logprobs(out, prompt, item.prompt_positions or {}, tokenizer)
      if out is not None:
        offset = len(prompt.text) + len(tokenizer.decode(generated))
        out.add(item.token, item.logprob, item.top, offset)
      generated.append(item.token)
      logprobs = None if out is None else out.payload()
      yield event(shape.chunk(prefix + text.delta(item.text, final=False), logprobs, None))
    yield "data: [DONE]\n\n"
  finally:
    call.close()
    call.gone()
