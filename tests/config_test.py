"""Every bad config value fails before compute, with a message naming the field."""

import os
import subprocess
import sys
import tempfile

from absl.testing import absltest, parameterized

import looped_testing as testing
from configs import pretrain
from looped import cli, config_checks, programs
from looped.train import trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_VALUES = [
  ("model.num_kv_heads", 3, "multiple of model.num_kv_heads = 3"),
  ("model.num_kv_heads", 0, ">= 1"),
  ("model.head_dim", 31, "even"),
  ("model.d_model", -8, ">= 1"),
  ("model.mlp_type", "gelu", "'swiglu', 'relu2'"),
  ("model.injection", "gated", "'diagonal', 'linear', 'additive'"),
  ("model.state_init", "ones", "'like_init', 'zeros', 'embed'"),
  ("model.num_core_layers", 0, ">= 1"),
  ("model.num_recurrences", 0, ">= 1"),
  ("model.dtype", "float16", "'float32', 'bfloat16'"),
  ("model.attention_impl", "triton", "'xla', 'pallas'"),
  ("model.rope_base", 0.0, "> 1.0"),
  ("model.tie_embeddings", "yes", "True or False"),
  ("model.vocab_size", 100, "vocab"),
  ("data.seq_len", 4096, "max_seq_len"),
  ("data.tokenizer", "wordpiece", "'bytes'"),
  ("data.source", "s3", "'stdlib'"),
  ("data.batch_size", 0, "batch_size"),
  ("data.text_glob", "/nonexistent/*.txt", "/nonexistent/*.txt"),
  ("depth.sampler", "geometric", "'poisson', 'bernoulli', 'fixed'"),
  ("depth.poisson_mean", 0.0, "> 0.0"),
  ("depth.survival", 1.5, "<= 1.0"),
  ("depth.backprop_recurrences", 9, "<= 4"),
  ("train.num_steps", 0, ">= 1"),
  ("train.learning_rate", -1e-3, "> 0.0"),
  ("train.min_lr_ratio", 2.0, "<= 1.0"),
  ("train.log_every", 0, ">= 1"),
  ("train.b2", 1.5, "<= 1.0"),
  ("train.init_from", "/nonexistent/run", "existing checkpoint"),
  ("seed", -1, ">= 0"),
  ("program", "serve", "'train'"),
]


class ConfigValidationTest(parameterized.TestCase):
  def test_default_and_variants_are_valid(self):
    for arg in ("", "smoke", "fixed", "smoke,fixed"):
      trainer.validate(pretrain.get_config(arg))

  def test_unknown_config_arg(self):
    with self.assertRaisesRegex(ValueError, "unknown config variant"):
      pretrain.get_config("smok")

  @parameterized.parameters(*BAD_VALUES)
  def test_bad_value_names_field(self, field, value, expected):
    config = pretrain.get_config("smoke")
    if field == "data.text_glob":
      testing.set_field(config, "data.source", "text")
    testing.set_field(config, field, value)
    with self.assertRaises(config_checks.ConfigError) as ctx:
      programs.load(config).validate(config)
    message = str(ctx.exception)
    self.assertIn(field.split(".")[-1], message)
    self.assertIn(expected, message)

  def test_unknown_model_field(self):
    config = pretrain.get_config("smoke")
    config.model.num_loops = 3
    with self.assertRaisesRegex(config_checks.ConfigError, "num_loops"):
      trainer.validate(config)

  def _cli(self, *args):
    return subprocess.run(
      [sys.executable, "-m", "looped.main", *args], capture_output=True, text=True, cwd=REPO
    )

  def test_cli_misspelled_field_is_one_line_with_suggestion(self):
    proc = self._cli(
      "--config=configs/pretrain.py:smoke", "--workdir=/tmp/x_never", "--config.train.num_step=5"
    )
    self.assertEqual(proc.returncode, 2)
    self.assertEqual(
      proc.stderr.strip(),
      "error: --config.train.num_step=5: the config has no field 'num_step' "
      "(did you mean 'num_steps'?).",
    )

  def test_cli_bad_variant_and_missing_file_are_one_line(self):
    for args, expected in (
      (["--config=configs/pretrain.py:smok"], "unknown config variant(s) ['smok']"),
      (["--config=configs/nope.py"], "No such file"),
      (["--config=configs/pretrain.py", "--config.train.num_steps=abc"], "num_steps=abc"),
    ):
      with self.subTest(args=args):
        proc = self._cli(*args, "--workdir=/tmp/x_never")
        self.assertEqual(proc.returncode, 2)
        self.assertLen(proc.stderr.strip().splitlines(), 1, proc.stderr)
        self.assertIn(expected, proc.stderr)

  def test_cli_without_flags_lists_configs_and_variants(self):
    proc = self._cli()
    self.assertEqual(proc.returncode, 2)
    for text in (
      "configs/pretrain.py",
      "configs/benice.py",
      "configs/serve_sim.py",
      ":smoke",
      ":fixed",
      ":zero_shot",
      "e.g. python -m looped.main --config=configs/benice.py",
    ):
      self.assertIn(text, proc.stderr)
    helped = self._cli("--help")
    self.assertIn("configs/benice.py", helped.stdout + helped.stderr)

  def test_cli_help_with_a_config_lists_its_fields_defaults_and_comments(self):
    proc = self._cli("--config=configs/pretrain.py:smoke", "--help")
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertIn("configs/pretrain.py:smoke: Stage 1", proc.stdout)
    # The smoke variant's value, with the comment of the field in configs/pretrain.py.
    self.assertRegex(proc.stdout, r"config\.data\.max_documents = 200  # \S")
    self.assertIn("config.train.num_steps = 60", proc.stdout)
    self.assertIn(":fixed", proc.stdout)
    colab = self._cli("--config=configs/colab.py:small", "--help")  # Defines a dataclass.
    self.assertEqual(colab.returncode, 0, colab.stderr)
    self.assertIn("config.program = 'benice'", colab.stdout)
    missing = self._cli("--config=configs/nope.py", "--help")
    self.assertEqual(missing.returncode, 2)
    self.assertEqual(missing.stderr.strip(), "error: --config: No such file: configs/nope.py")

  def test_config_errors_are_structured(self):
    _, config = cli.load_config("configs/pretrain.py:smoke")
    with self.assertRaises(config_checks.ConfigError) as e:
      cli.check_overrides(config, ["--config.train.num_step=5"])
    self.assertEqual(e.exception.field, "config.train.num_step")
    self.assertEqual(e.exception.suggestion, "num_steps")
    with self.assertRaises(config_checks.ConfigError) as e:
      cli.check_overrides(config, ["--config.train.num_steps=abc"])
    self.assertEqual((e.exception.value, e.exception.requirement), ("abc", "must be an integer"))
    cli.check_overrides(config, ["--config.train.num_steps=7", "--config.model.qk_norm=False"])
    config.depth.sampler = "uniform"
    with self.assertRaises(config_checks.ConfigError) as e:
      trainer.validate(config)
    self.assertEqual((e.exception.field, e.exception.value), ("config.depth.sampler", "uniform"))

  def test_cli_indivisible_batch_on_two_devices_fails_before_anything_is_created(self):
    workdir = os.path.join(self.enterContext(tempfile.TemporaryDirectory()), "run")
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "looped.main",
        "--config=configs/pretrain.py:smoke",
        f"--workdir={workdir}",
        "--config.data.batch_size=3",
        "--config.data.eval_batch_size=4",
      ],
      capture_output=True,
      text=True,
      cwd=REPO,
      env=env,
    )
    self.assertEqual(proc.returncode, 2, proc.stderr)
    self.assertIn(
      "config.data.batch_size = 3 is invalid: must be a multiple of jax.device_count() = 2",
      proc.stderr,
    )
    self.assertFalse(os.path.exists(workdir))

  def test_cli_bad_value_fails_before_compute(self):
    proc = subprocess.run(
      [
        sys.executable,
        "-m",
        "looped.main",
        f"--config={os.path.join(REPO, 'configs', 'pretrain.py')}:smoke",
        "--workdir=/tmp/never_created_by_config_test",
        "--config.depth.sampler=uniform",
      ],
      capture_output=True,
      text=True,
      cwd=REPO,
    )
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn("config.depth.sampler = 'uniform' is invalid", proc.stderr)
    self.assertLen(proc.stderr.strip().splitlines(), 1, proc.stderr)  # No config, no traceback.
    self.assertFalse(os.path.exists("/tmp/never_created_by_config_test"))


if __name__ == "__main__":
  absltest.main()
