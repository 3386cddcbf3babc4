"""The train state and its initialisation, shared by the trainer and the dry run."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array


def boxed_init_fn(config, model, optimizer):
  """() -> a fresh TrainState whose params (and hence Adam moments) are boxed with their
  logical axis names: traced under jit by the trainer's init_state, abstractly by the dry
  run."""
  params_key, train_key = jax.random.split(jax.random.PRNGKey(config.seed))
  dummy = jnp.zeros((1, config.data.seq_len), jnp.int32)

  def init_boxed():
    params = {"params": model.init(params_key, dummy)["params"]}  # Not 'perturbations'.
    return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), train_key)

  return init_boxed
