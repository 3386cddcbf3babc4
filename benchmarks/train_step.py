r"""Training-step speed: the scanned looped model vs the Python-unrolled one (same FLOPs), or
the trainer's own step on several device meshes (--mesh, docs/scaling.md).

  python benchmarks/train_step.py                       # default pretrain model, CPU
  python benchmarks/train_step.py --config_arg=smoke --steps=20
  python benchmarks/train_step.py --preset=350m --dtype=bfloat16   # on a GPU
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/train_step.py \
      --mesh=data=8 --mesh=fsdp=8 --mesh=fsdp=4,tensor=2 --mesh=data=2,fsdp=2,tensor=2

Reports compile time, median step time, tokens/s, model FLOPs utilisation against --peak_tflops
(when given) and XLA's compiled memory estimate (arguments + temporaries), for each variant;
with --mesh also the bytes of params + optimizer state each device holds (the largest over the
devices, from the arrays' addressable shards) and that as a fraction of the whole state.
Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import pretrain
from looped import sharding
from looped.model import LoopedLM, from_config, init_params
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
  flops = model_flops_per_token(cfg, t) * b * t
  row = {
    "variant": spec,
    "devices": mesh.size,
    "compile_s": compile_s,
    "step_s_median": step_s,
    "step_s_min": step_min,
    "tokens_per_s": b * t / step_s,
    "model_tflops_per_s": flops / step_s / 1e12,
    "state_bytes_per_device": max(held.values()),
    "state_fraction_per_device": max(held.values()) / total,
    "xla_memory_bytes": None
    if mem is None
    else int(mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes),
    "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
    "final_loss": loss,
  }
  if _PEAK.value:
    row["mfu"] = flops / step_s / (_PEAK.value * 1e12 * mesh.size)
  return row


def model_flops_per_token(cfg, seq_len: int) -> float:
  """Forward+backward FLOPs per token: 6 x matmul params applied + attention (PaLM-style)."""
  d, hd = cfg.d_model, cfg.head_dim
  attn = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
  mlp = d * cfg.mlp_dim * (3 if cfg.mlp_type == "swiglu" else 2)
  per_layer = attn + mlp
  applied_layers = cfg.num_prelude_layers + cfg.num_coda_layers
  applied_layers += cfg.num_core_layers * cfg.num_recurrences
  inject = {"diagonal": d * d, "linear": 2 * d * d, "additive": 0}[cfg.injection]
  matmul_params = applied_layers * per_layer + cfg.num_recurrences * inject + d * cfg.vocab_size
  attention = applied_layers * 2 * cfg.num_heads * hd * seq_len  # QK^T and PV, causal half x2
  return 6 * matmul_params + 6 * attention


def _bench_variant(config, scan: bool) -> dict:
  config = config.copy_and_resolve_references()
  config.model.scan_recurrences = scan
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
  params, opt_state, loss = compiled(params, opt_state, batch, key)
  jax.block_until_ready(loss)
  times = []
  for i in range(_STEPS.value):
    t0 = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, batch, jax.random.fold_in(key, i))
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens_per_s = b * t / step_s
  flops = model_flops_per_token(cfg, t) * b * t
  row = {
    "variant": "scan" if scan else "unrolled",
    "compile_s": compile_s,
    "step_s_median": step_s,
    "step_s_min": min(times),
    "tokens_per_s": tokens_per_s,
    "model_tflops_per_s": flops / step_s / 1e12,
    "xla_memory_bytes": peak_bytes,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "final_loss": float(loss),
  }
  if _PEAK.value:
    row["mfu"] = flops / step_s / (_PEAK.value * 1e12)
  return row


def main(argv):
  del argv
  config = _config()
  if _MESH.value:
    rows = [_bench_mesh(config, spec) for spec in _MESH.value]
  else:
    rows = [_bench_variant(config, scan) for scan in (True, False)]
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
    summary["unrolled_over_scan"] = rows[1]["step_s_median"] / rows[0]["step_s_median"]
    print(f"unrolled/scan step-time ratio: {summary['unrolled_over_scan']:.3f}")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value, "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {_OUT.value}")
  losses = [row["final_loss"] for row in rows]  # Same math in every variant.
  np.testing.assert_allclose(losses, losses[0], rtol=1e-3)


if __name__ == "__main__":
  app.run(main)
