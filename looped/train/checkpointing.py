"""Orbax checkpoints of the train state and the Grain iterator, one manager per workdir.

Items: 'params', 'train' ({opt_state, step, rng}) and 'data' (the iterator's state), so a later
stage can restore just the params of an earlier one (`restore_params`).
"""

from __future__ import annotations

import os

import grain
import jax
import orbax.checkpoint as ocp
from absl import logging


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Checkpointer:
  def __init__(self, workdir: str, keep: int):
    self.directory = checkpoint_dir(workdir)
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_iter) -> None:
    train = {"opt_state": state.opt_state, "step": state.step, "rng": state.rng}
    self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        train=ocp.args.StandardSave(train),
        data=grain.checkpoint.CheckpointSave(data_iter),
      ),
    )

  def restore(self, step: int, abstract_state, data_iter):
    """Restores state (shapes/shardings of abstract_state) and data_iter in place."""
    abstract_train = {
      "opt_state": abstract_state.opt_state,
      "step": abstract_state.step,
      "rng": abstract_state.rng,
    }
    restored = self.manager.restore(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        train=ocp.args.StandardRestore(abstract_train),
        data=grain.checkpoint.CheckpointRestore(data_iter),
      ),
    )
    train = restored["train"]
    return abstract_state.replace(
      params=restored["params"],
      opt_state=train["opt_state"],
      step=train["step"],
      rng=train["rng"],
    )

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


def restore_params(workdir_or_dir: str, abstract_params, step: int | None = None):
  """Params of the latest (or given) checkpoint of another run, e.g. a pretraining stage."""
  directory = workdir_or_dir
  if os.path.isdir(checkpoint_dir(workdir_or_dir)):
    directory = checkpoint_dir(workdir_or_dir)
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"No checkpoint found under {directory!r}.")
  logging.info("Loading params from %s step %d", directory, step)
  restored = manager.restore(
    step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params))
  )
  manager.close()
  return restored["params"]


def abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
