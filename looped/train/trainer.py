"""The training loop: read top to bottom (big_vision style).

`run(config, workdir)` pretrains (program 'train'); `train(...)` is the reusable loop that takes
the objective as a value, so finetuning and BeNice! post-training share it unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax.sharding import Mesh

from looped import config_checks as cc
from looped import data as data_lib
from looped import model as model_lib
from looped import schema, sharding
from looped.checkpoints import checkpointing, model_record
from looped.model.looped_lm import LoopedLM
from looped.train import dry_run, objectives, optim
from looped.train import mfu as mfu_lib
from looped.train import profiler as profiler_lib
from looped.train.config import DepthConfig, TrainConfig
from looped.train.metrics_writer import MetricsWriter
from looped.train.state import TrainState, boxed_init_fn


@dataclasses.dataclass
class TrainResult:
  state: TrainState
  final_metrics: dict
  resumed_from: int | None
  timing: dict = dataclasses.field(default_factory=dict)  # Wall seconds by part (_Timing).


class _Timing:
  """Wall seconds of one training run by part, for the pipeline's stage table.

  setup: data, state init and restore; compile: the first step (tracing, XLA compilation and
  that step); steps: every later step, to the next host sync (dispatch is asynchronous, so a
  step's compute lands where the host next waits: logging, evaluation or saving); data: host
  batches; eval: validation passes; checkpoint: the finiteness check and saving, until the
  last write is on disk.
  """

  PARTS = ("setup", "compile", "steps", "data", "eval", "checkpoint")

  def __init__(self):
    self.seconds = dict.fromkeys(self.PARTS, 0.0)
    self._last = time.perf_counter()

  def lap(self, part: str) -> None:
    """Charges the time since the previous lap to `part`."""
    now = time.perf_counter()
    self.seconds[part] += now - self._last
    self._last = now

  def as_dict(self) -> dict:
    return {**self.seconds, "total": sum(self.seconds.values())}


def validate(config) -> None:
  """Every field the training program reads; fails before any compute."""
  cc.choice(config, "program", ("train",))
  validate_training(config)


def validate_training(config) -> None:
  """seed, model, data, depth, train and mesh: each section's schema, then the rules relating
  fields."""
  cc.integer(config, "seed", min_value=0)
  model_lib.validate(config)
  schema.validate(TrainConfig, config, "train")
  if config.train.dry_run:  # Reads no data: the corpus and tokenizer may be elsewhere.
    dry_run.validate(config)
  else:
    data_lib.validate(config)
  schema.validate(DepthConfig, config, "depth")
  cc.integer(
    config,
    "depth.backprop_recurrences",
    min_value=0,
    max_value=config.model.num_recurrences,
  )
  sharding.validate(config, dry_run.device_count(config) if config.train.dry_run else None)
  if config.train.master_weights and config.model.param_dtype != "bfloat16":
    cc.fail(
      "train.master_weights",
      True,
      "needs model.param_dtype = 'bfloat16' (float32 params are their own master copy)",
    )
  init_from = config.train.init_from
  if init_from and not os.path.isdir(init_from):
    cc.fail("train.init_from", init_from, "must be an existing checkpoint or run directory")


def run(config, workdir: str) -> TrainResult | dict:
  """Pretrains; with train.dry_run, prints per-device memory and returns its figures."""
  if config.train.dry_run:
    return dry_run.run(config)
  model = LoopedLM(model_lib.from_config(config.model))
  return train(config, workdir, model, objectives.language_modeling(model, config.depth))


def make_eval_fn(model: LoopedLM):
  """Summed next-token CE (nats) and token count of one batch, full depth, unshared."""

  def eval_fn(params, batch):
    logits, _ = model.apply(params, batch["inputs"], segment_ids_BxT=batch.get("segment_ids"))
    ce = objectives.token_cross_entropy(logits, batch["targets"])
    return jnp.sum(ce), ce.size

  return jax.jit(eval_fn)


def evaluate(eval_fn, params, eval_batches, mesh, bytes_per_token: float) -> dict:
  total, count = 0.0, 0
  for batch in eval_batches:
    loss_sum, n = eval_fn(params, sharding.global_batch(batch, mesh))
    total += float(loss_sum)
    count += int(n)
  val_loss = total / count
  return {"val_loss": val_loss, "val_bpb": val_loss / math.log(2) / bytes_per_token}


def init_state(config, model: LoopedLM, optimizer, mesh: Mesh, rules) -> TrainState:
  """A fresh train state, created in place on the mesh: each device computes only its shards
  of params and optimizer state (placed by their logical axes and the rule table)."""
  init_boxed = boxed_init_fn(config, model, optimizer)
  state_shardings = sharding.shardings(jax.eval_shape(init_boxed), mesh, rules)
  return jax.jit(lambda: nn.unbox(init_boxed()), out_shardings=state_shardings)()


def make_train_step(objective: objectives.Objective, optimizer, schedule, train_cfg):
  """(state, frozen, batch) -> (state, metrics): one optimizer step over
  train_cfg.grad_accum_steps microbatches."""
  grad_fn = jax.value_and_grad(objective.loss_fn, has_aux=True)
  grad_fn = _accumulated(grad_fn, train_cfg.grad_accum_steps)

  def train_step(state: TrainState, frozen, batch):
    key = jax.random.fold_in(state.rng, state.step)
    (loss, metrics), grads = grad_fn(state.params, frozen, batch, key, state.step)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads), lr=schedule(state.step))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), metrics

  return train_step


def jit_train_step(train_step, state: TrainState):
  """The step compiled to keep the state where `state` is (its shardings), donating it."""
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.jit(train_step, donate_argnums=(0,), out_shardings=(state_shardings, None))


def _on_mesh(frozen, params, param_shardings, mesh: Mesh):
  """The objective's constants on the mesh: a params-shaped tree (a frozen teacher) sharded
  like the params, anything else replicated."""
  if frozen is None:
    return None
  if jax.tree.structure(frozen) == jax.tree.structure(params):
    return jax.device_put(frozen, param_shardings)
  return jax.device_put(frozen, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _accumulated(grad_fn, steps: int):
  """grad_fn over `steps` microbatches, gradients and metrics averaged (the same mean loss as
  one pass over the batch when microbatches hold equal token counts).

  Microbatch i takes rows i, i + steps, ... of the batch, so every device keeps its own rows
  (the batch is split in contiguous blocks over the devices) and nothing is resharded.
  """
  if steps == 1:
    return grad_fn

  def accumulated(params, frozen, batch, key, step=None):
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // steps, steps, *x.shape[1:]), batch)

    def body(total, i):
      mb = jax.tree.map(lambda x: x[:, i], micro)
      out = grad_fn(params, frozen, mb, jax.random.fold_in(key, i), step)
      return jax.tree.map(jnp.add, total, out), None

    first = jax.tree.map(lambda x: x[:, 0], micro)
    shapes = jax.eval_shape(grad_fn, params, frozen, first, key, step)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    total, _ = jax.lax.scan(body, zeros, jnp.arange(steps))
    return jax.tree.map(lambda x: x / steps, total)

  return accumulated


def _flops_per_step(objective: objectives.Objective, config):
  """step counter -> model FLOPs of that step (objective.flops_per_token x tokens), or None
  (logged) when the objective's model is not counted (looped/model/flops.py)."""
  seq_len, tokens = config.data.seq_len, config.data.batch_size * config.data.seq_len
  if objective.flops_per_token is None:
    logging.info("MFU not logged: the objective does not count its FLOPs.")
    return None
  try:
    objective.flops_per_token(seq_len, 0)
  except ValueError as e:
    logging.warning("MFU not logged: %s", e)
    return None
  return lambda step: objective.flops_per_token(seq_len, step) * tokens


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _is_due(step: int, every: int, last: int) -> bool:
  return step % every == 0 or step == last


def train(
  config,
  workdir: str,
  model: LoopedLM,
  objective: objectives.Objective,
  *,
  init_params=None,
) -> TrainResult:
  """Trains `model` on `objective` until config.train.num_steps, resuming from the workdir.

  init_params: params to start from when the workdir has no checkpoint (else
    config.train.init_from, else random init). They are copied, so the caller's arrays stay
    valid although the train state is donated to each step.
  """
  mesh = sharding.make_mesh(config)
  rules = sharding.rules(config, mesh)
  objective = objectives.vocab_chunked(objective, config.train.loss_vocab_chunk)
  with sharding.context(mesh, rules):
    return _train(config, workdir, model, objective, init_params, mesh, rules)


@dataclasses.dataclass
class _Run:
  """One training run's pieces: built by _setup, the state replaced by _restore and each step."""

  config: Any
  mesh: Mesh
  timing: _Timing
  is_chief: bool
  data_iter: Any
  eval_batches: list
  bytes_per_token: float
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  state: TrainState
  param_shardings: Any
  ckpt: checkpointing.Checkpointer


def _train(config, workdir, model, objective, init_params, mesh, rules) -> TrainResult:
  run = _setup(config, workdir, model, mesh, rules)
  resumed_from = _restore(run, workdir, init_params)
  start = int(run.state.step)
  writer = MetricsWriter(workdir, resume_step=start, enabled=run.is_chief)
  if start >= config.train.num_steps:
    logging.info(
      "Training already finished: checkpoint at step %d >= train.num_steps = %d.",
      start,
      config.train.num_steps,
    )
    run.ckpt.close()
    writer.close()
    run.timing.lap("setup")
    return TrainResult(run.state, {}, resumed_from, run.timing.as_dict())
  record = _loop(run, model, objective, writer, workdir, start)
  run.ckpt.wait()
  run.ckpt.close()
  writer.close()
  run.timing.lap("checkpoint")
  return TrainResult(run.state, record, resumed_from, run.timing.as_dict())


def _setup(config, workdir, model, mesh, rules) -> _Run:
  """The workdir, data, optimizer, a fresh train state on the mesh and the checkpointer."""
  timing = _Timing()
  model_record.check(workdir, config)  # Another model's workdir fails here, before compute.
  os.makedirs(workdir, exist_ok=True)
  logging.info("Mesh %s over %d devices", dict(mesh.shape), mesh.size)
  processes = dict(process_index=jax.process_index(), process_count=jax.process_count())
  data_iter = data_lib.make_train_iterator(config, **processes)
  eval_batches = data_lib.make_eval_batches(config, **processes)
  bytes_per_token = data_lib.eval_bytes_per_token(config)
  optimizer = optim.make_optimizer(config.train)
  schedule = optim.learning_rate_schedule(config.train)
  state = init_state(config, model, optimizer, mesh, rules)
  return _Run(
    config=config,
    mesh=mesh,
    timing=timing,
    is_chief=jax.process_index() == 0,
    data_iter=data_iter,
    eval_batches=eval_batches,
    bytes_per_token=bytes_per_token,
    optimizer=optimizer,
    schedule=schedule,
    state=state,
    param_shardings=jax.tree.map(lambda x: x.sharding, state.params),
    ckpt=checkpointing.Checkpointer(workdir, config.train.keep_checkpoints),
  )


def _restore(run: _Run, workdir: str, init_params) -> int | None:
  """run.state (and the data iterator) from the workdir's newest sound checkpoint, else params
  from init_params or train.init_from, else as initialised; returns the step resumed from."""
  tc = run.config.train
  fresh = run.data_iter.get_state()
  try:
    restored, resumed_from = run.ckpt.restore_latest(run.state, run.data_iter)
  except checkpointing.CheckpointMismatchError as e:
    run.ckpt.close()
    raise cc.ConfigError(f"config.model does not describe {workdir}'s checkpoints: {e}") from None
  if run.is_chief:  # Before the first checkpoint of a new workdir (an old one gets one too).
    model_record.write_if_absent(workdir, run.config)
  if resumed_from is not None:
    logging.info("Resuming from checkpoint at step %d in %s", resumed_from, run.ckpt.directory)
    run.state = restored
    return resumed_from
  # A checkpoint that failed verification may have moved the iterator: back to its start.
  run.data_iter.set_state(fresh)
  if init_params is None and tc.init_from:
    try:
      init_params = checkpointing.restore_params(tc.init_from, run.state.params)
    except checkpointing.CheckpointMismatchError as e:
      raise cc.ConfigError(f"config.train.init_from = {tc.init_from!r}: {e}") from None
  if init_params is not None:
    # Copy: the train state is donated to the step, and the caller may keep using its params
    # (e.g. as a frozen teacher).
    copied = jax.tree.map(lambda x: jnp.array(x, copy=True), init_params)
    run.state = run.state.replace(params=jax.device_put(copied, run.param_shardings))
  return None


def _saveable_fn(objective: objectives.Objective):
  """(state, frozen, batch) -> (ok, loss), jitted: whether `state` may be saved, i.e. finite
  params and optimizer state, and a finite loss of those params on the step's batch (a
  diverging update can leave huge but finite params)."""

  def saveable(state: TrainState, frozen, batch):
    key = jax.random.fold_in(state.rng, state.step)
    loss, _ = objective.loss_fn(state.params, frozen, batch, key, state.step)
    leaves = jax.tree.leaves((state.params, state.opt_state))
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
    return finite & jnp.isfinite(loss), loss

  return jax.jit(saveable)


def _mfu_peak(run: _Run, objective: objectives.Objective, start: int):
  """(step -> model FLOPs, the mesh's peak FLOP/s), either None where MFU is not logged."""
  step_flops = _flops_per_step(objective, run.config)
  if step_flops is None:
    return None, None
  peak_flops, peak_source = mfu_lib.mesh_peak_flops(run.mesh, run.config.train.peak_tflops)
  if peak_flops:
    logging.info(
      "MFU against %.4g TFLOP/s over %d devices (%s); %.4g TFLOPs per step at step %d",
      peak_flops / 1e12,
      run.mesh.size,
      peak_source,
      step_flops(start) / 1e12,
      start + 1,
    )
  return step_flops, peak_flops


class _Rates:
  """Throughput, MFU and ETA since the last progress line, from the first timed step (the
  first step's compilation excluded)."""

  def __init__(self, start: int, tokens_per_step: int, step_flops, peak_flops):
    self.tokens_per_step, self.step_flops, self.peak_flops = tokens_per_step, step_flops, peak_flops
    self.t_last, self.step_last, self.t_start, self.start_timed = (time.time(), start) * 2

  def restart(self, step: int) -> None:
    """The clock starts after `step` (the compiling one)."""
    self.t_last, self.step_last, self.t_start, self.start_timed = (time.time(), step) * 2

  def add(self, metrics: dict, step: int) -> None:
    now = time.time()
    elapsed = max(now - self.t_last, 1e-9)
    metrics["tokens_per_s"] = (step - self.step_last) * self.tokens_per_step / elapsed
    metrics["elapsed_s"] = now - self.t_start
    if self.peak_flops and step > self.step_last:  # Model FLOPs of the steps since the last line.
      done = sum(self.step_flops(s) for s in range(self.step_last, step))
      metrics["mfu"] = mfu_lib.mfu(done, now - self.t_last, self.peak_flops)

  def eta(self, step: int, num_steps: int) -> str:
    per_step = (time.time() - self.t_start) / max(step - self.start_timed, 1)
    return _format_eta((num_steps - step) * per_step)

  def lap(self, step: int) -> None:
    self.t_last, self.step_last = time.time(), step


def _log_progress(metrics: dict, step: int, num_steps: int, evaluated: bool, eta: str, terms):
  """The progress line of a logged step (`terms`: the objective's log_terms)."""
  val = ""
  if evaluated:
    val = f"val_loss {metrics['val_loss']:.4f} val_bpb {metrics['val_bpb']:.4f} | "
  summed = ", ".join(f"{t} {float(metrics[t]):.4f}" for t in terms)
  logging.info(
    "step %d/%d | loss %.4f%s | %s%.0f tok/s%s | ETA %s",
    step,
    num_steps,
    metrics["loss"],
    f" (weighted sum of {summed})" if summed else "",
    val,
    metrics["tokens_per_s"],
    f" | MFU {metrics['mfu']:.2%}" if "mfu" in metrics else "",
    eta,
  )


def _check_finite(metrics: dict, step: int, ckpt: checkpointing.Checkpointer) -> None:
  if not (np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])):
    ckpt.wait()
    raise FloatingPointError(
      f"Non-finite training loss ({metrics['loss']}) or gradient norm "
      f"({metrics['grad_norm']}) at step {step}. Stopped without saving; the last good "
      f"checkpoint is step {ckpt.latest_step()} in {ckpt.directory}."
    )


def _save(run: _Run, saveable, frozen, batch, step: int) -> None:
  """Saves run.state (and the iterator) after the finiteness check; raises if it fails."""
  ok, loss_after = jax.device_get(saveable(run.state, frozen, batch))
  if not ok:
    run.ckpt.wait()
    raise FloatingPointError(
      f"The state after step {step} is not finite or has a non-finite loss ({loss_after}); "
      f"not saved. The last good checkpoint is step {run.ckpt.latest_step()} in "
      f"{run.ckpt.directory}."
    )
  run.ckpt.save(step, run.state, run.data_iter)


def _loop(run: _Run, model, objective, writer: MetricsWriter, workdir: str, start: int) -> dict:
  """Steps start + 1 .. train.num_steps, logging, evaluating and saving on their cadences;
  returns the last metrics record written."""
  tc, mesh, timing = run.config.train, run.mesh, run.timing
  frozen = _on_mesh(objective.frozen, run.state.params, run.param_shardings, mesh)
  step_fn = make_train_step(objective, run.optimizer, run.schedule, tc)
  train_step, saveable = jit_train_step(step_fn, run.state), _saveable_fn(objective)
  eval_fn = make_eval_fn(model)
  tokens_per_step = run.config.data.batch_size * run.config.data.seq_len
  num_params = sum(x.size for x in jax.tree.leaves(run.state.params))
  logging.info(
    "Training steps %d -> %d (%d tokens/step, %d params)",
    *(start, tc.num_steps, tokens_per_step, num_params),
  )
  rates = _Rates(start, tokens_per_step, *_mfu_peak(run, objective, start))
  profiler = profiler_lib.Profiler(workdir, start + 1, tc.profile_skip_steps, tc.profile_steps)
  record: dict = {}
  timing.lap("setup")
  try:
    for step in range(start + 1, tc.num_steps + 1):
      batch = sharding.global_batch(next(run.data_iter), mesh)
      timing.lap("data")
      with profiler.step(step, run.state):
        run.state, metrics = train_step(run.state, frozen, batch)
      profiler.after(step, (run.state, metrics))
      if step == start + 1:  # Throughput and ETA exclude the first step's compilation.
        jax.block_until_ready(metrics["loss"])
        timing.lap("compile")
        rates.restart(step)
      due = [_is_due(step, n, tc.num_steps) for n in (tc.eval_every, tc.checkpoint_every)]
      eval_now, save_now = due
      if not (_is_due(step, tc.log_every, tc.num_steps) or eval_now or save_now):
        timing.lap("steps")
        continue
      metrics = jax.device_get(metrics)
      timing.lap("steps")
      _check_finite(metrics, step, run.ckpt)
      rates.add(metrics, step)
      if eval_now:
        eval_args = (run.state.params, run.eval_batches, mesh, run.bytes_per_token)
        metrics.update(evaluate(eval_fn, *eval_args))
        timing.lap("eval")
      record = writer.write(step, metrics)
      eta = rates.eta(step, tc.num_steps)
      _log_progress(metrics, step, tc.num_steps, eval_now, eta, objective.log_terms)
      if save_now:
        _save(run, saveable, frozen, batch, step)
        timing.lap("checkpoint")
      rates.lap(step)
      timing.lap("steps")
  finally:  # A trace still open (an error inside the profiled steps) is closed.
    profiler.close()
  return record
