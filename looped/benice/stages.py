"""Per-stage configs and markers of the BeNice! pipeline.

Each training stage is one `trainer.train` call on an *effective* config: the base config's
seed/model/data/depth/train, where the post-training stages (standard finetune and BeNice!)
take `config.post.depth` as their depth and `config.post.train`'s fields over `config.train`'s.
Both post-training arms therefore share data order (same seed), steps, optimizer and schedule.

A stage directory holds `stage_config.json` (the effective config it was started with, and for a
post-training stage its parent: the pretraining stage's workdir, step and config hash) and, once its
trainer call returned, `done.json`. A post-training stage whose recorded parent differs from the one
this run would use (e.g. more pretraining steps) is refused before anything trains. A rerun skips a
stage whose done.json reached the configured steps, resumes an unfinished one (the trainer restores
its latest checkpoint), and refuses to continue a stage whose recorded config differs in anything
but the step cadence: mixing two configs in one run would make its numbers meaningless.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import ml_collections

from looped import config_checks as cc
from looped.checkpoints import checkpointing
from looped.model.config import ModelConfig
from looped.train import trainer

PRETRAIN, FINETUNE, BENICE = "pretrain", "finetune", "benice"
STAGES = (PRETRAIN, FINETUNE, BENICE)
POST_STAGES = (FINETUNE, BENICE)
# Train fields that may change between a run and its resumption (they do not change the math).
_CADENCE = ("num_steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints")
# Train fields that say what a run reports or whether it runs, not what it trains.
_OBSERVATION = ("peak_tflops", "profile_steps", "profile_skip_steps", "dry_run")


def _copy(node) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(node.to_dict())


def stage_config(config, stage: str) -> ml_collections.ConfigDict:
  """The config `trainer.train` gets for `stage` (module docstring)."""
  c = ml_collections.ConfigDict()
  c.seed = config.seed
  for section in ("model", "data", "depth", "train", "mesh"):
    c[section] = _copy(config[section])
  c.mesh_rules = config.mesh_rules
  if stage in POST_STAGES:
    c.depth = _copy(config.post.depth)
    for name, value in config.post.train.items():
      c.train[name] = value
    c.train.init_from = ""  # Post-training starts from the pretrained params, passed directly.
  if stage == BENICE:
    c.benice = _copy(config.benice)
  return c


def validate_stage(config, stage: str) -> None:
  """trainer.validate_training on the stage's effective config, naming the fields as set."""
  if stage in POST_STAGES:
    unknown = sorted(set(config.post.train.keys()) - set(config.train.keys()))
    if unknown:
      raise cc.ConfigError(
        f"config.post.train has unknown field(s) {unknown}; allowed: the fields of config.train "
        f"({', '.join(sorted(config.train.keys()))})."
      )
  try:
    trainer.validate_training(stage_config(config, stage))
  except cc.ConfigError as e:
    message = str(e)
    if stage in POST_STAGES:
      message = message.replace("config.depth.", "config.post.depth.")
      for name in config.post.train.keys():
        message = message.replace(f"config.train.{name} ", f"config.post.train.{name} ")
    raise cc.ConfigError(message) from None


def latest_step(workdir: str) -> int | None:
  """Latest finished checkpoint step of a run directory (None: no checkpoint)."""
  directory = checkpointing.checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return None
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()]
  return max(steps) if steps else None


_PLACEMENT = ("mesh", "mesh_rules")
# Model fields that say how to compute, not what: a stage resumes under another value.
_SAME_MATH = ("scan_recurrences", "scan_unroll", "remat", "attention_impl")


def _strip(d: dict) -> dict:
  """A recorded stage config without what may change on resume. Records written before a field
  joined these lists still hold it, so a record is stripped too before it is compared."""
  for name in _PLACEMENT:  # The same stage on another mesh (a checkpoint restores on any).
    d.pop(name, None)
  for name in _SAME_MATH:
    d.get("model", {}).pop(name, None)
  for name in _CADENCE + _OBSERVATION:
    d.get("train", {}).pop(name, None)
  return d


def _fingerprint(stage_cfg) -> dict:
  return _strip(json.loads(json.dumps(stage_cfg.to_dict())))


def _digest(fingerprint: dict) -> str:
  return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _recorded(stage_dir: str) -> dict | None:
  """A stage's stage_config.json without its parent, as written; None if it has none."""
  path = os.path.join(stage_dir, "stage_config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    recorded = json.load(f)
  recorded.pop("parent", None)
  return recorded


def _recorded_digests(stage_dir: str) -> set[str]:
  """Digests a stage's recorded config has had: stripped (today's) and as written (what a
  child recorded as its parent before the stripped lists grew)."""
  recorded = _recorded(stage_dir)
  if recorded is None:
    return set()
  as_written = _digest(recorded)
  return {as_written, _digest(_strip(recorded))}


# A field added to looped after a stage was recorded is absent from its stage_config.json; the
# stage was trained with the behaviour the field's default keeps, so that default matches.
# Model fields: every ModelConfig field at its default (as JSON writes it).
_MODEL_FIELD_DEFAULTS = json.loads(
  json.dumps({f"model.{f.name}": f.default for f in dataclasses.fields(ModelConfig)})
)
# Fields outside the model added later: BeNice! recipe fields at the values that leave the
# objective unchanged, data fields at the values that leave the data unchanged.
_ADDED_RECIPE_AND_DATA_DEFAULTS = {
  "benice.distill_weight": 0.0,
  "benice.shared_ramp_steps": 0,
  "benice.kv_passes_ramp_steps": 0,
  "benice.prefill_block": 0,
  "data.tokenizer_json": "",
  "data.document_mask": False,
}
_ADDED_FIELD_DEFAULTS = {**_MODEL_FIELD_DEFAULTS, **_ADDED_RECIPE_AND_DATA_DEFAULTS}


def _upgrade_old_record(record: dict, current: dict) -> dict:
  """A recorded stage config (without its parent) in today's layout, to compare with `current`
  (today's fingerprint of the same stage). Accepts two older layouts:

  - a record written before a field joined the fields that may change on resume (placement,
    how-to-compute model fields, cadence) still holds it: it is stripped (`_strip`);
  - a record written before a field was added (`_ADDED_FIELD_DEFAULTS`) lacks it: where this
    run sets the field to the default that keeps the old behaviour, it is filled in, so it is no
    difference; set to anything else it stays absent and is reported as such.
  """
  record = _strip(record)
  for name, default in _ADDED_FIELD_DEFAULTS.items():
    section, field = name.split(".", 1)
    old, new = record.get(section), current.get(section)
    if isinstance(old, dict) and isinstance(new, dict) and field not in old:
      if field in new and new[field] == default:
        old[field] = new[field]
  return record


_ABSENT = object()


def _differences(old, new, prefix="") -> list[str]:
  if isinstance(old, dict) and isinstance(new, dict):
    out = []
    for key in sorted(set(old) | set(new)):
      out += _differences(old.get(key, _ABSENT), new.get(key, _ABSENT), f"{prefix}{key}.")
    return out
  if old == new:
    return []
  show = lambda v: "(absent)" if v is _ABSENT else repr(v)
  return [f"{prefix[:-1]}: {show(old)} -> {show(new)}"]


def fingerprint_hash(stage_cfg) -> str:
  """Short hash of a stage's effective config (cadence fields excluded)."""
  return _digest(_fingerprint(stage_cfg))


def pretrain_parent(config, pretrain_dir: str) -> dict:
  """What a post-training stage starts from: the pretraining stage, its final step and config.

  A reused pretraining run (pipeline.pretrain_workdir) is described by its own recorded config
  and latest checkpoint; this run's pretraining by its config and train.num_steps.
  """
  recorded = _recorded(pretrain_dir) if config.pipeline.pretrain_workdir else None
  if recorded is not None:
    digest = _digest(_strip(recorded))
    step = latest_step(pretrain_dir)
  else:
    digest = fingerprint_hash(stage_config(config, PRETRAIN))
    step = config.train.num_steps
  return {
    "stage": PRETRAIN,
    "workdir": os.path.abspath(pretrain_dir),
    "step": step,
    "fingerprint": digest,
  }


def recorded_parent(stage_dir: str) -> dict | None:
  path = os.path.join(stage_dir, "stage_config.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f).get("parent")


def check_parent(stage: str, stage_dir: str, parent: dict) -> None:
  """Refuses a stage directory trained from another parent than the one this run would use."""
  old = recorded_parent(stage_dir)
  if old is None or old == parent:
    return
  same_but_digest = all(old.get(k) == v for k, v in parent.items() if k != "fingerprint")
  if same_but_digest and old.get("fingerprint") in _recorded_digests(parent["workdir"]):
    return  # Recorded before the stripped fields grew: the same parent.
  what = lambda p: f"{p['stage']} step {p['step']} (config {p['fingerprint']}, {p['workdir']})"
  raise cc.ConfigError(
    f"{stage_dir} ({stage}) was trained from {what(old)}, but this run's parent is "
    f"{what(parent)}; a report would mix models. Move {stage_dir} (and its eval/ entry) aside "
    "to retrain it from the new parent, or use a new --workdir."
  )


def begin(stage_dir: str, stage_cfg, parent: dict | None = None) -> None:
  """Records the stage's config and parent, or checks them against those it was started with."""
  path = os.path.join(stage_dir, "stage_config.json")
  current = _fingerprint(stage_cfg)
  if os.path.exists(path):
    with open(path) as f:
      recorded = json.load(f)
    old_parent = recorded.pop("parent", None)
    if parent is not None and old_parent is not None:
      check_parent(os.path.basename(stage_dir), stage_dir, parent)
    changed = _differences(_upgrade_old_record(recorded, current), current)
    if changed:
      raise cc.ConfigError(
        f"{stage_dir} was started with a different config ({'; '.join(changed)}). "
        "Use a new --workdir for a different configuration."
      )
    return
  os.makedirs(stage_dir, exist_ok=True)
  if parent is not None:
    current["parent"] = parent
  with open(path, "w") as f:
    json.dump(current, f, indent=1)


def done_step(stage_dir: str) -> int | None:
  """The step a finished stage reached (None: never finished)."""
  path = os.path.join(stage_dir, "done.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)["step"]


def mark_done(
  stage_dir: str, step: int, wall_s: float, timing: dict | None = None, steps_trained: int = 0
) -> None:
  """Writes the done-marker: the step reached, and the wall seconds of the run that finished
  it (split by part, looped.benice.timing) with the steps that run trained."""
  done = {"step": int(step), "wall_s": wall_s, "steps_trained": int(steps_trained)}
  if timing:
    done["timing"] = timing
  tmp = os.path.join(stage_dir, "done.json.tmp")
  with open(tmp, "w") as f:
    json.dump(done, f)
  os.replace(tmp, os.path.join(stage_dir, "done.json"))
