"""Orbax checkpoints of the train state and the Grain iterator, one manager per workdir.

Items: 'params', 'train' ({opt_state, step, rng}), 'data' (the iterator's state) and
'checksums' (sha256 of every saved array's contents, by pytree path), so a later stage can
restore just the params of an earlier one (`restore_params`).

A checkpoint is trusted only if it restores and every array matches its checksum: a truncated
file, a same-size overwrite or a torn JSON all fail. `Checkpointer.restore_latest` then moves the
bad step aside to WORKDIR/checkpoints_corrupt/ (kept, never deleted), warns naming it, and falls
back to the previous step. Checksums are of array contents, not files, so they hold across
shardings.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath


class CorruptCheckpointError(RuntimeError):
  """A checkpoint that does not restore, or whose arrays do not match their checksums."""


class CheckpointMismatchError(ValueError):
  """A sound checkpoint of another model: an array's stored shape, or the set of arrays,
  differs from what the requested model expects. Not corruption: nothing is quarantined."""


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def corrupt_dir(workdir_or_checkpoints: str) -> str:
  return os.path.join(os.path.dirname(workdir_or_checkpoints.rstrip("/")), "checkpoints_corrupt")


def checksums(tree) -> dict[str, str]:
  """{pytree path: sha256 of the array's dtype, shape and bytes} of every leaf (fetched to host)."""
  out = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    array = np.asarray(jax.device_get(leaf))
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
      array = np.asarray(jax.random.key_data(leaf))
    digest = hashlib.sha256(f"{array.dtype}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    out[jax.tree_util.keystr(path)] = digest.hexdigest()
  return out


def _verify(name: str, tree, recorded: dict[str, str], where: str) -> None:
  if not recorded:
    raise CorruptCheckpointError(f"{where}: no {name} checksums recorded.")
  got = checksums(tree)
  bad = sorted(k for k in got if recorded.get(k) != got[k])
  missing = sorted(set(recorded) - set(got))
  if bad or missing:
    raise CorruptCheckpointError(
      f"{where}: {name} arrays do not match their checksums ({(bad + missing)[:3]}"
      f"{' ...' if len(bad) + len(missing) > 3 else ''})."
    )


def _state_items(state) -> tuple[dict, dict]:
  train = {"opt_state": state.opt_state, "step": state.step, "rng": state.rng}
  return state.params, train


class Checkpointer:
  def __init__(self, workdir: str, keep: int):
    self.directory = checkpoint_dir(workdir)
    self._keep = keep
    self.manager = self._open()

  def _open(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_iter) -> None:
    params, train = _state_items(state)
    sums = {"params": checksums(params), "train": checksums(train)}
    self.manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        train=ocp.args.StandardSave(train),
        data=grain.checkpoint.CheckpointSave(data_iter),
        checksums=ocp.args.JsonSave(sums),
      ),
    )

  def restore(self, step: int, abstract_state, data_iter):
    """Restores state (shapes/shardings of abstract_state) and data_iter in place, verified.

    Raises CorruptCheckpointError if the step cannot be read or fails its checksums.
    """
    abstract_params, abstract_train = _state_items(abstract_state)
    where = os.path.join(self.directory, str(step))
    items = dict(
      params=ocp.args.StandardRestore(abstract_params),
      train=ocp.args.StandardRestore(abstract_train),
      data=grain.checkpoint.CheckpointRestore(data_iter),
    )
    check_fits(where, "params", abstract_params)
    verified = _has_checksums(where)
    if verified:
      items["checksums"] = ocp.args.JsonRestore()
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # noqa: BLE001  TensorStore, JSON and Orbax errors alike.
      raise CorruptCheckpointError(f"{where} cannot be restored: {_first_line(e)}") from e
    if verified:
      recorded = restored["checksums"] or {}
      _verify("params", restored["params"], recorded.get("params", {}), where)
      _verify("train", restored["train"], recorded.get("train", {}), where)
    train = restored["train"]
    return abstract_state.replace(
      params=restored["params"],
      opt_state=train["opt_state"],
      step=train["step"],
      rng=train["rng"],
    )

  def restore_latest(self, abstract_state, data_iter):
    """(state, step) of the newest checkpoint that verifies; (None, None) if none does.

    Each bad checkpoint is moved to checkpoints_corrupt/ with a warning naming it.
    """
    while (step := self.latest_step()) is not None:
      try:
        return self.restore(step, abstract_state, data_iter), step
      except CorruptCheckpointError as e:
        moved = self.quarantine(step)
        logging.warning("Checkpoint step %d is corrupt (%s); moved to %s.", step, e, moved)
    return None, None

  def quarantine(self, step: int) -> str:
    """Moves a bad step out of the manager's sight (kept for inspection) and reopens it."""
    self.manager.close()
    target_root = corrupt_dir(self.directory)
    os.makedirs(target_root, exist_ok=True)
    target = os.path.join(target_root, f"{step}.{time.strftime('%Y%m%d-%H%M%S')}")
    shutil.move(os.path.join(self.directory, str(step)), target)
    self.manager = self._open()
    return target

  def wait(self):
    self.manager.wait_until_finished()

  def close(self):
    self.manager.close()


def restore_params(workdir_or_dir: str, abstract_params, step: int | None = None):
  """Verified params of the latest (or given) checkpoint of another run, e.g. a pretraining stage.

  Never falls back silently to another step: a corrupt checkpoint raises CorruptCheckpointError.
  """
  directory = workdir_or_dir
  if os.path.isdir(checkpoint_dir(workdir_or_dir)):
    directory = checkpoint_dir(workdir_or_dir)
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f"No checkpoint found under {directory!r}.")
  logging.info("Loading params from %s step %d", directory, step)
  where = os.path.join(directory, str(step))
  items = dict(params=ocp.args.StandardRestore(_placed(abstract_params)))
  try:
    check_fits(where, "params", abstract_params)
  except CheckpointMismatchError:
    manager.close()
    raise
  verified = _has_checksums(where)
  if verified:
    items["checksums"] = ocp.args.JsonRestore()
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # noqa: BLE001
    raise CorruptCheckpointError(f"{where} cannot be restored: {_first_line(e)}") from e
  finally:
    manager.close()
  if verified:
    _verify("params", restored["params"], (restored["checksums"] or {}).get("params", {}), where)
  return restored["params"]


def has_any(workdir: str) -> bool:
  """Whether workdir holds any checkpoint step."""
  directory = checkpoint_dir(workdir)
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def save_params(workdir: str, step: int, params) -> str:
  """Writes params alone (with their checksums) as checkpoint `step` of workdir, as a trainer
  checkpoint's 'params' item: what `restore_params` reads (e.g. a converted model)."""
  manager = ocp.CheckpointManager(
    checkpoint_dir(workdir), options=ocp.CheckpointManagerOptions(create=True)
  )
  try:
    manager.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        checksums=ocp.args.JsonSave({"params": checksums(params)}),
      ),
    )
    manager.wait_until_finished()
  finally:
    manager.close()
  return os.path.join(checkpoint_dir(workdir), str(step))


def _stored_shapes(item_dir: str) -> dict[str, tuple] | None:
  """{pytree path: shape} of a saved item from its metadata (None if that cannot be read: a
  damaged checkpoint is then reported by the restore itself, as corrupt)."""
  handler = ocp.StandardCheckpointHandler()
  try:
    metadata = handler.metadata(epath.Path(item_dir))
    leaves = jax.tree_util.tree_leaves_with_path(metadata, is_leaf=lambda x: hasattr(x, "shape"))
    return {jax.tree_util.keystr(p): tuple(leaf.shape) for p, leaf in leaves}
  except Exception:  # noqa: BLE001  Any unreadable metadata.
    return None
  finally:
    handler.close()


def check_fits(step_dir: str, item: str, abstract) -> None:
  """CheckpointMismatchError naming the first array whose stored shape differs from the one
  `abstract` expects (or that only one side has): the checkpoint is of another model."""
  stored = _stored_shapes(os.path.join(step_dir, item))
  if stored is None:
    return
  wanted = {
    jax.tree_util.keystr(p): tuple(x.shape)
    for p, x in jax.tree_util.tree_leaves_with_path(abstract)
  }
  for key in sorted(wanted.keys() | stored.keys()):
    if wanted.get(key) != stored.get(key):
      show = lambda s: "absent" if s is None else f"shape {s}"
      raise CheckpointMismatchError(
        f"{step_dir} holds a different model: {item}{key} is {show(stored.get(key))} in the "
        f"checkpoint but {show(wanted.get(key))} in the requested model."
      )


def _placed(abstract):
  """Leaves without a sharding go to this process's first device: Orbax needs a placement to
  restore arrays written by another topology (e.g. a multi-host or multi-device run)."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def place(x):
    if getattr(x, "sharding", None) is not None:
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device)

  return jax.tree.map(place, abstract)


def _has_checksums(step_dir: str) -> bool:
  """Checkpoints written before checksums existed load unverified, with a warning."""
  if os.path.isdir(os.path.join(step_dir, "checksums")):
    return True
  logging.warning("%s has no checksums (written by an older version): loaded unverified.", step_dir)
  return False


def _first_line(error: Exception) -> str:
  text = str(error).strip()
  return (text.splitlines()[0] if text else type(error).__name__)[:300]


def abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
