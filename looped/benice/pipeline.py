"""The BeNice! program (docs/design.md §4): one command from pretraining to the shareability report.

  stage 1  pretrain     WORKDIR/pretrain  LM loss with config.depth (stochastic depth by default)
  stage 2  finetune     WORKDIR/finetune  standard finetuning from the pretrained params
           benice       WORKDIR/benice    BeNice! from the same params (same data and schedule)
  stage 3  evaluate     WORKDIR/eval/{zero_shot,finetune,benice}.json
  stage 4  report       WORKDIR/report/shareability.{json,md} and PNG plots; table printed

Stages resume and skip (stages.py); evaluations are cached by checkpoint step and eval config.
`config.pipeline.pretrain_workdir` / `finetune_workdir` take those stages read-only from
another run, so BeNice! ablations share one pretraining and one finetuning baseline. A reused
pretraining run (or a converted checkpoint) supplies the model and tokenizer it records
(looped.checkpoints.model_record), whatever config.model says.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import logging

from looped import config_checks as cc
from looped import data as data_lib
from looped import kv_quant, schema, sharding
from looped import model as model_lib
from looped.benice import evaluation, objectives, report, samples, stages, timing
from looped.benice.config import MODEL_NAMES, BeniceConfig, EvalConfig, PipelineConfig
from looped.checkpoints import checkpointing, model_record
from looped.data import tokenizers
from looped.model import adaptive, mixers
from looped.model import kv_policy as kv_policy_lib
from looped.model.looped_lm import LoopedLM
from looped.train import dry_run, trainer
from looped.train import objectives as train_objectives

MODELS = dict(zip(MODEL_NAMES, stages.STAGES, strict=True))  # Model name -> its stage.
MODELS_OF_STAGE = {stage: name for name, stage in MODELS.items()}


def model_source(config) -> str:
  """The reused pretraining run whose recorded model this program uses (looped.programs)."""
  return config.pipeline.pretrain_workdir


def _with_source_model(config, chosen: tuple[str, ...] = ()):
  """config with the model and tokenizer recorded by pipeline.pretrain_workdir, if any (with
  the `chosen` fields of config.model: the loop count set on the command line)."""
  source = cc.string(config, "pipeline.pretrain_workdir", allow_empty=True)
  return model_record.with_recorded_model(config, source, chosen) if source else config


def validate(config, chosen: tuple[str, ...] = ()) -> None:
  """The whole config, every stage's effective training config included; no compute."""
  cc.choice(config, "program", ("benice",))
  config = _with_source_model(config, chosen)
  for stage in stages.STAGES:
    stages.validate_stage(config, stage)
  schema.validate(PipelineConfig, config, "pipeline")
  _check_models(config)
  _check_benice(config)
  _check_eval_passes(config)
  _check_eval_sharing(config)
  _check_eval_depth(config)
  _check_eval_decode(config)
  _check_eval_samples(config)
  _check_reused_runs(config)


def _upper(names) -> str:
  """Mixer names as messages write them ('KDA, MLA')."""
  return ", ".join(m.upper() for m in names)


def _check_models(config) -> None:
  """pipeline.models: distinct names of the models the pipeline trains and evaluates."""
  models = config.pipeline.models
  if (
    not isinstance(models, (tuple, list))
    or not models
    or any(m not in MODELS for m in models)
    or len(set(models)) != len(models)
  ):
    cc.fail(
      "pipeline.models", models, f"must be a non-empty tuple of distinct names from {tuple(MODELS)}"
    )


def _check_benice(config) -> None:
  """The benice section: its schema, ramps within the training steps, block prefill only where
  every core layer can run it, and some loss to train."""
  schema.validate(BeniceConfig, config, "benice")
  for name in ("shared_ramp_steps", "kv_passes_ramp_steps"):
    cc.integer(config, "benice." + name, min_value=0, max_value=config.post.train.num_steps)
  b = config.benice
  if b.kv_passes_ramp_steps and not b.kv_passes:
    cc.fail("benice.kv_passes_ramp_steps", b.kv_passes_ramp_steps, "needs benice.kv_passes > 0")
  lacking = mixers.lacking(config.model, "core", "block_prefill")
  if b.prefill_block and (config.model.attention_impl == "pallas" or lacking):
    cc.fail(
      "benice.prefill_block",
      b.prefill_block,
      "needs model.attention_impl = 'xla' or 'auto' and core layers that run block prefill "
      "(block prefill's parallel reads)"
      + (f"; {_upper(lacking)} core layers do not" if lacking else ""),
    )
  weights = (b.shared_ce_weight, b.unshared_ce_weight, b.kl_weight, b.residual_weight)
  if sum(weights) + b.distill_weight <= 0:
    cc.fail("benice.shared_ce_weight", b.shared_ce_weight, "some loss weight must be > 0")


def _check_eval_passes(config) -> None:
  """The eval section's schema, its Jacobi pass counts and its prefill block sizes."""
  schema.validate(EvalConfig, config, "eval")
  passes = config.eval.jacobi_passes
  if (
    not isinstance(passes, (tuple, list))
    or not passes
    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in passes)
  ):
    cc.fail("eval.jacobi_passes", passes, "must be a non-empty tuple of integers >= 1")
  blocks = config.eval.prefill_blocks
  if not isinstance(blocks, (tuple, list)) or not all(
    isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in blocks
  ):
    cc.fail("eval.prefill_blocks", blocks, "must be a tuple of integers >= 1 (may be empty)")


def _check_eval_sharing(config) -> None:
  """The KV policies (others than 'final' only where every core layer supports them) and the
  KV formats the evaluation measures."""
  num_recurrences = config.model.num_recurrences
  kv_policy_lib.check(config.eval.kv_policy, num_recurrences, "config.eval.kv_policy")
  policies = config.eval.kv_policies
  if not isinstance(policies, (tuple, list)):
    cc.fail("eval.kv_policies", policies, "must be a tuple of KV-sharing policies (may be empty)")
  for name in policies:
    kv_policy_lib.check(name, num_recurrences, "config.eval.kv_policies")
  uses = [config.eval.kv_policy, *policies]
  lacking = mixers.lacking(config.model, "core", "kv_policies")
  if lacking and any(p != kv_policy_lib.FINAL for p in uses):
    cc.fail("eval.kv_policies", policies, f"{_upper(lacking)} core layers share only under 'final'")
  formats = config.eval.kv_formats
  if not isinstance(formats, (tuple, list)) or any(f not in kv_quant.FORMATS for f in formats):
    cc.fail("eval.kv_formats", formats, f"must be a tuple of formats from {kv_quant.FORMATS}")
  for fmt in formats:
    try:
      kv_quant.check_format(fmt, config.model.head_dim)
    except ValueError as e:
      cc.fail("eval.kv_formats", formats, str(e).rstrip("."))


def _check_eval_depth(config) -> None:
  """The evaluation's recurrences and exit settings (looped/model/adaptive.py)."""
  e = config.eval
  try:
    evaluation.depth_settings(e).check(
      max(e.recurrences, config.model.num_recurrences), config.model.exit_gate, "config.eval."
    )
  except ValueError as err:
    raise cc.ConfigError(str(err)) from None
  if e.exit_lookup != "latest" and not mixers.all_with(config.model, "core", "attends"):
    cc.fail("eval.exit_lookup", e.exit_lookup, "needs attention core layers")


def _check_eval_decode(config) -> None:
  """The decode subset: its batches and the rows a decode call takes."""
  num_eval_batches = config.data.num_eval_batches
  decode_batches = cc.integer(
    config, "eval.decode_batches", min_value=0, max_value=num_eval_batches
  )
  decode_batches = decode_batches or num_eval_batches
  rows = config.eval.decode_rows
  batch = config.data.eval_batch_size
  if rows and (rows % batch or (decode_batches * batch) % rows):
    cc.fail(
      "eval.decode_rows",
      rows,
      f"must be 0 or a multiple of data.eval_batch_size = {batch} that divides the decode "
      f"subset's {decode_batches * batch} rows",
    )


def _check_eval_samples(config) -> None:
  """The report's samples: how many, and prompt plus continuation within the model's length."""
  num_eval_batches = config.data.num_eval_batches
  batch = config.data.eval_batch_size
  num_samples = cc.integer(config, "eval.samples", min_value=0, max_value=num_eval_batches * batch)
  prompt = cc.integer(
    config, "eval.sample_prompt_tokens", min_value=1, max_value=config.data.seq_len
  )
  new = config.eval.sample_new_tokens
  if num_samples and prompt + new > config.model.max_seq_len:  # No samples: no length limit.
    cc.fail(
      "eval.sample_new_tokens",
      new,
      f"with eval.sample_prompt_tokens = {prompt} must fit model.max_seq_len = "
      f"{config.model.max_seq_len}",
    )


def _check_reused_runs(config) -> None:
  """Reused pretraining and finetuning runs: checkpointed, and the baseline as long as BeNice!."""
  for name, stage in (("pretrain_workdir", "pretrain"), ("finetune_workdir", "finetune")):
    path = config.pipeline[name]
    if path and stages.latest_step(path) is None:
      cc.fail("pipeline." + name, path, f"must be a {stage} run directory with a checkpoint")
  if config.pipeline.finetune_workdir:
    step, wanted = stages.latest_step(config.pipeline.finetune_workdir), config.post.train.num_steps
    if step != wanted:
      cc.fail(
        "pipeline.finetune_workdir",
        config.pipeline.finetune_workdir,
        f"its checkpoint is at step {step}, but the baseline must have post.train.num_steps = "
        f"{wanted} steps like BeNice!",
      )


def _abstract_params(model: LoopedLM, seq_len: int, mesh, rules):
  """Shapes, dtypes and mesh shardings of the params: what a restore places them as."""
  dummy = jnp.zeros((1, seq_len), jnp.int32)
  boxed = jax.eval_shape(lambda: {"params": model.init(jax.random.PRNGKey(0), dummy)["params"]})
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
    nn.unbox(boxed),
    sharding.shardings(boxed, mesh, rules),
  )


def _train_stage(
  config,
  stage: str,
  stage_dir: str,
  model: LoopedLM,
  make_objective,
  init_params=None,
  parent: dict | None = None,
) -> str:
  """Trains one stage unless its done-marker says it finished; resumes an interrupted one.
  Returns what this invocation did: 'trained', 'resumed' or 'skipped'."""
  stage_cfg = stages.stage_config(config, stage)
  stages.begin(stage_dir, stage_cfg, parent)
  num_steps = stage_cfg.train.num_steps
  done = stages.done_step(stage_dir)
  if done is not None and done >= num_steps:
    logging.info("Stage %s: done (step %d) in %s; skipped.", stage, done, stage_dir)
    return "skipped"
  logging.info("Stage %s: training to step %d in %s", stage, num_steps, stage_dir)
  start = time.time()
  objective = make_objective(stage_cfg)
  init = init_params() if init_params is not None else None
  result = trainer.train(stage_cfg, stage_dir, model, objective, init_params=init)
  resumed = result.resumed_from or 0
  wall = time.time() - start
  parts = {k: v for k, v in result.timing.items() if k != "total"}
  # Setup also covers what ran before the trainer: the objective and the initial params.
  parts["setup"] = parts.get("setup", 0.0) + wall - result.timing.get("total", 0.0)
  step = int(result.state.step)
  stages.mark_done(stage_dir, step, wall, parts, step - resumed)
  return "resumed" if resumed else "trained"


def _eval_key(eval_config) -> dict:
  """The eval section as a cached evaluation's key; the KV-policy fields only where they differ
  from their defaults, so evaluations cached before those fields existed are still found."""
  key = eval_config.to_dict()
  if key.get("kv_policy") == kv_policy_lib.FINAL:
    del key["kv_policy"]
  if "kv_policies" in key and not tuple(key["kv_policies"]):
    del key["kv_policies"]
  for name, (_, default, _) in schema.fields(EvalConfig).items():  # Test-time depth's, likewise.
    if name in _DEPTH_FIELDS and key.get(name) == default:
      del key[name]
  return key


# The eval section's test-time depth fields (evaluations cached before them keep their keys).
_DEPTH_FIELDS = {f.name for f in dataclasses.fields(adaptive.DepthSettings)} | {"exit_lookup"}


def _evaluate(config, workdir: str, model: LoopedLM, abstract, stage_dirs: dict, mesh):
  """Shareability metrics of each model, from cache where checkpoint and settings match;
  returns (metrics by model, their timing rows)."""
  eval_batches = data_lib.make_eval_batches(config, process_index=0, process_count=1)
  results, timings = {}, []
  for name in config.pipeline.models:
    stage_dir = stage_dirs[MODELS[name]]
    key = _eval_cache_key(config, stage_dir)
    path = os.path.join(workdir, "eval", f"{name}.json")
    cached = _read_cached_eval(path, key)
    if cached is not None:
      logging.info("Evaluation %s: cached in %s", name, path)
      results[name] = cached["metrics"]
      timings.append(timing.eval_row(name, cached.get("timing"), "cached"))
      continue
    logging.info("Evaluation %s: %s step %d", name, stage_dir, key["step"])
    start = time.time()
    params = checkpointing.restore_params(stage_dir, abstract)
    metrics, seconds = _evaluate_params(config, model, params, eval_batches, mesh, start)
    logging.info("Evaluation %s: %.1f s, %s", name, time.time() - start, report.summary(metrics))
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "w") as f:
        json.dump({"key": key, "metrics": metrics, "timing": seconds}, f, indent=1)
    results[name] = metrics
    timings.append(timing.eval_row(name, seconds, "evaluated"))
  return results, timings


def _eval_cache_key(config, stage_dir: str) -> dict:
  """What a cached evaluation of the checkpoint in stage_dir must match to be reused: the
  checkpoint, the eval and data settings, the metrics' version, and any model field chosen
  on the command line that the checkpoint's record does not say (a loop count)."""
  key = {
    "checkpoint": os.path.abspath(stage_dir),
    "step": stages.latest_step(stage_dir),
    "eval": _eval_key(config.eval),
    "metrics_version": evaluation.METRICS_VERSION,
    "data": config.data.to_dict(),
  }
  record = model_record.read(stage_dir)
  chosen = {
    f: config.model[f]
    for f in model_record.READER_FIELDS
    if record is not None and model_record.recorded_value(record, f) != config.model[f]
  }
  if chosen:
    key["chosen"] = chosen
  return json.loads(json.dumps(key))  # As a cached file reads it back.


def _read_cached_eval(path: str, key: dict) -> dict | None:
  """The evaluation cached at path if it was made under key, else None."""
  if not os.path.exists(path):
    return None
  with open(path) as f:
    cached = json.load(f)
  return cached if cached["key"] == key else None


def _evaluate_params(config, model: LoopedLM, params, eval_batches, mesh, start: float):
  """(metrics, seconds per part) of one model's params: the full-precision metrics, the
  perplexities per KV format, and the report's samples (where the model supports them)."""
  cfg = evaluation.depth_model(model.cfg, config.eval)  # At eval.recurrences.
  evaluate = functools.partial(
    evaluation.evaluate,
    params=params,
    eval_batches=eval_batches,
    jacobi_passes=tuple(config.eval.jacobi_passes),
    decode_batches=config.eval.decode_batches,
    decode_rows=config.eval.decode_rows,
    prefill_blocks=tuple(config.eval.prefill_blocks),
    place=functools.partial(jax.device_put, device=sharding.batch_sharding(mesh)),
    kv_policy=config.eval.kv_policy,
  )
  metrics = evaluate(
    evaluation.make_stats_fns(cfg, None, config.eval.kv_policy),
    cfg,
    kv_policies=tuple(config.eval.kv_policies),
    depth=evaluation.depth_fn(cfg, config.eval),
  )
  seconds = {"fp32": time.time() - start}
  # Per format only what its table reports: unshared and exact shared perplexities (no Jacobi
  # passes, drift or block prefill).
  metrics["kv_formats"] = {
    fmt: evaluate(
      evaluation.make_stats_fns(cfg, fmt, config.eval.kv_policy),
      cfg,
      kv_format=fmt,
      jacobi_passes=(),
      drift=False,
      prefill_blocks=(),
    )
    for fmt in config.eval.kv_formats
  }
  seconds["kv_formats"] = time.time() - start - sum(seconds.values())
  if config.eval.samples and samples.supported(model):
    metrics["samples"] = samples.generate(
      model,
      params,
      samples.prompts(eval_batches, config.eval.samples, config.eval.sample_prompt_tokens),
      config.eval.sample_new_tokens,
      tokenizers.get(config.data).decode,
      config.eval.kv_policy,
    )
  seconds["samples"] = time.time() - start - sum(seconds.values())
  return metrics, seconds


def run(config, workdir: str, chosen: tuple[str, ...] = ()) -> dict:
  """Runs (or skips) every stage, then writes and prints the report. Returns the report.
  chosen: config.model fields used instead of the reused pretraining run's record (its loop
  count, set on the command line); post-training and evaluation then run at that count."""
  if config.train.dry_run:  # Per-device memory of a stage's training; nothing runs.
    return dry_run.run(config)
  invocation_start = time.time()
  config = _with_source_model(config, chosen)
  model = LoopedLM(model_lib.from_config(config.model))
  mesh = sharding.make_mesh(config)  # Training, evaluation and decode all run on it.
  rules = sharding.rules(config, mesh)
  abstract = _abstract_params(model, config.data.seq_len, mesh, rules)
  stage_dirs = {
    stages.PRETRAIN: config.pipeline.pretrain_workdir or os.path.join(workdir, "pretrain"),
    stages.FINETUNE: config.pipeline.finetune_workdir or os.path.join(workdir, "finetune"),
    stages.BENICE: os.path.join(workdir, "benice"),
  }
  language_modeling = lambda c: train_objectives.language_modeling(model, c.depth)
  # Restored afresh for each use: the trainer donates its initial params' buffers, so the
  # frozen copy for the KL term must not share them.
  pretrained = lambda: checkpointing.restore_params(stage_dirs[stages.PRETRAIN], abstract)

  # Every post-training stage must come from this run's pretraining: checked before any training.
  parent = stages.pretrain_parent(config, stage_dirs[stages.PRETRAIN])
  for stage in stages.POST_STAGES:
    if MODELS_OF_STAGE[stage] in config.pipeline.models:
      stages.check_parent(stage, stage_dirs[stage], parent)

  status = {}
  if config.pipeline.pretrain_workdir:
    logging.info("Stage pretrain: reusing %s", config.pipeline.pretrain_workdir)
    status[stages.PRETRAIN] = "reused"
  else:
    status[stages.PRETRAIN] = _train_stage(
      config, stages.PRETRAIN, stage_dirs[stages.PRETRAIN], model, language_modeling
    )

  models = tuple(config.pipeline.models)
  if "finetune" not in models:
    stage_dirs.pop(stages.FINETUNE)
  elif config.pipeline.finetune_workdir:
    logging.info("Stage finetune: reusing %s", config.pipeline.finetune_workdir)
    status[stages.FINETUNE] = "reused"
  else:
    status[stages.FINETUNE] = _train_stage(
      config,
      stages.FINETUNE,
      stage_dirs[stages.FINETUNE],
      model,
      language_modeling,
      pretrained,
      parent,
    )

  def benice_objective(c):
    frozen = pretrained() if c.benice.kl_weight > 0 else None
    return objectives.benice(model, c.depth, c.benice, frozen)

  if "benice" in models:
    status[stages.BENICE] = _train_stage(
      config, stages.BENICE, stage_dirs[stages.BENICE], model, benice_objective, pretrained, parent
    )
  else:
    stage_dirs.pop(stages.BENICE)

  with sharding.context(mesh, rules):
    results, eval_timings = _evaluate(config, workdir, model, abstract, stage_dirs, mesh)
  out = report.build(config, results, stage_dirs)
  if jax.process_index() == 0:
    report_dir = os.path.join(workdir, "report")
    report.write(report_dir, out, stage_dirs)
    print(report.markdown(out), flush=True)
    logging.info("Report: %s (table: shareability.md, plots: *.png)", report_dir)
    rows = [timing.train_row(s, stage_dirs[s], status[s]) for s in status]
    times = timing.write(workdir, rows + eval_timings, time.time() - invocation_start)
    print("\n" + timing.markdown(times), flush=True)
  return out
