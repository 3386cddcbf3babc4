"""The BeNice! program: config validation, the smoke pipeline end to end, rerun and reuse."""

import contextlib
import copy
import hashlib
import io
import json
import math
import os
import shutil
from unittest import mock

import jax
from absl.testing import absltest, parameterized

import looped_testing as testing
from configs import benice as benice_config
from looped import config_checks, programs
from looped.benice import collect, evaluation, pipeline, stages, timing
from looped.train import trainer

BAD_VALUES = [
  ("post.train.learning_rate", 0.0, "config.post.train.learning_rate = 0.0"),
  ("post.depth.sampler", "uniform", "config.post.depth.sampler = 'uniform'"),
  ("train.num_steps", 0, "config.train.num_steps = 0"),
  ("benice.read_recurrences", "last", "'all', 'first', 'none'"),
  ("benice.kl_weight", -1.0, ">= 0.0"),
  ("benice.kl_pass", "teacher", "'shared', 'unshared', 'both'"),
  ("benice.kv_passes", -1, ">= 0"),
  ("eval.jacobi_passes", (0, 4), "tuple of integers >= 1"),
  ("eval.prefill_blocks", (16, 0), "tuple of integers >= 1 (may be empty)"),
  ("eval.kv_policy", "last", "config.eval.kv_policy = 'last' is invalid"),
  ("eval.kv_policies", ("first", "stride0"), "config.eval.kv_policies = 'stride0' is invalid"),
  ("eval.decode_batches", 3, "<= 2"),
  ("eval.samples", -1, ">= 0"),
  ("eval.sample_new_tokens", 10_000, "must fit model.max_seq_len"),
  ("pipeline.pretrain_workdir", "/nonexistent/run", "pretrain run directory"),
  ("program", "train", "'benice'"),
]


class ConfigTest(parameterized.TestCase):
  def test_variants_are_valid(self):
    for arg in ("", "smoke", "fixed", "smoke,fixed"):
      config = benice_config.get_config(arg)
      self.assertIs(programs.load(config), pipeline)
      pipeline.validate(config)
    self.assertEqual(benice_config.get_config("fixed").depth.sampler, "fixed")
    self.assertEqual(benice_config.get_config("").depth.sampler, "poisson")

  def test_eval_key_names_kv_policies_only_when_set(self):
    # Evaluations cached before the policy fields existed keep matching at their defaults.
    config = benice_config.get_config("smoke")
    key = pipeline._eval_key(config.eval)
    self.assertNotIn("kv_policy", key)
    self.assertNotIn("kv_policies", key)
    config.eval.kv_policies = ("first",)
    config.eval.kv_policy = "stride2"
    key = pipeline._eval_key(config.eval)
    self.assertEqual((key["kv_policy"], tuple(key["kv_policies"])), ("stride2", ("first",)))

  def test_unknown_arg(self):
    with self.assertRaisesRegex(ValueError, "unknown config variant"):
      benice_config.get_config("smoke,fast")

  @parameterized.parameters(*BAD_VALUES)
  def test_bad_value_names_field(self, field, value, expected):
    config = benice_config.get_config("smoke")
    testing.set_field(config, field, value)
    with self.assertRaises(config_checks.ConfigError) as ctx:
      pipeline.validate(config)
    self.assertIn(expected, str(ctx.exception))

  def test_sample_lengths_only_bind_when_there_are_samples(self):
    config = benice_config.get_config("smoke")
    config.eval.sample_new_tokens = 10_000  # Longer than the model's context.
    with self.assertRaisesRegex(config_checks.ConfigError, "must fit model.max_seq_len"):
      pipeline.validate(config)
    config.eval.samples = 0  # E.g. a converted model of short context, evaluated without them.
    pipeline.validate(config)

  def test_unknown_post_train_field(self):
    config = benice_config.get_config("smoke")
    config.post.train.lr = 1e-3
    with self.assertRaisesRegex(config_checks.ConfigError, r"config.post.train .*\['lr'\]"):
      pipeline.validate(config)


class StageConfigTest(testing.TempDirTestCase):
  """A stage refuses a changed config, but not a model field added to looped since it started."""

  def _recorded_without(self, stage_dir, field):
    stage_cfg = stages.stage_config(benice_config.get_config("smoke"), stages.PRETRAIN)
    stages.begin(stage_dir, stage_cfg)
    path = os.path.join(stage_dir, "stage_config.json")
    with open(path) as f:
      recorded = json.load(f)
    del recorded["model"][field]
    with open(path, "w") as f:
      json.dump(recorded, f)
    return stage_cfg

  def test_added_model_field_at_default_matches(self):
    stage_dir = os.path.join(self.tmp, "pretrain")
    stage_cfg = self._recorded_without(stage_dir, "qk_bias")
    stages.begin(stage_dir, stage_cfg)  # Default False: the behaviour the run was trained with.
    stage_cfg.model.qk_bias = True
    with self.assertRaisesRegex(config_checks.ConfigError, r"qk_bias: \(absent\) -> True"):
      stages.begin(stage_dir, stage_cfg)

  def test_how_to_compute_may_change(self):
    # Scan or loop, unroll, remat and the attention kernel compute the same math: a stage
    # resumes under other values (e.g. after a default changed).
    stage_dir = os.path.join(self.tmp, "pretrain")
    stage_cfg = stages.stage_config(benice_config.get_config("smoke"), stages.PRETRAIN)
    stages.begin(stage_dir, stage_cfg)
    m = stage_cfg.model
    m.scan_unroll, m.scan_recurrences, m.remat, m.attention_impl = 3, False, "full", "pallas"
    stages.begin(stage_dir, stage_cfg)

  def test_stage_recorded_with_how_to_compute_fields_resumes(self):
    # Records written before those fields were ignored hold them (e.g. the old scan_unroll 1).
    stage_dir = os.path.join(self.tmp, "pretrain")
    stage_cfg = stages.stage_config(benice_config.get_config("smoke"), stages.PRETRAIN)
    stages.begin(stage_dir, stage_cfg)
    path = os.path.join(stage_dir, "stage_config.json")
    with open(path) as f:
      recorded = json.load(f)
    recorded["model"].update(scan_unroll=1, remat="none", attention_impl="xla")
    with open(path, "w") as f:
      json.dump(recorded, f)
    stages.begin(stage_dir, stage_cfg)
    stage_cfg.model.qk_norm = not stage_cfg.model.qk_norm  # What is computed still counts.
    with self.assertRaisesRegex(config_checks.ConfigError, r"model.qk_norm: True -> False"):
      stages.begin(stage_dir, stage_cfg)

  def test_observation_fields_may_change_or_be_absent(self):
    # Profiling, the MFU peak and the dry run change what a run reports, not what it trains:
    # a stage recorded before they existed, or under other values, resumes.
    stage_dir = os.path.join(self.tmp, "pretrain")
    stage_cfg = stages.stage_config(benice_config.get_config("smoke"), stages.PRETRAIN)
    stages.begin(stage_dir, stage_cfg)
    path = os.path.join(stage_dir, "stage_config.json")
    with open(path) as f:
      recorded = json.load(f)
    for name in ("peak_tflops", "profile_steps", "profile_skip_steps", "dry_run"):
      recorded["train"].pop(name, None)
    with open(path, "w") as f:
      json.dump(recorded, f)
    stage_cfg.train.profile_steps, stage_cfg.train.peak_tflops = 2, 100.0
    stages.begin(stage_dir, stage_cfg)
    stage_cfg.train.weight_decay = 0.5  # What is trained still counts.
    with self.assertRaisesRegex(config_checks.ConfigError, r"train.weight_decay"):
      stages.begin(stage_dir, stage_cfg)

  def _child_of_an_older_parent_record(self, edit):
    """A pretraining record changed by `edit` (as an older version wrote it) and a finetuning
    child that recorded the digest over that record: (config, pretrain dir, parent as today's
    run computes it, child dir, child record, the old digest)."""
    config = benice_config.get_config("smoke")
    pretrain_dir = os.path.join(self.tmp, "pretrain")
    stages.begin(pretrain_dir, stages.stage_config(config, stages.PRETRAIN))
    path = os.path.join(pretrain_dir, "stage_config.json")
    with open(path) as f:
      recorded = json.load(f)
    edit(recorded)
    with open(path, "w") as f:
      json.dump(recorded, f)
    parent = stages.pretrain_parent(config, pretrain_dir)
    old_digest = hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()[:16]
    self.assertNotEqual(old_digest, parent["fingerprint"])
    finetune_dir = os.path.join(self.tmp, "finetune")
    stages.begin(finetune_dir, stages.stage_config(config, stages.FINETUNE), parent)
    child = os.path.join(finetune_dir, "stage_config.json")
    with open(child) as f:
      record = json.load(f)
    record["parent"]["fingerprint"] = old_digest
    with open(child, "w") as f:
      json.dump(record, f)
    return config, pretrain_dir, parent, finetune_dir, record, old_digest

  def test_parent_digest_recorded_with_observation_fields_is_the_same_parent(self):
    # A pretraining record written while those fields still counted holds them.
    observed = dict(profile_steps=0, profile_skip_steps=1, peak_tflops=0.0, dry_run=False)
    config, pretrain_dir, parent, finetune_dir, _, _ = self._child_of_an_older_parent_record(
      lambda r: r["train"].update(observed)
    )
    stages.check_parent(stages.FINETUNE, finetune_dir, parent)
    stages.begin(pretrain_dir, stages.stage_config(config, stages.PRETRAIN))  # It resumes.

  def test_parent_recorded_under_an_older_digest_is_the_same_parent(self):
    # A post-training stage recorded its parent's digest over the pretraining's record as then
    # written (with scan_unroll); today's digest strips it. Both name the same parent.
    _, _, parent, finetune_dir, record, old_digest = self._child_of_an_older_parent_record(
      lambda r: r["model"].update(scan_unroll=1)
    )
    child = os.path.join(finetune_dir, "stage_config.json")
    stages.check_parent(stages.FINETUNE, finetune_dir, parent)
    # Another digest, or another step, is another parent.
    record["parent"]["fingerprint"] = "0" * 16
    with open(child, "w") as f:
      json.dump(record, f)
    with self.assertRaisesRegex(config_checks.ConfigError, "was trained from"):
      stages.check_parent(stages.FINETUNE, finetune_dir, parent)
    record["parent"].update(fingerprint=old_digest, step=parent["step"] + 1)
    with open(child, "w") as f:
      json.dump(record, f)
    with self.assertRaisesRegex(config_checks.ConfigError, "was trained from"):
      stages.check_parent(stages.FINETUNE, finetune_dir, parent)

  def test_changed_field_is_refused(self):
    stage_dir = os.path.join(self.tmp, "pretrain")
    stage_cfg = self._recorded_without(stage_dir, "qk_bias")
    stage_cfg.model.qk_norm = not stage_cfg.model.qk_norm
    with self.assertRaisesRegex(config_checks.ConfigError, r"model.qk_norm: True -> False"):
      stages.begin(stage_dir, stage_cfg)
    stage_cfg.model.qk_norm = True
    stage_cfg.train.learning_rate *= 2
    with self.assertRaisesRegex(config_checks.ConfigError, r"train.learning_rate"):
      stages.begin(stage_dir, stage_cfg)


class PipelineTest(testing.TempDirTestCase):
  def _run(self, config, workdir):
    pipeline.validate(config)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
      report = pipeline.run(config, workdir)
    return report, stdout.getvalue()

  def test_smoke_pipeline_rerun_and_reuse(self):
    config = benice_config.get_config("smoke")
    # Every loss term on, so the frozen params and the collected states go through the trainer.
    config.benice.kl_weight = 0.5
    config.benice.kl_pass = "both"
    config.benice.residual_weight = 0.5
    workdir = os.path.join(self.tmp, "run")
    with self.assertLogs(level="INFO") as logs:
      report, printed = self._run(config, workdir)
    # BeNice!'s progress lines name the terms of its summed loss.
    self.assertTrue(
      any("weighted sum of ce_shared" in m and "residual_match" in m for m in logs.output)
    )

    models = report["models"]
    self.assertEqual(list(models), ["zero_shot", "finetune", "benice"])
    r = config.model.num_recurrences
    for m in models.values():
      for key in ("ppl_unshared_eval", "ppl_unshared_subset", "ppl_shared_exact_subset"):
        self.assertTrue(1.0 < m[key] < config.model.vocab_size, m[key])
      self.assertTrue(math.isfinite(m["gap_exact"]))
      lo, hi = m["gap_exact_ci95"]
      self.assertTrue(lo <= m["gap_exact"] <= hi)
      self.assertEqual(list(m["ppl_shared_jacobi_eval"]), ["1", "2"])
      self.assertEqual(list(m["gap_jacobi_eval_ci95"]), ["1", "2"])
      self.assertEqual(list(m["gap_block"]), ["16"])
      lo, hi = m["gap_block_ci95"]["16"]
      self.assertTrue(lo <= m["gap_block"]["16"] <= hi)
      self.assertLen(m["residual_norms"], r)
      self.assertEqual(set(m["kv_bytes_per_token"]), {"shared", "unshared"})
      self.assertEqual(list(m["kv_formats"]), list(config.eval.kv_formats))
      nvfp4 = m["kv_formats"]["nvfp4"]
      self.assertLess(nvfp4["kv_bytes_per_token"]["shared"], m["kv_bytes_per_token"]["shared"])
      # Greedy samples (tests/benice_samples_test.py checks their tokens), both layouts.
      self.assertLen(m["samples"], config.eval.samples)
      for row in m["samples"]:
        self.assertLen(row["unshared_tokens"], config.eval.sample_new_tokens)
        self.assertLen(row["shared_tokens"], config.eval.sample_new_tokens)
    self.assertIn("Greedy samples (generation engine), unshared vs shared cache:", printed)
    self.assertEqual(report["settings"]["versions"]["jax"], jax.__version__)
    # Both post-training arms ran the configured steps from the pretrained checkpoint.
    self.assertEqual(
      {s: v["step"] for s, v in report["stages"].items()},
      {
        "pretrain": config.train.num_steps,
        "finetune": config.post.train.num_steps,
        "benice": config.post.train.num_steps,
      },
    )
    with open(os.path.join(workdir, "benice", "metrics.jsonl")) as f:
      record = json.loads(f.readline())
    for name in ("ce_shared", "ce_unshared", "kl_shared", "kl_unshared", "residual_match"):
      self.assertIn(name, record)
    report_dir = os.path.join(workdir, "report")
    with open(os.path.join(report_dir, "shareability.json")) as f:
      self.assertEqual(json.load(f)["models"], models)
    for name in ("residual_norms.png", "perplexity.png", "training_curves.png"):
      self.assertGreater(os.path.getsize(os.path.join(report_dir, name)), 1000)
    self.assertIn("| benice |", printed)
    self.assertIn("| benice | nvfp4 |", printed)
    self.assertIn("gap exact [95% CI]", printed)
    self.assertIn("| gap block C=16 [95% CI] |", printed)
    # Post-training stages record the pretraining they started from.
    self.assertEqual(report["stages"]["finetune"]["parent"]["step"], config.train.num_steps)
    # The stage table: every stage's wall time, split into parts that add up to it.
    with open(os.path.join(workdir, "timing.json")) as f:
      times = json.load(f)
    rows = {row["stage"]: row for row in times["stages"]}
    self.assertEqual(
      list(rows),
      ["pretrain", "finetune", "benice", "eval zero_shot", "eval finetune", "eval benice"],
    )
    for stage, steps in (("pretrain", 20), ("finetune", 6), ("benice", 6)):
      row = rows[stage]
      self.assertEqual((row["status"], row["steps_trained"]), ("trained", steps))
      self.assertEqual(set(row["parts"]), set(timing.TRAIN_PARTS))
      self.assertAlmostEqual(sum(row["parts"].values()), row["wall_s"], places=3)
      self.assertGreater(row["parts"]["compile"], 0.0)
      self.assertGreater(row["parts"]["steps"], 0.0)
    for name in models:
      row = rows[f"eval {name}"]
      self.assertEqual((row["status"], set(row["parts"])), ("evaluated", set(timing.EVAL_PARTS)))
      self.assertTrue(all(v > 0 for v in row["parts"].values()), row)
    self.assertGreaterEqual(times["invocation_wall_s"], sum(r["wall_s"] for r in rows.values()))
    self.assertIn("| benice | trained |", printed)

    # Rerun: no training, no evaluation; the same report is printed again.
    no_train = mock.patch.object(trainer, "train", side_effect=AssertionError("trained"))
    no_eval = mock.patch.object(evaluation, "evaluate", side_effect=AssertionError("evaluated"))
    with no_train, no_eval:
      again, printed_again = self._run(config, workdir)
    self.assertEqual(again["models"], models)
    table_start = "| stage | this run |"
    self.assertEqual(printed_again.split(table_start)[0], printed.split(table_start)[0])
    # The stage table keeps the seconds of the run that did the work.
    with open(os.path.join(workdir, "timing.json")) as f:
      rows_again = {row["stage"]: row for row in json.load(f)["stages"]}
    self.assertEqual([r["status"] for r in rows_again.values()], ["skipped"] * 3 + ["cached"] * 3)
    self.assertEqual(
      {k: r["wall_s"] for k, r in rows_again.items()}, {k: r["wall_s"] for k, r in rows.items()}
    )
    # An evaluation cached before eval.prefill_blocks existed (no block gaps) is recomputed,
    # not reported without them.
    cached_path = os.path.join(workdir, "eval", "benice.json")
    with open(cached_path) as f:
      cached = json.load(f)
    old = copy.deepcopy(cached)
    del old["key"]["eval"]["prefill_blocks"]
    for key in ("ppl_shared_block_subset", "gap_block", "gap_block_ci95"):
      del old["metrics"][key]
    with open(cached_path, "w") as f:
      json.dump(old, f)
    with no_train, no_eval, self.assertRaisesRegex(AssertionError, "evaluated"):
      self._run(config, workdir)
    with open(cached_path, "w") as f:
      json.dump(cached, f)

    # More pretraining in the same workdir would pair a new zero-shot model with post-training
    # from the old checkpoint: refused before anything trains.
    config.train.num_steps += 10
    with (
      no_train,
      self.assertRaisesRegex(
        config_checks.ConfigError, r"trained from pretrain step 20 .* parent is pretrain step 30"
      ),
    ):
      self._run(config, workdir)
    config.train.num_steps -= 10

    # A changed BeNice! setting in the same workdir is refused, naming the field.
    config.benice.read_recurrences = "first"
    with self.assertRaisesRegex(config_checks.ConfigError, "read_recurrences: 'all' -> 'first'"):
      self._run(config, workdir)

    # Ablation layout: pretraining and the finetune baseline reused read-only from the first
    # run (the BeNice! stage is copied here so that nothing trains in this test).
    ablation = os.path.join(self.tmp, "ablation")
    shutil.copytree(os.path.join(workdir, "benice"), os.path.join(ablation, "benice"))
    config.benice.read_recurrences = "all"
    config.pipeline.pretrain_workdir = os.path.join(workdir, "pretrain")
    config.pipeline.finetune_workdir = os.path.join(workdir, "finetune")
    with no_train:
      reused, _ = self._run(config, ablation)
    self.assertEqual(reused["stages"]["pretrain"]["workdir"], config.pipeline.pretrain_workdir)
    self.assertEqual(sorted(os.listdir(ablation)), ["benice", "eval", "report", "timing.json"])
    for name, m in models.items():
      self.assertAlmostEqual(
        reused["models"][name]["ppl_shared_exact_subset"], m["ppl_shared_exact_subset"], places=4
      )

    # Runs named <group>_s<seed> are averaged per group across seeds.
    shutil.copytree(ablation, os.path.join(self.tmp, "ablation_s1"))
    os.rename(ablation, os.path.join(self.tmp, "ablation_s0"))
    text = collect.table([workdir] + [os.path.join(self.tmp, f"ablation_s{i}") for i in (0, 1)])
    self.assertIn(f"| ablation_s1 | benice | {models['benice']['ppl_unshared_eval']:.3f} |", text)
    self.assertIn("| ablation | benice | 2 |", text)
    self.assertIn("| run | zero_shot | 1 |", text)


if __name__ == "__main__":
  absltest.main()
