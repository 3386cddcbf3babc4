r"""Training-step speed: the scanned looped model (the default, all R recurrences unrolled inside
one scan iteration, and one recurrence per iteration) vs the Python-unrolled one, same math,
timed in interleaved rounds;
or the trainer's own step on several device meshes (--mesh, docs/scaling.md).

  python benchmarks/train_step.py                       # default pretrain model, CPU
  python benchmarks/train_step.py --config_arg=smoke --steps=20
  python benchmarks/train_step.py --preset=350m --dtype=bfloat16   # on a GPU
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/train_step.py \
      --mesh=data=8 --mesh=fsdp=8 --mesh=fsdp=4,tensor=2 --mesh=data=2,fsdp=2,tensor=2

Reports compile time, median step time, tokens/s, executed matmul FLOP/s (looped.model.flops) as
a fraction of this machine's float32 matmul throughput measured in the same run, utilisation
against --peak_tflops (when given) and XLA's compiled memory estimate (arguments +
temporaries), for each variant; with --mesh also the bytes of params + optimizer state each
device holds (the largest over the devices, from the arrays' addressable shards) and that as a
fraction of the whole state.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import matmul_limit
import numpy as np
from absl import app, flags

from configs import pretrain
from looped import sharding
from looped.model import LoopedLM, flops, from_config, init_params
from looped.train import objectives, optim, trainer

_CONFIG_ARG = flags.DEFINE_string("config_arg", "", "Arg for configs/pretrain.py get_config.")
_PRESET = flags.DEFINE_enum("preset", None, ["350m"], "Model preset overriding the config.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype override.")
_BATCH = flags.DEFINE_integer("batch", None, "Global batch override.")
_SEQ = flags.DEFINE_integer("seq_len", None, "Sequence length override.")
_RECURRENCES = flags.DEFINE_integer("num_recurrences", None, "R override (compile-time scaling).")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per variant (after one warmup step).")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "Accelerator peak TFLOP/s for MFU (0: skip).")
_OUT = flags.DEFINE_string("out", "benchmarks/results/train_step.json", "JSON output path.")
_MESH = flags.DEFINE_multi_string(
  "mesh", [], "Mesh variants, e.g. 'fsdp=8' or 'data=2,fsdp=2,tensor=2' (axes not named: 1)."
)
_REMAT = flags.DEFINE_string("remat", None, "model.remat override ('full', 'dots_saveable', ...).")
_ACCUM = flags.DEFINE_integer("grad_accum_steps", None, "train.grad_accum_steps override.")


def _config():
  config = pretrain.get_config(_CONFIG_ARG.value)
  config.depth.sampler = "fixed"  # Same FLOPs every step, for a fair comparison.
  if _PRESET.value == "350m":
    m = config.model
    m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 1024, 16, 4, 64, 4096
    m.num_prelude_layers, m.num_core_layers, m.num_coda_layers = 4, 10, 4
    m.num_recurrences, m.vocab_size, m.max_seq_len = 4, 32768, 2048
    m.tie_embeddings = False
    config.data.seq_len, config.data.batch_size = 2048, 16
  if _DTYPE.value:
    config.model.dtype = _DTYPE.value
  if _BATCH.value:
    config.data.batch_size = _BATCH.value
  if _RECURRENCES.value:
    config.model.num_recurrences = _RECURRENCES.value
  if _SEQ.value:
    config.data.seq_len = _SEQ.value
    config.model.max_seq_len = max(config.model.max_seq_len, _SEQ.value)
  if _REMAT.value:
    config.model.remat = _REMAT.value
  if _ACCUM.value:
    config.train.grad_accum_steps = _ACCUM.value
  return config


def _parse_mesh(spec: str) -> dict[str, int]:
  sizes = {axis: 1 for axis in sharding.AXES}
  for part in spec.split(","):
    axis, _, size = part.partition("=")
    if axis not in sizes or not size.isdigit():
      raise app.UsageError(f"--mesh={spec!r}: expected axis=size pairs over {sharding.AXES}")
    sizes[axis] = int(size)
  return sizes


def _timed(fn, *args):
  """(median, min) seconds of _STEPS calls after one warmup; fn returns (state, loss)."""
  state, loss = fn(*args)
  jax.block_until_ready(loss)
  times = []
  for _ in range(_STEPS.value):
    t0 = time.perf_counter()
    state, loss = fn(state, *args[1:])
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t0)
  return statistics.median(times), min(times), float(loss)


def _bench_mesh(config, spec: str) -> dict:
  """The trainer's own step (init_state, make_train_step) on the mesh `spec`."""
  config = config.copy_and_resolve_references()
  for axis, size in _parse_mesh(spec).items():
    config.mesh[axis] = size
  sharding.validate(config)
  cfg = from_config(config.model)
  model = LoopedLM(cfg)
  mesh = sharding.make_mesh(config)
  rules = sharding.rules(config, mesh)
  optimizer = optim.make_optimizer(config.train)
  objective = objectives.language_modeling(model, config.depth)
  b, t = config.data.batch_size, config.data.seq_len
  tokens = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, cfg.vocab_size))
  with sharding.context(mesh, rules):
    state = trainer.init_state(config, model, optimizer, mesh, rules)
    batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    step = trainer.make_train_step(
      objective, optimizer, optim.learning_rate_schedule(config.train), config.train
    )
    t0 = time.perf_counter()
    compiled = trainer.jit_train_step(step, state).lower(state, None, batch).compile()
    compile_s = time.perf_counter() - t0
    held = sharding.bytes_per_device((state.params, state.opt_state))
    total = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
    run = lambda state, batch: (lambda out: (out[0], out[1]["loss"]))(compiled(state, None, batch))
    step_s, step_min, loss = _timed(run, state, batch)
  mem = compiled.memory_analysis()
  step_flops = flops.train_flops_per_token(cfg, t) * b * t
  row = {
    "variant": spec,
    "devices": mesh.size,
    "compile_s": compile_s,
    "step_s_median": step_s,
    "step_s_min": step_min,
    "tokens_per_s": b * t / step_s,
    "model_tflops_per_s": step_flops / step_s / 1e12,
    "state_bytes_per_device": max(held.values()),
    "state_fraction_per_device": max(held.values()) / total,
    "xla_memory_bytes": None
    if mem is None
    else int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes),
    "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
    "final_loss": loss,
  }
  if _PEAK.value:
    row["mfu"] = step_flops / step_s / (_PEAK.value * 1e12 * mesh.size)
  return row


VARIANTS = {  # name -> model overrides; every variant computes the same math.
  "scan": {"scan_recurrences": True, "scan_unroll": 0},  # The default: all R in one iteration.
  "scan_unroll_1": {"scan_recurrences": True, "scan_unroll": 1},  # One recurrence an iteration.
  "unrolled": {"scan_recurrences": False},  # A Python loop over the recurrences.
}


def _build_variant(config, overrides: dict):
  """(compiled step, params, opt_state, batch, compile s, XLA memory bytes, cfg) of a variant."""
  config = config.copy_and_resolve_references()
  config.model.update(overrides)
  cfg = from_config(config.model)
  model = LoopedLM(cfg)
  objective = objectives.language_modeling(model, config.depth)
  optimizer = optim.make_optimizer(config.train)
  b, t = config.data.batch_size, config.data.seq_len
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, cfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = init_params(model, jax.random.PRNGKey(1), batch["inputs"][:1])
  opt_state = optimizer.init(params)

  def step(params, opt_state, batch, key):
    (loss, _), grads = jax.value_and_grad(objective.loss_fn, has_aux=True)(params, None, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss

  key = jax.random.PRNGKey(2)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch, key).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak_bytes = None
  if mem is not None:
    peak_bytes = int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes)
  return [compiled, params, opt_state, batch, compile_s, peak_bytes, cfg]


def _bench_variants(config) -> list[dict]:
  """Every variant's step, timed in interleaved rounds (one step of each per round), so load
  that changes during the run hits every variant alike; medians."""
  built = {name: _build_variant(config, o) for name, o in VARIANTS.items()}
  key = jax.random.PRNGKey(2)
  for b in built.values():  # Warmup.
    b[1], b[2], loss = b[0](b[1], b[2], b[3], key)
    jax.block_until_ready(loss)
  times = {name: [] for name in built}
  losses = {}
  for i in range(_STEPS.value):
    for name, b in built.items():
      t0 = time.perf_counter()
      b[1], b[2], loss = b[0](b[1], b[2], b[3], jax.random.fold_in(key, i))
      jax.block_until_ready(loss)
      times[name].append(time.perf_counter() - t0)
      losses[name] = float(loss)
  matmul = matmul_limit.MatmulLimit()
  matmul.measure(repeats=10)
  limit = matmul.flops_per_s()
  rows = []
  for name, (_, params, _, batch, compile_s, peak_bytes, cfg) in built.items():
    b, t = batch["inputs"].shape
    step_s = statistics.median(times[name])
    step_flops = flops.train_flops_per_token(cfg, t) * b * t
    row = {
      "variant": name,
      "compile_s": compile_s,
      "step_s_median": step_s,
      "step_s_min": min(times[name]),
      "tokens_per_s": b * t / step_s,
      "model_tflops_per_s": step_flops / step_s / 1e12,
      "of_matmul_limit": step_flops / step_s / limit,
      "xla_memory_bytes": peak_bytes,
      "params": int(sum(x.size for x in jax.tree.leaves(params))),
      "final_loss": losses[name],
    }
    if _PEAK.value:
      row["mfu"] = step_flops / step_s / (_PEAK.value * 1e12)
    rows.append(row)
  return rows, limit


def main(argv):
  del argv
  config = _config()
  if _MESH.value:
    rows = [_bench_mesh(config, spec) for spec in _MESH.value]
  else:
    rows, limit = _bench_variants(config)
  header = {
    "device": str(jax.devices()[0].device_kind),
    "device_count": jax.device_count(),
    "backend": jax.default_backend(),
    "batch": config.data.batch_size,
    "seq_len": config.data.seq_len,
    "dtype": config.model.dtype,
    "model": config.model.to_dict(),
  }
  cols = ["variant", "compile_s", "step_s_median", "tokens_per_s", "model_tflops_per_s"]
  if _MESH.value:
    cols += ["state_bytes_per_device", "state_fraction_per_device"]
  else:
    cols += ["of_matmul_limit"]
  cols += ["xla_memory_bytes"] + (["mfu"] if _PEAK.value else [])
  print(
    f"\ndevice={header['device']} batch={header['batch']} seq_len={header['seq_len']} "
    f"R={config.model.num_recurrences} dtype={config.model.dtype}"
  )
  print(f"params={rows[0]['params']:,}")
  print("| " + " | ".join(cols) + " |")
  print("|" + "---|" * len(cols))
  for row in rows:
    cells = []
    for c in cols:
      v = row[c]
      cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
    print("| " + " | ".join(cells) + " |")
  summary = {"setup": header, "rows": rows}
  if not _MESH.value:
    step = {row["variant"]: row["step_s_median"] for row in rows}
    summary["matmul_limit_gflops"] = limit / 1e9
    summary["scan_over_unrolled"] = step["scan"] / step["unrolled"]
    summary["scan_unroll_1_over_unrolled"] = step["scan_unroll_1"] / step["unrolled"]
    print(
      f"scan / unrolled step time: {summary['scan_over_unrolled']:.3f}; scan_unroll_1 / unrolled:"
      f" {summary['scan_unroll_1_over_unrolled']:.3f}; matmul limit {limit / 1e9:.1f} GFLOP/s"
    )
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {_OUT.value}")
  losses = [row["final_loss"] for row in rows]  # Same math in every variant.
  np.testing.assert_allclose(losses, losses[0], rtol=1e-3)


if __name__ == "__main__":
  app.run(main)
