"""Device meshes and logical-axis sharding (docs/design.md §7).

The model names every parameter dimension and a few activations with logical axes ('embed',
'heads', 'mlp', 'vocab', 'batch', ...; nn.with_logical_partitioning / with_logical_constraint).
One rule table (`config.mesh_rules`) maps logical axes to the mesh axes of `config.mesh`
('data', 'fsdp', 'tensor'), so the same model code runs on one CPU and on a pod:

- data: the batch is split, params and optimizer state are replicated;
- fsdp: the batch is split and params + Adam moments are sharded (their 'embed' dimension), so
  each device holds 1/fsdp of them; XLA gathers a layer's weights where they are used;
- tensor: attention heads, KV heads, the MLP hidden width and the vocabulary are split.

Rules are taken in order and a mesh axis is used at most once per array (Flax's semantics), so
an activation [batch, length, embed] puts 'fsdp' on its batch and leaves embed whole, while a
weight [embed, mlp] puts it on embed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from looped import config_checks as cc
from looped import schema
from looped.schema import field as schema_field

AXES = ("data", "fsdp", "tensor")  # Mesh axes, outermost first (data crosses hosts/slices).
BATCH_AXES = ("data", "fsdp")  # The mesh axes the batch is split over.


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """`config.mesh` (docs/scaling.md): sizes multiply to the device count; looped.schema derives
  the config files' ConfigDict, the range checks and help, `mesh_shape` the rest."""

  data: int = schema_field(
    -1, "Data parallel: batch split, params replicated (-1: the devices left over).", min=-1
  )
  fsdp: int = schema_field(
    1, "Fully sharded data parallel: batch split, params and Adam moments sharded.", min=-1
  )
  tensor: int = schema_field(
    1, "Tensor parallel: heads, KV heads, MLP width and vocabulary split.", min=-1
  )
  cpu_devices: int = schema_field(
    0,
    "CPU backend of `python -m looped.main`: devices the host is split into (0: one per core, "
    "as many as mesh and batch divide; 1: one multi-threaded device).",
    min=0,
  )
  dry_run_devices: int = schema_field(
    0,
    "train.dry_run: devices the mesh is laid over (0: jax.device_count()); they need not exist.",
    min=0,
  )


# Logical axes whose sharding is optional: with fewer KV heads (GQA) or a vocabulary not
# divisible by the tensor axis they are replicated instead (what MaxText does for KV heads).
_REPLICATE_IF_UNEVEN = ("kv_heads", "vocab")


def mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{axis: size} of config.mesh with its one -1 resolved; ConfigError if it does not fit."""
  sizes = {}
  for axis in AXES:
    size = cc.integer({"mesh": mesh_cfg}, f"mesh.{axis}", min_value=-1)
    if size == 0:
      cc.fail(f"mesh.{axis}", size, "must be >= 1, or -1 for the rest of the devices")
    sizes[axis] = size
  free = [a for a in AXES if sizes[a] == -1]
  if len(free) > 1:
    raise cc.ConfigError(f"config.mesh: at most one axis may be -1, got {free} ({sizes}).")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise cc.ConfigError(
        f"config.mesh = {sizes}: the fixed axes multiply to {fixed}, which does not divide the "
        f"{num_devices} devices, so mesh.{free[0]} = -1 cannot take the rest."
      )
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise cc.ConfigError(
      f"config.mesh = {sizes} multiplies to {fixed} devices, but there are {num_devices} "
      "(jax.device_count()); set one axis to -1 to take the rest."
    )
  return sizes


def validate(config, num_devices: int | None = None) -> dict[str, int]:
  """Checks config.mesh / mesh_rules against the devices, batch and model shape (no compute)."""
  num_devices = jax.device_count() if num_devices is None else num_devices
  schema.validate(MeshConfig, config, "mesh")
  sizes = mesh_shape(config.mesh, num_devices)
  check_rules(config.mesh_rules)
  batch_shards = sizes["data"] * sizes["fsdp"]
  for field in ("batch_size", "eval_batch_size"):
    cc.divides(config, f"data.{field}", batch_shards, "mesh.data x mesh.fsdp")
  accum = config.train.get("grad_accum_steps", 1)
  batch_size = config.data.batch_size
  if accum > 1 and batch_size % (batch_shards * accum):
    cc.fail(
      "data.batch_size",
      batch_size,
      f"must be a multiple of mesh.data x mesh.fsdp x train.grad_accum_steps = "
      f"{batch_shards} x {accum} (every microbatch is split over the batch shards)",
    )
  for logical, size in _logical_sizes(config.model).items():
    if logical in _REPLICATE_IF_UNEVEN:
      continue
    shards = math.prod(sizes[a] for a in _mesh_axes(config.mesh_rules, logical))
    if size % shards:
      field = _FIELDS[logical]
      raise cc.ConfigError(
        f"config.model.{field} = {size} is not divisible by the {shards} shards that "
        f"config.mesh_rules give the logical axis {logical!r} on mesh {sizes}."
      )
  return sizes


def cpu_device_count(config, cores: int) -> int:
  """Devices to split a CPU host into: config.mesh.cpu_devices; for 0, a mesh without -1 has
  its own size, else the most, up to `cores`, that config.mesh, the batch sizes and the model
  divide evenly (validate)."""
  schema.validate(MeshConfig, config, "mesh")
  wanted = config.mesh.cpu_devices
  if wanted:
    return wanted
  sizes = [config.mesh[a] for a in AXES]
  if -1 not in sizes:  # A fixed mesh (the engine's) is that many devices.
    return math.prod(sizes)
  for n in range(max(cores, 1), 1, -1):
    try:
      validate(config, n)
    except cc.ConfigError:
      continue
    return n
  return 1


def make_mesh(config, devices: Sequence | None = None) -> Mesh:
  """The mesh of config.mesh over `devices` (default: all), axes in AXES order."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(config.mesh, len(devices))
  shape = tuple(sizes[a] for a in AXES)
  auto = (jax.sharding.AxisType.Auto,) * len(AXES)  # GSPMD propagation from the constraints.
  return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


def rules(config, mesh: Mesh) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """config.mesh_rules for this model on `mesh`: optional axes that do not divide evenly
  (_REPLICATE_IF_UNEVEN) replicated."""
  sizes = dict(mesh.shape)
  logical_sizes = _logical_sizes(config.model)
  out = []
  for logical, axes in config.mesh_rules:
    if logical in _REPLICATE_IF_UNEVEN and axes is not None:
      shards = math.prod(sizes[a] for a in _as_tuple(axes))
      if logical_sizes[logical] % shards:
        logging.info(
          "Logical axis %r (size %d) replicated: not divisible by its %d shards.",
          logical,
          logical_sizes[logical],
          shards,
        )
        axes = None
    out.append((logical, tuple(axes) if isinstance(axes, list) else axes))
  return tuple(out)


@contextlib.contextmanager
def context(mesh: Mesh, logical_rules):
  """Inside: jit traces with `mesh` as the ambient mesh and the model's logical constraints
  resolved by `logical_rules`."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(logical_rules):
    yield


def shardings(abstract_boxed, mesh: Mesh, logical_rules):
  """NamedShardings for a pytree whose leaves may be boxed with logical names (e.g. the
  jax.eval_shape of model.init or of an optimizer's init on boxed params); the result has the
  structure of the unboxed tree. Unnamed leaves are replicated."""
  specs = nn.get_partition_spec(abstract_boxed)
  return nn.logical_to_mesh_sharding(specs, mesh, logical_rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows of a batch split over data x fsdp (replicated over tensor)."""
  return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(batch: dict, mesh: Mesh) -> dict:
  """This process's rows of each array -> one global jax.Array split over the batch axes."""
  sharding = batch_sharding(mesh)
  return {
    k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()
  }


def bytes_per_device(tree) -> dict[int, int]:
  """{device id: bytes of `tree`'s shards on it}, from the arrays' addressable shards."""
  out: dict[int, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
  return out


# Logical axes of model dimensions, with the config.model field that sizes each.
MODEL_AXIS_FIELDS = _FIELDS = {
  "embed": "d_model",
  "heads": "num_heads",
  "kv_heads": "num_kv_heads",
  "mlp": "mlp_dim",
  "vocab": "vocab_size",
  "head_dim": "head_dim",
}


def _logical_sizes(model_cfg) -> dict[str, int]:
  return {logical: model_cfg[field] for logical, field in _FIELDS.items()}


def _as_tuple(axes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def _mesh_axes(rule_table, logical: str) -> tuple[str, ...]:
  for name, axes in rule_table:
    if name == logical:
      return _as_tuple(axes)
  return ()


def check_rules(rule_table) -> None:
  """ConfigError naming config.mesh_rules unless it is (logical axis, mesh axes) pairs."""
  if not isinstance(rule_table, (tuple, list)):
    cc.fail("mesh_rules", rule_table, "must be a tuple of (logical axis, mesh axes) pairs")
  for rule in rule_table:
    if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
      cc.fail("mesh_rules", rule, "each rule must be a (logical axis name, mesh axes) pair")
    bad = [a for a in _as_tuple(rule[1]) if a not in AXES]
    if bad:
      cc.fail("mesh_rules", rule, f"unknown mesh axes {bad}; the mesh has {AXES}")
