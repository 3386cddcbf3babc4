"""AdamW with linear warmup and cosine decay, global-norm clipping, decay on matrices only.

Two memory levers (config.train): `opt_state_dtype` stores Adam's moments in bfloat16 (computed
in float32 each step, rounded when stored), and `master_weights` keeps a float32 copy of
bfloat16 params (model.param_dtype) in the optimizer state: updates accumulate in the copy and
the params are its rounding, so an update smaller than half a bfloat16 ulp of a weight is not
lost.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=train_cfg.learning_rate,
    warmup_steps=train_cfg.warmup_steps,
    decay_steps=max(train_cfg.num_steps, train_cfg.warmup_steps + 1),
    end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio,
  )


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  # Norm scales, injection decay rates and other vectors are not weight-decayed, nor a fixed
  # RoPE table (model.rope_table: it gets no gradient, so decay alone would move it).
  fixed = lambda path: any(getattr(k, "key", None) == "rope_table" for k in path)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, p: p.ndim >= 2 and not fixed(path), params
  )
  chain = []
  if train_cfg.grad_clip > 0:
    chain.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  chain.append(
    optax.adamw(
      learning_rate_schedule(train_cfg),
      b1=train_cfg.b1,
      b2=train_cfg.b2,
      weight_decay=train_cfg.weight_decay,
      mask=decay_mask,
    )
  )
  optimizer = optax.chain(*chain)
  # Configs written before these fields (benchmarks' namespaces) read as their defaults.
  moments = getattr(train_cfg, "opt_state_dtype", "float32")
  if moments != "float32":
    optimizer = stored_in(jnp.dtype(moments), optimizer)
  if getattr(train_cfg, "master_weights", False):
    optimizer = float32_master(optimizer)
  return optimizer


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _cast(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


def stored_in(dtype, inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` with its floating state (Adam's moments) stored in `dtype`: each update reads it
  in float32 and rounds what it stores (integer leaves, the step count, stay as they are)."""

  def init(params):
    return _cast(inner.init(params), dtype)

  def update(updates, state, params=None):
    updates, state = inner.update(updates, _cast(state, jnp.float32), params)
    return updates, _cast(state, dtype)

  return optax.GradientTransformation(init, update)


class MasterState(NamedTuple):
  master: optax.Params  # float32 copy of the params, what `inner` optimizes.
  inner: optax.OptState


def float32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` run on a float32 copy of the params held in the state. Its updates, returned, are
  float32 differences that take the params exactly to the new copy rounded to their dtype
  (optax.apply_updates adds in float32, where two bfloat16 values' difference is exact)."""

  def init(params):
    master = _cast(params, jnp.float32)
    return MasterState(master, inner.init(master))

  def update(grads, state, params=None):
    if params is None:
      raise ValueError("float32_master needs the params (optax.apply_updates' targets).")
    steps, inner_state = inner.update(_cast(grads, jnp.float32), state.inner, state.master)
    master = optax.apply_updates(state.master, steps)
    to_params = lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32)
    return jax.tree.map(to_params, master, params), MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)
