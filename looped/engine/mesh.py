"""The engine on a device mesh: where params, the page pool and a step's inputs live.

The engine reuses training's mesh ('data', 'fsdp', 'tensor') and its logical-axis rules
(looped.sharding, config.mesh_rules): params are placed by the rules the model names its
weights with ('heads', 'kv_heads', 'mlp', 'vocab' over tensor; 'embed' over fsdp), every page
array of the pool is split over its KV-head dimension by the 'kv_heads' rule where the heads
divide (replicated otherwise: MLA's single latent head, GQA with fewer KV heads than shards,
packed scales of one value per token), and a step's inputs (tokens, page tables, sampling
settings) are replicated. A 1 x 1 x 1 mesh is the single-device engine: one code path.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from looped import config_checks as cc
from looped import schema, sharding
from looped.model import cache_layout
from looped.model.cache_layout import STAGES
from looped.model.config import ModelConfig
from looped.model.kda import KDAState
from looped.model.looped_lm import LoopedLM, init_params

# Logical axis -> the ModelConfig field sizing it (the model's dimensions a rule may split).
_FIELDS = sharding.MODEL_AXIS_FIELDS
# Split only where they divide, replicated otherwise (as looped.sharding.rules does).
_OPTIONAL = ("kv_heads", "vocab")


def mesh_axes(rule_table, logical: str) -> tuple[str, ...]:
  """The mesh axes `rule_table` gives a logical axis (() : replicated)."""
  for name, axes in rule_table:
    if name == logical:
      return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  return ()


def resolve_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
  """{axis: size} of a mesh section ({data, fsdp, tensor}) on `num_devices` devices: a -1 takes
  the devices the fixed axes leave; without one the mesh uses its first data x fsdp x tensor
  devices (the engine need not take every device of the host)."""
  sizes = {a: mesh_cfg[a] for a in sharding.AXES}
  if -1 not in sizes.values():
    num_devices = math.prod(sizes.values())
  return sharding.mesh_shape(mesh_cfg, num_devices)


def check(cfg: ModelConfig, sizes: dict[str, int], rule_table, prefix: str = "config.mesh"):
  """Raises ConfigError (a ValueError) naming the mesh field whose shards do not divide a model
  dimension that must split evenly (query heads, MLP width, model width); `prefix` names the
  mesh fields."""
  for logical, field in _FIELDS.items():
    axes = mesh_axes(rule_table, logical)
    shards = math.prod(sizes[a] for a in axes)
    size = getattr(cfg, field)
    if logical in _OPTIONAL or size % shards == 0:
      continue
    name = f"{prefix}.{' x '.join(axes)}"
    raise cc.ConfigError(
      f"{name} = {shards} does not divide the model's {field} = {size} (mesh_rules split the "
      f"logical axis {logical!r} over {axes}).",
      field=name,
      value=shards,
    )


def from_config(config, cfg: ModelConfig) -> tuple[tuple[int, int, int], tuple]:
  """(mesh_shape, mesh_rules) for EngineConfig from config.mesh and config.mesh_rules, checked
  against the devices and the model before anything is built; ConfigError naming the field."""
  schema.validate(sharding.MeshConfig, config, "mesh")
  rule_table = config.mesh_rules
  sharding.check_rules(rule_table)
  rule_table = tuple((name, tuple(a) if isinstance(a, list) else a) for name, a in rule_table)
  sizes = resolve_shape(config.mesh, jax.device_count())
  check(cfg, sizes, rule_table)  # The model first: it fails on every host alike.
  n = math.prod(sizes.values())
  if n > jax.device_count():
    raise cc.ConfigError(
      f"config.mesh = {sizes} needs {n} devices; there are {jax.device_count()} "
      "(on a CPU host: mesh.cpu_devices).",
      field="config.mesh",
    )
  return tuple(sizes[a] for a in sharding.AXES), rule_table


def rules(cfg: ModelConfig, mesh: Mesh, rule_table) -> tuple:
  """The rule table for this model on `mesh`, optional axes that do not divide replicated."""
  out = []
  for logical, axes in rule_table:
    if logical in _OPTIONAL and logical in _FIELDS:
      shards = math.prod(mesh.shape[a] for a in mesh_axes(rule_table, logical))
      if getattr(cfg, _FIELDS[logical]) % shards:
        axes = None
    out.append((logical, tuple(axes) if isinstance(axes, list) else axes))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class EngineMesh:
  """A mesh and the logical rules resolved for one model on it (hashable: a jit cache key)."""

  mesh: Mesh
  rules: tuple

  @classmethod
  def create(cls, cfg: ModelConfig, shape=(1, 1, 1), rule_table=(), devices=None) -> EngineMesh:
    """The mesh of `shape` (data, fsdp, tensor) over the first devices of `devices` (default:
    jax.devices()); ValueError if the shards do not divide the model or the devices are too few."""
    sizes = dict(zip(sharding.AXES, shape, strict=True))
    if any(not isinstance(s, int) or s < 1 for s in shape):
      raise ValueError(f"mesh_shape = {shape}: each of (data, fsdp, tensor) must be >= 1.")
    check(cfg, sizes, rule_table, prefix="mesh_shape")
    devices = jax.devices() if devices is None else list(devices)
    n = math.prod(shape)
    if n > len(devices):
      raise ValueError(f"mesh_shape = {shape} needs {n} devices; there are {len(devices)}.")
    auto = (jax.sharding.AxisType.Auto,) * len(shape)
    mesh = jax.make_mesh(tuple(shape), sharding.AXES, axis_types=auto, devices=devices[:n])
    return cls(mesh, rules(cfg, mesh, rule_table))

  def context(self):
    """Where the engine's calls trace: the model's logical constraints resolve on the mesh."""
    return sharding.context(self.mesh, self.rules)

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def param_shardings(self, model: LoopedLM):
    """NamedShardings of {'params': ...} as init_params returns it, from the weights' names."""
    boxed = jax.eval_shape(
      lambda: {"params": model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]}
    )
    return sharding.shardings(boxed, self.mesh, self.rules)

  def place_params(self, model: LoopedLM, params):
    """params (host or any device) on the mesh by the rules; None (an engine built only to be
    inspected, never run) stays None."""
    if params is None:
      return None
    abstract = jax.eval_shape(
      lambda: init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))
    )
    if jax.tree.structure(abstract) != jax.tree.structure(params):
      raise ValueError("params do not have the model's structure ({'params': ...}).")
    return jax.device_put(params, self.param_shardings(model))

  def pool_shardings(self, pages: dict, layout, slotted: bool = False):
    """NamedShardings of paged_cache's pages: each leaf split on its KV-head dimension (the one
    after [.., pages, page_size]) by the 'kv_heads' rule where that dimension divides evenly
    and is more than one head; replicated otherwise, and KDA state slots (per-sequence, not per
    token) are replicated. layout: the pages' KVLayout; slotted: the shared core's pages lead
    with a KV policy's copies (KVLayout.slotted_core)."""
    axes = mesh_axes(self.rules, "kv_heads")
    shards = math.prod(self.mesh.shape[a] for a in axes)

    def one(stage, leaf):
      lead = cache_layout.per_recurrence(stage, layout.share_kv) or (stage == "core" and slotted)
      dim = (1 if lead else 0) + 2
      # A per-token scalar (nvfp4's tensor scale) has no such dimension; one head stays whole.
      if not axes or leaf.ndim <= dim or leaf.shape[dim] <= 1 or leaf.shape[dim] % shards:
        return self.replicated()
      spec = [None] * leaf.ndim
      spec[dim] = axes if len(axes) > 1 else axes[0]
      return NamedSharding(self.mesh, P(*spec))

    def entry_shardings(stage, entry):
      if isinstance(entry, KDAState):
        return jax.tree.map(lambda _: self.replicated(), entry)
      return jax.tree.map(lambda x: one(stage, x), entry)

    return {stage: [entry_shardings(stage, e) for e in pages[stage]] for stage in STAGES}
