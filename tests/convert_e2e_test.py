"""A converted tiny Huginn end to end: convert -> configs/generate.py samples with its own
tokenizer -> the BeNice! pipeline (configs/benice.py:smoke with pipeline.pretrain_workdir)
post-trains and evaluates it, reading the model and tokenizer the checkpoint records."""

import json
import os

from absl.testing import absltest

import looped_testing as testing
from configs import benice as benice_config
from configs import convert as convert_config
from configs import generate as generate_config
from looped import programs
from looped.data import tokenizers

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "huginn_tiny")


class ConvertEndToEndTest(testing.TempDirTestCase):
  def test_convert_generate_benice(self):
    converted = os.path.join(self.tmp, "huginn")
    config = convert_config.get_config()
    config.convert.source = _SOURCE
    programs.run(config, converted)

    gen = generate_config.get_config()
    gen.gen.checkpoint = converted
    testing.set_field(gen, "gen.prompts", ("def main(", "import os"))
    gen.gen.max_new_tokens = 6
    gen.gen.stop_at_eos = False
    result = programs.run(gen, os.path.join(self.tmp, "gen"))
    tok = tokenizers.HuggingFaceTokenizer(os.path.join(converted, "tokenizer.json"))
    for g in result["generations"]:
      self.assertLen(g.tokens, 6)
      self.assertEqual(g.text, tok.decode(g.tokens))

    benice = benice_config.get_config("smoke")
    benice.pipeline.pretrain_workdir = converted
    for key, value in {
      "data.max_documents": 40,
      "data.seq_len": 32,
      "data.batch_size": 4,
      "data.eval_batch_size": 4,
      "data.num_eval_batches": 1,
      "post.train.num_steps": 2,
      "post.train.checkpoint_every": 2,
      "post.train.eval_every": 2,
      "post.train.warmup_steps": 1,
      "eval.samples": 0,
      "eval.kv_formats": (),
      "eval.jacobi_passes": (1,),
    }.items():
      testing.set_field(benice, key, value)
    workdir = os.path.join(self.tmp, "benice")
    report = programs.run(benice, workdir)
    for stage in ("finetune", "benice"):
      with open(os.path.join(workdir, stage, "model_config.json")) as f:
        record = json.load(f)
      self.assertEqual(record["model"]["block_norm"], "post")  # The converted model.
      self.assertEqual(record["data"]["tokenizer"], "huggingface")
    for name in ("zero_shot", "finetune", "benice"):
      gap = report["models"][name]["gap_exact"]
      self.assertTrue(-1.0 < gap < 10.0, (name, gap))


if __name__ == "__main__":
  absltest.main()
