"""A model's parameters from a checkpoint directory, for the programs that run a trained model
(generation, the server, benchmarks): one restore that names the config field when the
checkpoint does not fit the model."""

import os

import jax
import jax.numpy as jnp

from looped import config_checks as cc
from looped.checkpoints import checkpointing
from looped.model import init_params
from looped.model.looped_lm import LoopedLM


def restore_params(model: LoopedLM, checkpoint: str, step: int, field: str):
  """The checkpoint's params (step -1: the latest); ConfigError naming `field` if they do not
  fit the model."""
  abstract = jax.eval_shape(
    lambda: init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  )
  try:
    return checkpointing.restore_params(checkpoint, abstract, None if step < 0 else step)
  except (ValueError, FileNotFoundError) as e:
    raise cc.ConfigError(
      f"config.{field} = {checkpoint!r} does not restore into config.model: {e}"
    ) from None


def has_checkpoint(path: str) -> bool:
  """Whether `path` (a workdir or its checkpoints/ directory) holds a numbered step."""
  directory = checkpointing.checkpoint_dir(path)
  directory = directory if os.path.isdir(directory) else path
  return any(name.isdigit() for name in os.listdir(directory))


def check_checkpoint(config, section: str) -> None:
  """`{section}.checkpoint` holds a checkpoint (generation and the server read a checkpoint
  alike; their schemas check `{section}.step`)."""
  checkpoint = cc.string(config, f"{section}.checkpoint")
  if not os.path.isdir(checkpoint):
    cc.fail(f"{section}.checkpoint", checkpoint, "must be an existing trainer workdir or stage dir")
  if not has_checkpoint(checkpoint):
    cc.fail(
      f"{section}.checkpoint", checkpoint, "holds no checkpoint (no checkpoints/STEP directory)"
    )
