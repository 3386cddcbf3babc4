"""Program 'server': restore a model and serve it over HTTP until SIGTERM (configs/serve.py).

validate(config) checks every field, the checkpoint and that the KV budget holds one request of
the model's whole context before anything is restored or bound. run(config, workdir) builds the
engine and its loop, binds the socket, writes WORKDIR/server.json ({host, port, url, pid,
model}) once connections are accepted, and on SIGTERM or Ctrl-C stops accepting, lets the
requests in flight finish, stops the loop and returns the final counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from typing import Any

import ml_collections
from absl import logging

from looped import config_checks as cc
from looped import schema
from looped.checkpoints import model_record, restore
from looped.data import tokenizers
from looped.engine import checks
from looped.engine import mesh as mesh_lib
from looped.engine.engine import Engine
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM
from looped.server import guards, protocol
from looped.server.app import create_app
from looped.server.config import ServeConfig
from looped.server.engine_loop import EngineLoop
from looped.server.metrics import Metrics


def _model(config, chosen=()) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  return model_record.model_and_data(config, config.serve.checkpoint, chosen)


def model_source(config) -> str:
  """The checkpoint directory whose recorded model this program uses (looped.programs)."""
  return config.serve.checkpoint


def validate(config, chosen: tuple[str, ...] = ()) -> ServeConfig:
  """Checks every field before any compute; raises ConfigError naming the field. chosen: the
  recorded model fields the command line chose (looped.programs). Returns the typed section."""
  cc.choice(config, "program", ("server",))
  s = schema.load(ServeConfig, config, "serve")
  restore.check_checkpoint(config, "serve")
  model_cfg, data_cfg = _model(config, chosen)
  mesh_shape, _ = mesh_lib.from_config(config, model_lib.from_config(model_cfg))
  cfg, _, policy = checks.check_section(s, "serve", model_cfg, mesh_shape)
  tokenizers.get(data_cfg)
  if s.kv_budget_bytes is None:
    cc.fail("serve.kv_budget_bytes", None, "must be a finite number > 0 (bytes of the pool)")
  need = -(-(cfg.max_seq_len - 1) // s.page_size)
  what = f"a request of the model's whole context (max_seq_len {cfg.max_seq_len})"
  checks.check_budget(s, "serve", cfg, policy, need, what)
  return s


def build(config, chosen: tuple[str, ...] = ()) -> tuple[Any, EngineLoop]:
  """The app and its (started) engine loop for a validated config."""
  s = schema.load(ServeConfig, config, "serve")
  model_cfg, data_cfg = _model(config, chosen)
  cfg = model_lib.from_config(model_cfg)
  model = LoopedLM(cfg)
  tokenizer = tokenizers.get(data_cfg)
  params = restore.restore_params(model, s.checkpoint, s.step, "serve.checkpoint")
  policy = checks.kv_policy_of(s, "serve", cfg)
  mesh_shape, mesh_rules = mesh_lib.from_config(config, cfg)
  settings = checks.engine_config(
    s,
    cfg,
    policy,
    num_pages=checks.num_pages(s, cfg, policy),
    mesh_shape=mesh_shape,
    mesh_rules=mesh_rules,
    top_logprobs=max(s.max_logprobs, 1),
  )
  engine = Engine(model, params, settings, decode=tokenizer.decode)
  name = s.model_name or os.path.basename(os.path.normpath(s.checkpoint))
  return serve_engine(
    engine,
    tokenizer,
    name,
    max_waiting=s.max_waiting,
    max_logprobs=s.max_logprobs,
    warmup=s.warmup,
    max_body_bytes=s.max_body_bytes,
    body_timeout_s=s.body_timeout_s,
    stream_backlog=s.stream_backlog,
  )


def serve_engine(
  engine: Engine,
  tokenizer,
  name: str,
  *,
  max_waiting: int,
  max_logprobs: int,
  warmup: bool = False,
  max_body_bytes: int = 1 << 22,
  body_timeout_s: float = 60.0,
  stream_backlog: int = 64,
):
  """An app and a started loop around an Engine (also what tests build directly); warmup: the
  loop compiles every step shape before it is ready (EngineLoop)."""
  limits = protocol.Limits(
    model_name=name,
    max_model_len=engine.max_model_len,
    vocab_size=engine.model.cfg.vocab_size,
    max_logprobs=max_logprobs,
    max_pages=engine.num_pages,
    page_size=engine.config.page_size,
    max_batch=max(1, max_waiting),
    max_body_bytes=max_body_bytes,
    body_timeout_s=body_timeout_s,
    stream_backlog=stream_backlog,
    max_recurrences=engine.model.cfg.num_recurrences,
    exit_gate=engine.model.cfg.exit_gate,
    depth=engine.engine_config.depth,
    trained_recurrences=engine.trained_recurrences,
    speculates=engine.executor.spec_steps is not None,
    max_speculative_tokens=engine.engine_config.max_speculative_tokens,
    speculative=engine.engine_config.speculative,
  )
  loop = EngineLoop(engine, max_waiting=max_waiting, metrics=Metrics(name), warmup=warmup)
  loop.start()
  app = create_app(loop, tokenizer, limits, stop_token_ids=(tokenizer.eos_id,))
  return app, loop


# Each connection's kernel send buffer (Linux doubles it), set on the listening socket, whose
# connections inherit it. Left to itself Linux grows a buffer to 4 MiB, which would take ~20,000
# streamed tokens for a client that stopped reading before the server could see it (app._Call).
SEND_BUFFER_BYTES = 64 << 10


def bind(host: str, port: int) -> socket.socket:
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  sock = socket.socket(family, socket.SOCK_STREAM)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise cc.ConfigError(f"config.serve.host:port = {host}:{port} cannot be bound: {e}") from None
  sock.listen(2048)
  return sock


async def _serve(server, sock: socket.socket, loop: EngineLoop, on_started) -> None:
  """Serves; on_started runs once the socket accepts and the engine has warmed up (until then
  /health answers 503)."""
  task = asyncio.ensure_future(server.serve(sockets=[sock]))
  while not (server.started and loop.ready.is_set()) and not task.done():
    await asyncio.sleep(0.02)
  if server.started and loop.ready.is_set():
    on_started()
  await task


def run(config, workdir: str, chosen: tuple[str, ...] = ()) -> dict[str, Any]:
  import uvicorn  # Lazy: validation alone does not import the HTTP stack.

  s = validate(config, chosen)
  app, loop = build(config, chosen)
  sock = bind(s.host, s.port)
  host, port = sock.getsockname()[:2]
  url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
  os.makedirs(workdir, exist_ok=True)
  name = loop.metrics.base["model_name"]
  info = {"host": host, "port": port, "url": url, "pid": os.getpid(), "model": name}

  def started() -> None:
    with open(os.path.join(workdir, "server.json.tmp"), "w") as f:
      json.dump(info, f)
    os.replace(os.path.join(workdir, "server.json.tmp"), os.path.join(workdir, "server.json"))
    logging.info(
      "serving %s on %s (warm-up: %d step shapes in %.1f s)",
      name,
      url,
      loop.warmup_shapes,
      loop.warmup_s or 0.0,
    )

  server = uvicorn.Server(
    uvicorn.Config(
      app,
      http=guards.HttpProtocol,
      log_level="warning",
      lifespan="off",
      timeout_graceful_shutdown=s.drain_timeout_s,
      access_log=False,
    )
  )
  # uvicorn re-raises the signal it caught once it has drained; no-op handlers keep that from
  # killing the process (or raising KeyboardInterrupt) before the engine loop is stopped.
  signals = (signal.SIGTERM, signal.SIGINT)
  previous = {sig: signal.signal(sig, lambda *_: None) for sig in signals}
  try:
    asyncio.run(_serve(server, sock, loop, started))
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)
    loop.stop()
  stats = {
    "pages_in_use_at_end": loop.pages_in_use(),
    "hit_rate": loop.hit_rate(),
    "finished": loop.metrics.counter("vllm:request_success_total", finished_reason="stop")
    + loop.metrics.counter("vllm:request_success_total", finished_reason="length"),
  }
  with open(os.path.join(workdir, "server_stats.json"), "w") as f:
    json.dump(stats, f, indent=1)
  logging.info("server stopped: %s", stats)
  return stats
