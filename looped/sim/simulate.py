"""Program 'serve_sim': replays a request trace through the scheduler under KV memory budgets.

For every (KV budget, share_kv, kv_format) in the config's sweep it builds a page pool of
budget // page_bytes pages, a scheduler and a roofline executor for the configured model and
hardware, replays the trace and records vLLM-style metrics. Writes WORKDIR/sim/results.json,
results.md (also printed) and PNG plots against the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import time
from typing import Any

from absl import logging

from looped import config_checks as checks
from looped import kv_quant, schema
from looped.model.cache_layout import KVLayout
from looped.model.config import ModelConfig
from looped.scheduler import pages as pages_lib
from looped.scheduler import replay
from looped.scheduler import scheduler as scheduler_lib
from looped.sim import engine_cost, hardware, metrics, report, sessions, traces
from looped.sim import shape as shape_lib
from looped.sim.config import SessionsConfig, SimConfig, SyntheticConfig
from looped.sim.progress import Progress


def _as_tuple(config: Any, path: str) -> tuple:
  """A sweep field: a list/tuple, or a single value meaning a sweep of one."""
  value = checks.get(config, path)
  values = tuple(value) if isinstance(value, (list, tuple)) else (value,)
  if not values:
    checks.fail(path, value, "must list at least one value")
  return values


def budgets(config: Any) -> tuple[float | None, ...]:
  values = _as_tuple(config, "sim.kv_budget_bytes")
  for v in values:
    ok = v is None or (
      not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
    )
    if not ok:
      checks.fail("sim.kv_budget_bytes", values, "each budget must be a positive number or None")
  return tuple(None if v is None else float(v) for v in values)


def share_kv_values(config: Any) -> tuple[bool, ...]:
  values = _as_tuple(config, "sim.share_kv")
  if not all(isinstance(v, bool) for v in values):
    checks.fail("sim.share_kv", values, "must be True, False or a tuple of them")
  return values


def kv_formats(config: Any) -> tuple[str, ...]:
  """Formats to compare; 'bf16,fp8' (easy to type on a command line) means ('bf16', 'fp8')."""
  values = _as_tuple(config, "sim.kv_format")
  if all(isinstance(v, str) for v in values):
    values = tuple(
      part.strip(" ()'\"") for v in values for part in v.split(",") if part.strip(" ()'\"")
    )
  if not all(v in kv_quant.FORMATS for v in values):
    checks.fail("sim.kv_format", values, "each must be one of " + ", ".join(kv_quant.FORMATS))
  head_dim = checks.integer(config, "model.head_dim", min_value=1)
  for fmt in values:
    try:
      kv_quant.check_format(fmt, head_dim)
    except ValueError as e:
      checks.fail("sim.kv_format", values, str(e).rstrip("."))
  return values


def model_shape(config: Any) -> shape_lib.ModelShape:
  """The shape of config.model (its schema's ranges checked; only shape fields are read)."""
  schema.validate(ModelConfig, config, "model")
  if config.model.num_heads % config.model.num_kv_heads:
    checks.fail("model.num_heads", config.model.num_heads, "must be a multiple of num_kv_heads")
  return shape_lib.ModelShape.from_config(config.model)


def _hardware(config: Any) -> hardware.Hardware:
  name, path = config.sim.hardware, config.sim.hardware_json
  try:
    return hardware.load(name, path)
  except (OSError, ValueError) as e:
    raise checks.ConfigError(f"config.sim.hardware_json = {path!r} is invalid: {e}") from None


def _synthetic_spec(config: Any) -> traces.SyntheticSpec:
  """The synthetic trace of config.synthetic (validated: SyntheticConfig)."""
  kinds = {name: kind for name, (kind, _, _) in schema.fields(SyntheticConfig).items()}
  return traces.SyntheticSpec(**{k: kinds[k](v) for k, v in config.synthetic.items()})


def _sessions_config(config: Any) -> SessionsConfig:
  """The session trace's section (config.sessions), checked (looped/sim/sessions.py)."""
  schema.validate(SessionsConfig, config, "sessions")
  kinds = {name: kind for name, (kind, _, _) in schema.fields(SessionsConfig).items()}
  cfg = SessionsConfig(**{k: kinds[k](v) for k, v in config.sessions.items()})
  sessions.check(cfg)
  return cfg


def validate(config: Any) -> None:
  """Checks every field before any compute; raises ConfigError naming the field."""
  checks.choice(config, "program", ("serve_sim",))
  shape = model_shape(config)
  schema.validate(SimConfig, config, "sim")
  schema.validate(SyntheticConfig, config, "synthetic")
  path = checks.string(config, "sim.trace", allow_empty=True)
  if path == "sessions":
    _sessions_config(config)
  elif path and not os.path.isfile(traces.resolve(path)):
    checks.fail(
      "sim.trace",
      path,
      "must be an existing Mooncake JSONL file, a bundled trace "
      f"({', '.join(sorted(traces.BUNDLED))}), 'sessions' or '' (synthetic)",
    )
  page_size = config.sim.page_size
  _hardware(config)
  block = config.sim.prefill_block
  if block > config.sim.max_num_batched_tokens:
    checks.fail(
      "sim.prefill_block",
      block,
      f"must be at most sim.max_num_batched_tokens = {config.sim.max_num_batched_tokens} "
      "(a block is one step's chunk, never split)",
    )
  for budget, share, fmt in itertools.product(
    budgets(config), share_kv_values(config), kv_formats(config)
  ):
    layout = KVLayout(share, fmt, page_size=page_size)
    try:
      page_bytes = page_size * shape.kv_bytes_per_token(layout)
    except ValueError as e:  # A per-token entry (e.g. MLA's latent) off the format's block.
      checks.fail("sim.kv_format", fmt, str(e).rstrip("."))
    if not page_bytes:
      checks.fail(
        "model.core_mixers",
        shape.core_mixers,
        "must give some layer a per-token cache for the simulator to page (a model of KDA "
        "layers only keeps a per-sequence state)",
      )
    slots = config.sim.max_num_seqs * shape.kv_bytes_per_sequence(layout)
    if budget is not None and budget < slots + page_bytes:
      held = f" after {config.sim.max_num_seqs} KDA state slots of {slots:.0f} bytes" * bool(slots)
      checks.fail(
        "sim.kv_budget_bytes",
        budget,
        f"must hold at least one page ({page_bytes:.0f} bytes for share_kv={share}, {fmt}){held}",
      )


def load_requests(config: Any) -> list[traces.Request]:
  """The configured trace, or a generated one (synthetic or sessions), with the time scale
  applied."""
  scale = config.sim.time_scale
  if config.sim.trace == "sessions":
    requests = sessions.generate(_sessions_config(config))
  elif config.sim.trace:
    return traces.load_mooncake(
      config.sim.trace,
      time_scale=scale,
      max_requests=config.sim.max_requests,
      block_size=config.sim.trace_block_size,
    )
  else:
    requests = traces.synthetic(_synthetic_spec(config))
  if config.sim.max_requests:
    requests = requests[: config.sim.max_requests]
  return [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in requests]


def simulate_one(
  requests: list[traces.Request],
  shape: shape_lib.ModelShape,
  hw: hardware.Hardware,
  *,
  budget: float | None,
  layout: KVLayout,
  config: scheduler_lib.SchedulerConfig,
  weight_format: str = "bf16",
  check_invariants: bool = False,
  label: str = "",
) -> dict[str, Any]:
  """Replays the requests under one KV budget and layout; returns the run's metrics. Under
  sharing, a config with a prefill block schedules blocks as the engine does (shared_blocks).
  A model with KDA layers is served as the engine serves it: max_num_seqs state slots come out
  of the budget first, each running request holds one, and prefix caching is off."""
  slot_bytes = shape.kv_bytes_per_sequence(layout)
  config = dataclasses.replace(
    config,
    shared_blocks=layout.share_kv and config.prefill_block is not None,
    state_slots=bool(slot_bytes),
    prefix_caching=config.prefix_caching and not slot_bytes,
  )
  page_bytes = config.page_size * shape.kv_bytes_per_token(layout)
  slots = config.max_num_seqs * slot_bytes
  num_pages = None if budget is None else max(int((budget - slots) // page_bytes), 0)
  pool = pages_lib.PagePool(num_pages, debug=check_invariants)
  executor = engine_cost.executor_for(shape, hw, config, layout, weight_format=weight_format)
  sched = scheduler_lib.Scheduler(config, pool, executor, check_invariants=check_invariants)
  bar = Progress(len(requests), label)
  start = time.monotonic()
  replay.replay(requests, sched, on_progress=bar.update)
  bar.close()
  wall = time.monotonic() - start
  if pool.num_in_use:
    raise RuntimeError(f"{pool.num_in_use} pages still held after the replay (a leak).")
  return {
    "share_kv": layout.share_kv,
    "kv_format": layout.format,
    "kv_budget_bytes": budget,
    "num_pages": num_pages,
    "page_size": config.page_size,
    "kv_bytes_per_token": shape.kv_bytes_per_token(layout),
    "kv_state_bytes_per_sequence": slot_bytes,
    "prefix_caching": config.prefix_caching,
    **metrics.summarize(sched, page_bytes),
    "ideal_lru_hit_rate": traces.ideal_hit_rate(
      requests, None if num_pages is None else num_pages * config.page_size
    ),
    "sim_wall_s": wall,
  }


def run(config: Any, workdir: str) -> dict[str, Any]:
  validate(config)
  shape = model_shape(config)
  hw = _hardware(config)
  sched_config = scheduler_lib.SchedulerConfig(
    page_size=config.sim.page_size,
    max_num_batched_tokens=config.sim.max_num_batched_tokens,
    max_num_seqs=config.sim.max_num_seqs,
    max_model_len=config.model.max_seq_len,
    prefill_block=config.sim.prefill_block or None,
  )
  requests = load_requests(config)
  logging.info(
    "serve_sim: %d requests over %.0f s, %s, model %.0fM params, %d layer executions/token.",
    len(requests),
    requests[-1].arrival_s,
    hw.name,
    shape.num_params / 1e6,
    shape.layer_executions,
  )
  sweep = list(itertools.product(budgets(config), share_kv_values(config), kv_formats(config)))
  runs = []
  for i, (budget, share, fmt) in enumerate(sweep):
    label = f"[{i + 1}/{len(sweep)}] {report.variant_name(share, fmt)} {report.gb(budget)}"
    runs.append(
      simulate_one(
        requests,
        shape,
        hw,
        budget=budget,
        layout=KVLayout(share, fmt, page_size=config.sim.page_size),
        config=sched_config,
        weight_format=config.sim.weight_format,
        check_invariants=config.sim.check_invariants,
        label=label,
      )
    )
  results = {
    "runs": runs,
    "improvements": report.improvements(runs),
    "paper": report.PAPER,
    "model": {**dataclasses.asdict(shape), "num_params": shape.num_params},
    "hardware": dataclasses.asdict(hw),
    "scheduler": dataclasses.asdict(sched_config),
    "trace": {
      "path": config.sim.trace or "synthetic",
      "num_requests": len(requests),
      "time_scale": config.sim.time_scale,
      "duration_s": requests[-1].arrival_s - requests[0].arrival_s,
      "offered_requests_per_s": len(requests) / max(requests[-1].arrival_s, 1e-9),
      "mean_prompt_tokens": sum(r.prompt_len for r in requests) / len(requests),
      "mean_output_tokens": sum(r.output_len for r in requests) / len(requests),
    },
  }
  out_dir = os.path.join(workdir, "sim")
  os.makedirs(out_dir, exist_ok=True)
  if config.sim.trace in ("", "sessions"):  # The generated trace, as replayed.
    traces.write_mooncake(requests, os.path.join(out_dir, "trace.jsonl"))
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  table = report.markdown(results)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(table)
  print(table)
  report.plot(runs, out_dir)
  logging.info("serve_sim: wrote %s", out_dir)
  return results
