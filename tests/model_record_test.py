"""A checkpoint carries its model: model_config.json beside a trainer workdir's checkpoints is
what generation reads, a disagreeing command-line override fails in one line, a workdir without
the file works as before, and a checkpoint of another model is a mismatch, never corruption."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from configs import generate as generate_config
from looped import config_checks, programs
from looped.checkpoints import checkpointing, model_record
from looped.engine import generate
from looped.model import LoopedLM, from_config, init_params
from looped.train import trainer

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TRAIN = {
  "train.num_steps": 2,
  "train.checkpoint_every": 2,
  "train.log_every": 2,
  "train.eval_every": 2,
  "train.warmup_steps": 1,
}


def _new_user_gen_config(checkpoint: str, **fields):
  """configs/generate.py without :smoke (the default model, not the one trained)."""
  config = generate_config.get_config()
  config.gen.checkpoint = checkpoint
  config.gen.prompts = "def"
  config.gen.max_new_tokens = 4
  config.gen.share_kv = False  # Greedy tokens then equal the parallel forward's.
  config.gen.stop_at_eos = False
  for key, value in fields.items():
    testing.set_field(config, key, value)
  return config


class ModelRecordTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.train_dir = os.path.join(cls._tmp.name, "smoke")
    cls.train_config = testing.smoke_config(_TRAIN)
    trainer.run(cls.train_config, cls.train_dir)

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp(dir=self._tmp.name)

  def _old_workdir(self) -> str:
    """A copy of the trained workdir as written before records existed."""
    old = os.path.join(self.tmp, "old")
    shutil.copytree(self.train_dir, old)
    os.remove(os.path.join(old, model_record.FILENAME))
    return old

  def test_trainer_records_the_model_before_its_checkpoints(self):
    with open(os.path.join(self.train_dir, model_record.FILENAME)) as f:
      record = json.load(f)
    self.assertEqual(record["model"]["d_model"], 64)
    self.assertEqual(record["model"]["max_seq_len"], 32)
    self.assertEqual(record["model"]["core_mixers"], ["gqa"])
    self.assertEqual(record["data"]["tokenizer"], "bytes")
    self.assertEqual(os.listdir(checkpointing.checkpoint_dir(self.train_dir)), ["2"])

  def test_generate_without_smoke_uses_the_recorded_model(self):
    # The new user's command: the smoke workdir, configs/generate.py without ':smoke'.
    config = _new_user_gen_config(self.train_dir)
    self.assertEqual(config.model.d_model, 128)  # What the config alone would build.
    model_cfg, _ = generate.model_and_data(config)
    self.assertEqual(model_cfg.d_model, 64)
    self.assertEqual(model_cfg.max_seq_len, 32)
    workdir = os.path.join(self.tmp, "gen")
    result = programs.run(config, workdir)
    self.assertLen(result["generations"][0].tokens, 4)
    # The tokens are those of the recorded model decoding the restored params.
    model = LoopedLM(from_config(self.train_config.model))
    params = testing.saved_params(self.train_config.model, self.train_dir)
    generated = result["generations"][0].tokens
    tokens = jnp.asarray([[100, 101, 102] + list(generated)])  # 'def' + the output.
    logits, _ = jax.jit(model.apply)(params, tokens)  # Causal: each position's greedy token.
    self.assertEqual(generated, [int(t) for t in jnp.argmax(logits[0, 2:-1], axis=-1)])

  def test_generate_runs_the_recorded_model_at_a_chosen_loop_count(self):
    # --config.model.num_recurrences=2 on the smoke workdir (recorded R = 4): the recorded model
    # at R = 2; the same field set without being an override is the record's (R = 4).
    config = _new_user_gen_config(self.train_dir, **{"model.num_recurrences": 2})
    self.assertEqual(generate.model_and_data(config)[0].num_recurrences, 4)
    with self.assertLogs(level="INFO") as logs:
      result = programs.run(config, os.path.join(self.tmp, "gen2"), ("model.num_recurrences",))
    # The log shows the model that runs (recorded, at the chosen R), not the config's section.
    (shown,) = [r.getMessage() for r in logs.records if r.getMessage().startswith("Model (")]
    self.assertIn(os.path.join(self.train_dir, model_record.FILENAME), shown)
    self.assertRegex(shown, r"\nd_model: 64\n")
    self.assertRegex(shown, r"\nnum_recurrences: 2\n")
    generated = result["generations"][0].tokens
    tokens = jnp.asarray([[100, 101, 102] + list(generated)])  # 'def' + the output.
    params = testing.saved_params(self.train_config.model, self.train_dir)
    logits = {}
    for r in (2, 4):
      model_cfg = ml_collections.ConfigDict(self.train_config.model.to_dict())
      model_cfg.num_recurrences = r
      logits[r], _ = jax.jit(LoopedLM(from_config(model_cfg)).apply)(params, tokens)
    self.assertFalse(np.allclose(logits[2], logits[4], atol=1e-3))  # R changes the outputs.
    self.assertEqual(generated, [int(t) for t in jnp.argmax(logits[2][0, 2:-1], axis=-1)])

  def test_old_workdir_without_record_works_as_before(self):
    old = self._old_workdir()
    config = _new_user_gen_config(old)
    self.assertEqual(generate.model_and_data(config)[0].d_model, 128)  # The config's model.
    self.assertIsNone(programs._recorded_model(generate, config, ()))  # Nothing else to log.
    # As before, `:smoke` (with the run's max_seq_len) describes it, and it generates.
    config = generate_config.get_config("smoke")
    config.model.max_seq_len = 32
    config.gen.checkpoint, config.gen.prompts, config.gen.max_new_tokens = old, "def", 4
    config.gen.stop_at_eos = False
    result = programs.run(config, os.path.join(self.tmp, "gen_old"))
    self.assertLen(result["generations"][0].tokens, 4)

  def test_shape_mismatch_is_not_called_corruption(self):
    old = self._old_workdir()
    # Generation: a one-line config error naming the array and both shapes.
    config = _new_user_gen_config(old)
    with self.assertRaises(config_checks.ConfigError) as raised:
      programs.run(config, os.path.join(self.tmp, "gen_bad"))
    message = str(raised.exception)
    self.assertIn("holds a different model", message)
    self.assertRegex(
      message, r"params\[.*\] is shape \(64, .*\) in the checkpoint but shape \(128, .*\) in the"
    )
    self.assertNotIn("corrupt", message.lower())
    # The library: CheckpointMismatchError, not CorruptCheckpointError.
    model = LoopedLM(from_config(config.model))
    abstract = jax.eval_shape(
      lambda: init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )
    with self.assertRaises(checkpointing.CheckpointMismatchError):
      checkpointing.restore_params(old, abstract)
    # Resuming training with another model: refused, and no checkpoint is quarantined.
    bigger = testing.smoke_config({**_TRAIN, "train.num_steps": 4, "model.d_model": 96})
    with self.assertRaisesRegex(config_checks.ConfigError, "does not describe .*different model"):
      trainer.run(bigger, old)
    self.assertFalse(os.path.exists(checkpointing.corrupt_dir(checkpointing.checkpoint_dir(old))))
    self.assertEqual(os.listdir(checkpointing.checkpoint_dir(old)), ["2"])


class RecordedWorkdirTest(testing.TempDirTestCase):
  """What needs only a workdir's record (no training, no compile): the record of the smoke
  model and an empty checkpoint step, as a trainer writes them."""

  def setUp(self):
    super().setUp()
    self.recorded = os.path.join(self.tmp, "smoke")
    config = testing.smoke_config(_TRAIN)
    model_record.write(self.recorded, model_record.make(config.model, config.data))
    os.makedirs(os.path.join(checkpointing.checkpoint_dir(self.recorded), "2"))

  def test_model_and_data_come_from_the_record(self):
    config = _new_user_gen_config(self.recorded)
    model_cfg, data_cfg = generate.model_and_data(config)
    self.assertEqual((model_cfg.d_model, model_cfg.max_seq_len), (64, 32))
    self.assertEqual(data_cfg.tokenizer, "bytes")
    programs.validate(config, os.path.join(self.tmp, "w"))  # The default model's flags: fine.

  def test_disagreeing_override_fails_naming_field_and_values(self):
    config = _new_user_gen_config(self.recorded, **{"model.num_heads": 8})
    with self.assertRaisesRegex(
      config_checks.ConfigError,
      r"^--config.model.num_heads = 8 disagrees with the checkpoint's num_heads = 2 ",
    ):
      programs.validate(config, os.path.join(self.tmp, "w"), overrides=("model.num_heads",))
    # An override that agrees with the record, and one of how to compute, are accepted.
    config = _new_user_gen_config(self.recorded, **{"model.d_model": 64, "model.remat": "full"})
    programs.validate(config, os.path.join(self.tmp, "w"), ("model.d_model", "model.remat"))
    self.assertEqual(generate.model_and_data(config)[0].remat, "full")

  def test_loop_count_is_the_readers_choice_but_not_the_resuming_trainers(self):
    config = _new_user_gen_config(self.recorded, **{"model.num_recurrences": 7})
    programs.validate(config, os.path.join(self.tmp, "w"), ("model.num_recurrences",))
    chosen = model_record.chosen_fields(("model.num_recurrences", "model.remat"))
    self.assertEqual(chosen, ("num_recurrences",))
    model_cfg, _ = generate.model_and_data(config, chosen=chosen)
    self.assertEqual((model_cfg.num_recurrences, model_cfg.d_model), (7, 64))
    self.assertEqual(generate.model_and_data(config)[0].num_recurrences, 4)  # Not chosen.
    # A chosen value is validated like the model's own.
    config = _new_user_gen_config(self.recorded, **{"model.num_recurrences": 0})
    with self.assertRaisesRegex(config_checks.ConfigError, r"^config.model.num_recurrences = 0 "):
      programs.validate(config, os.path.join(self.tmp, "w"), ("model.num_recurrences",))
    # The trainer resuming the workdir refuses another loop count (the record says what was
    # trained).
    config = testing.smoke_config({**_TRAIN, "train.num_steps": 4, "model.num_recurrences": 7})
    with self.assertRaisesRegex(
      config_checks.ConfigError,
      r"^config.model.num_recurrences = 7 disagrees with the model recorded in .*: "
      r"num_recurrences = 4;",
    ):
      trainer.run(config, self.recorded)

  def test_disagreeing_override_on_the_command_line_is_one_line(self):
    command = [
      sys.executable,
      "-m",
      "looped.main",
      "--config=configs/generate.py",
      f"--workdir={os.path.join(self.tmp, 'cli')}",
      f"--config.gen.checkpoint={self.recorded}",
      "--config.gen.prompts=def",
      "--config.model.d_model=96",
    ]
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, timeout=600)
    self.assertEqual(done.returncode, 2, done.stderr)
    lines = done.stderr.strip().splitlines()
    self.assertLen(lines, 1, done.stderr)
    self.assertRegex(
      lines[0], r"^error: --config.model.d_model = 96 disagrees with the checkpoint's d_model = 64"
    )
    self.assertFalse(os.path.exists(os.path.join(self.tmp, "cli")))

  def test_trainer_refuses_a_workdir_recorded_with_another_model(self):
    config = testing.smoke_config({**_TRAIN, "train.num_steps": 4, "model.mlp_dim": 96})
    before = sorted(os.listdir(self.recorded))
    with self.assertRaisesRegex(
      config_checks.ConfigError, r"config.model.mlp_dim = 96 disagrees with .* mlp_dim = 128"
    ):
      trainer.run(config, self.recorded)
    self.assertEqual(sorted(os.listdir(self.recorded)), before)  # Nothing was written.


if __name__ == "__main__":
  absltest.main()
