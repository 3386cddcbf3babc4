"""`train.dry_run`: per-device memory of a training run on a mesh that need not exist.

The train state is built abstractly (jax.eval_shape of the trainer's own init: no array is
allocated), placed by the same logical-axis rules as a real run on a jax.sharding.AbstractMesh
of `mesh.dry_run_devices` devices, and each leaf's bytes on one device come from its shard
shape. Rows:

- params, optimizer state (AdamW's two moments and step count), gradients (one params-shaped
  tree, sharded like the params): exact, from the partition specs;
- activations: an estimate, the residuals autodiff saves for the backward pass of one
  microbatch of this device's rows (the stage-1 loss traced abstractly under the model's remat
  policy; arguments such as params and tokens left out), before XLA fuses or frees any of them.
  Tensor parallelism is not credited (every device is charged its rows' full residuals), nor
  are the backward's own temporaries. BeNice! post-training holds one more params copy (the
  frozen teacher) and the residuals of two passes.

It also gives the model FLOPs of one optimizer step (looped.model.flops: forward and backward of
every recurrence over data.batch_size x data.seq_len tokens), what MFU divides by a step's time;
None for a model that module does not count.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from looped import config_checks as cc
from looped import model as model_lib
from looped import sharding
from looped.model import flops
from looped.model.looped_lm import LoopedLM
from looped.train import objectives, optim
from looped.train.state import boxed_init_fn


def device_count(config) -> int:
  """The devices the dry run lays its mesh over."""
  return config.mesh.dry_run_devices or jax.device_count()


def validate(config) -> None:
  """What the dry run reads of config.data (no corpus or tokenizer is opened)."""
  max_seq_len = config.model.max_seq_len
  seq_len = cc.integer(config, "data.seq_len", min_value=1)
  if seq_len > max_seq_len:
    cc.fail("data.seq_len", seq_len, f"must be <= config.model.max_seq_len = {max_seq_len}")
  cc.integer(config, "data.batch_size", min_value=1)


def _bytes_per_device(abstract_tree, shardings) -> int:
  total = 0
  for leaf, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings), strict=True):
    total += math.prod(s.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
  return total


def _activation_bytes(config, model: LoopedLM, abstract_params, rows: int) -> int | None:
  """Bytes of the residuals the backward of `rows` rows keeps (module docstring); None where
  this JAX does not expose them."""
  try:
    from jax._src.ad_checkpoint import saved_residuals  # The list print_saved_residuals prints.
  except ImportError:
    return None
  objective = objectives.vocab_chunked(
    objectives.language_modeling(model, config.depth), config.train.loss_vocab_chunk
  )
  tokens = jax.ShapeDtypeStruct((rows, config.data.seq_len), jnp.int32)
  batch = {"inputs": tokens, "targets": tokens}
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  loss = lambda params, batch, key: objective.loss_fn(params, None, batch, key, None)[0]
  residuals = saved_residuals(loss, abstract_params, batch, key)
  return sum(
    math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
    for aval, source in residuals
    if not source.startswith(("from the argument", "from a literal"))
  )


def step_flops(config, model: LoopedLM) -> float | None:
  """Model FLOPs of one optimizer step at full depth (module docstring), or None."""
  try:
    per_token = flops.train_flops_per_token(model.cfg, config.data.seq_len)
  except ValueError:
    return None
  return per_token * config.data.batch_size * config.data.seq_len


def memory(config) -> dict:
  """Per-device bytes of params, optimizer state, gradients and activations (estimated) of
  config's training run on its mesh over device_count(config) devices; nothing allocated."""
  devices = device_count(config)
  sizes = sharding.mesh_shape(config.mesh, devices)
  mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in sharding.AXES), sharding.AXES)
  rules = sharding.rules(config, mesh)
  model = LoopedLM(model_lib.from_config(config.model))
  optimizer = optim.make_optimizer(config.train)
  # The abstract mesh in context: the model's sharding constraints trace against it.
  with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(boxed_init_fn(config, model, optimizer))
    state_shardings = sharding.shardings(abstract, mesh, rules)
    boxed = lambda x: isinstance(x, nn.Partitioned)  # A leaf with its logical axis names.
    unboxed = jax.tree.map(lambda x: x.value if boxed(x) else x, abstract, is_leaf=boxed)
    params = _bytes_per_device(unboxed.params, state_shardings.params)
    opt_state = _bytes_per_device(unboxed.opt_state, state_shardings.opt_state)
    batch_shards = sizes["data"] * sizes["fsdp"]
    rows = config.data.batch_size // (batch_shards * config.train.grad_accum_steps)
    activations = _activation_bytes(config, model, unboxed.params, rows)
  out = {
    "devices": devices,
    "mesh": sizes,
    "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(unboxed.params)),
    "rows_per_device": rows,
    "batch_size": config.data.batch_size,
    "params_bytes": params,
    "opt_state_bytes": opt_state,
    "grads_bytes": params,
    "activation_bytes": activations,
    "step_flops": step_flops(config, model),
  }
  out["total_bytes"] = params * 2 + opt_state + (activations or 0)
  return out


def format_table(m: dict, seq_len: int) -> str:
  """The printed table (docs/scaling.md shows one)."""
  gib = lambda b: "n/a" if b is None else f"{b / 2**30:.3f}"
  mesh = " x ".join(f"{a}={s}" for a, s in m["mesh"].items())
  rows = m["rows_per_device"]
  rows = [
    ("params", m["params_bytes"]),
    ("optimizer state (AdamW moments + count)", m["opt_state_bytes"]),
    ("gradients", m["grads_bytes"]),
    (f"activations, estimated ({rows} rows x {seq_len} tokens)", m["activation_bytes"]),
    ("total", m["total_bytes"]),
  ]
  lines = [
    f"Dry run: {m['num_params']:,} params on {m['devices']} devices ({mesh}); per device:",
    "| per device | bytes | GiB |",
    "|---|---:|---:|",
  ]
  lines += [f"| {name} | {'n/a' if b is None else f'{b:,}'} | {gib(b)} |" for name, b in rows]
  flop = m.get("step_flops")
  tokens = f"{m['batch_size']} x {seq_len} tokens" if "batch_size" in m else "one step"
  lines.append(
    f"Model FLOPs per optimizer step ({tokens}, all devices): "
    + ("n/a (not counted for this model)" if flop is None else f"{flop:.4g}")
  )
  return "\n".join(lines)


def run(config) -> dict:
  """Prints the table and returns its figures; no step runs."""
  m = memory(config)
  print(format_table(m, config.data.seq_len), flush=True)
  return m
