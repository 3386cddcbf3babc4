"""Program 'generate': config checks before compute, and an end-to-end run on a trained smoke
model (trainer workdir and stage dir): streamed text, generations.jsonl, summary.json, and
greedy tokens equal to decoding the restored params directly."""

import contextlib
import dataclasses
import io
import json
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
from absl.testing import absltest

import looped_testing as testing
from configs import generate as generate_config
from looped import config_checks, programs
from looped.checkpoints import checkpointing, model_record
from looped.data.tokenizers import BytesTokenizer
from looped.engine import generate
from looped.model import config as model_lib
from looped.model import init_params
from looped.model.kv_cache import init_cache
from looped.model.looped_lm import LoopedLM
from looped.train import trainer

_TRAIN = {
  "train.num_steps": 3,
  "train.checkpoint_every": 3,
  "train.log_every": 3,
  "train.eval_every": 3,
  "train.warmup_steps": 1,
}


def _gen_config(checkpoint, **overrides):
  config = generate_config.get_config("smoke")
  config.model.max_seq_len = testing.TINY_RUN_OVERRIDES["model.max_seq_len"]
  config.gen.checkpoint = checkpoint
  config.gen.max_new_tokens = 8
  for key, value in overrides.items():
    testing.set_field(config, key, value)
  return config


def _greedy(model, params, prompt, n, share_kv):
  """Token-by-token greedy decoding of the restored params on the model's own dense cache,
  no engine (reference; shared: exact shared decode)."""
  step = jax.jit(lambda p, token, cache: model.apply(p, token, cache=cache))
  cache = init_cache(model.cfg, 1, len(prompt) + n, share_kv)
  out, token = [], None
  for t in range(len(prompt) + n - 1):
    token = prompt[t] if t < len(prompt) else token
    logits, aux = step(params, jnp.asarray([[token]], jnp.int32), cache)
    cache = aux["cache"]
    if t >= len(prompt) - 1:
      token = int(jnp.argmax(logits[0, 0]))
      out.append(token)
  return out


class RecordedModelTest(testing.TempDirTestCase):
  def test_stage_recorded_before_a_model_field_existed(self):
    # A pipeline stage dir records its model; a field added to looped later is absent there and
    # takes its default (the behaviour the stage was trained with), the others stay as recorded.
    model = dataclasses.asdict(testing.TINY_MODEL)
    model.pop("scan_unroll")
    with open(os.path.join(self.tmp, "stage_config.json"), "w") as f:
      json.dump({"model": model, "data": {"tokenizer": "bytes"}}, f)
    config = generate_config.get_config()
    recorded, data = generate.model_and_data(config, self.tmp)
    self.assertEqual(recorded.scan_unroll, model_lib.ModelConfig().scan_unroll)
    self.assertEqual(recorded.d_model, model["d_model"])
    self.assertEqual(recorded.num_recurrences, model["num_recurrences"])
    model_lib.from_config(recorded)  # Every field known, none missing.
    self.assertEqual(data.tokenizer, "bytes")


class GenerateProgramTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._tmp = tempfile.TemporaryDirectory()
    cls.train_dir = os.path.join(cls._tmp.name, "train")
    config = testing.smoke_config(_TRAIN)
    trainer.run(config, cls.train_dir)
    cls.model = LoopedLM(model_lib.from_config(config.model))
    abstract = jax.eval_shape(
      lambda: init_params(cls.model, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )
    cls.params = checkpointing.restore_params(cls.train_dir, abstract)
    cls.model_config = config.model
    cls.data_config = config.data

  @classmethod
  def tearDownClass(cls):
    cls._tmp.cleanup()
    super().tearDownClass()

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp(dir=self._tmp.name)

  def _fails(self, config, pattern):
    with self.assertRaisesRegex(config_checks.ConfigError, pattern):
      programs.validate(config, os.path.join(self.tmp, "w"))
    self.assertFalse(os.path.exists(os.path.join(self.tmp, "w")))  # Nothing was created.

  def test_bad_configs_fail_naming_the_field(self):
    empty = os.path.join(self.tmp, "empty")
    os.makedirs(empty)
    self._fails(
      _gen_config(os.path.join(self.tmp, "nope"), **{"gen.prompts": "x"}),
      "gen.checkpoint.*existing",
    )
    self._fails(_gen_config(empty, **{"gen.prompts": "x"}), "gen.checkpoint.*no checkpoint")
    self._fails(_gen_config(self.train_dir), "gen.prompts.*no prompt")
    self._fails(_gen_config(self.train_dir, **{"gen.prompts": ("a", "")}), "prompt 1 is empty")
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": "x", "gen.kv_format": "fp4"}), "gen.kv_format"
    )
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": "x", "gen.kv_budget_bytes": 1000.0}),
      "gen.kv_budget_bytes.*needs 1",
    )
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": "x" * 30}), "gen.max_new_tokens.*max_seq_len 32"
    )
    self._fails(_gen_config(self.train_dir, **{"gen.prompts": "x", "gen.top_p": 0.0}), "gen.top_p")
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": "x", "gen.attention_impl": "triton"}),
      "config.gen.attention_impl = 'triton'",
    )
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": "x", "gen.kv_policy": "stride9"}),
      r"config.gen.kv_policy = 'stride9' is invalid: stride's number must be in \[1, R = ",
    )
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": "x", "mesh.tensor": 3}),
      r"config.mesh.tensor = 3 does not divide the model's num_heads = 2",
    )
    # The engine cannot page KDA state: refused for a workdir without a recorded model (with
    # one, the recorded model is used; tests/model_record_test.py covers overrides).
    unrecorded = os.path.join(self.tmp, "unrecorded")
    shutil.copytree(self.train_dir, unrecorded)
    os.remove(os.path.join(unrecorded, model_record.FILENAME))
    self._fails(
      _gen_config(unrecorded, **{"gen.prompts": "x", **testing.KDA_ONLY_OVERRIDES}),
      "config.model.*kda",
    )
    # A KDA core's state slots come out of the budget before its pages.
    hybrid = {"gen.prompts": "x", "model.core_mixers": ("kda",), "gen.kv_budget_bytes": 1e5}
    self._fails(
      _gen_config(unrecorded, **hybrid), "gen.kv_budget_bytes.*holds 0 pages .* after 8 state"
    )
    # A prompt that alone fills the context is the prompt's fault, not max_new_tokens'.
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": ("ab", "x" * 32)}),
      r"gen.prompts.*prompt 1 is 32 tokens; the model's max_seq_len 32",
    )
    not_utf8 = os.path.join(self.tmp, "p.txt")
    with open(not_utf8, "wb") as f:
      f.write(b"fine\r\nab\xff\xfecd\n")
    self._fails(
      _gen_config(self.train_dir, **{"gen.prompts": not_utf8}),
      r"gen.prompts.*line 2 is not UTF-8 \(byte 3: invalid start byte\)",
    )
    bad_jsonl = os.path.join(self.tmp, "p.jsonl")
    with open(bad_jsonl, "w") as f:
      f.write('{"prompt": "a"}\n{"text": "b"}\n')
    self._fails(_gen_config(self.train_dir, **{"gen.prompts": bad_jsonl}), "line 2")

  def test_batch_mode_writes_generations_equal_to_direct_decoding(self):
    prompts = ["def f(x):", "import os", "class A:"]
    path = os.path.join(self.tmp, "prompts.jsonl")
    with open(path, "w") as f:
      for p in prompts:
        f.write(json.dumps({"prompt": p}) + "\n")
    workdir = os.path.join(self.tmp, "gen")
    config = _gen_config(
      self.train_dir, **{"gen.prompts": path, "gen.share_kv": False, "gen.stop_at_eos": False}
    )
    programs.run(config, workdir)
    with open(os.path.join(workdir, "generations.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    tok = BytesTokenizer()
    self.assertEqual([r["prompt"] for r in rows], prompts)
    for p, row in zip(prompts, rows):
      want = _greedy(self.model, self.params, [int(t) for t in tok.encode(p)], 8, False)
      self.assertEqual(row["tokens"], want)
      self.assertEqual(row["text"], tok.decode(want))
      self.assertLen(row["logprobs"], 8)
      self.assertTrue(all(lp <= 0 for lp in row["logprobs"]))
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    self.assertEqual(summary["generated_tokens"], 24)
    self.assertEqual(summary["pages_in_use_at_end"], 0)
    self.assertGreater(summary["tokens_per_s"], 0)
    for key in ("ttft_s", "hit_rate", "peak_pages_in_use", "num_pages"):
      self.assertIn(key, summary)

  def test_stage_dir_single_prompt_streams(self):
    # A pipeline stage dir: the model comes from its stage_config.json, not config.model.
    stage = os.path.join(self.tmp, "stage")
    shutil.copytree(self.train_dir, stage)
    with open(os.path.join(stage, "stage_config.json"), "w") as f:
      json.dump({"model": self.model_config.to_dict(), "data": self.data_config.to_dict()}, f)
    overrides = {"gen.prompts": "for i in", "model.d_model": 999, "gen.stop_at_eos": False}
    config = _gen_config(stage, **overrides)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      result = programs.run(config, os.path.join(self.tmp, "gen1"))
    gen = result["generations"][0]
    self.assertEqual(out.getvalue(), "for i in" + gen.text + "\n")
    prompt = [int(t) for t in BytesTokenizer().encode("for i in")]
    self.assertEqual(gen.tokens, _greedy(self.model, self.params, prompt, 8, True))
    self.assertEqual(gen.text, BytesTokenizer().decode(gen.tokens))


if __name__ == "__main__":
  absltest.main()
