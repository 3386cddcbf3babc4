"""Converted tiny Huginn, Ouro and Parcae models end to end (tests/testdata/*_tiny, saved by
each family's own PyTorch code): convert -> configs/generate.py samples with the model's own
tokenizer, the tokens of exact shared greedy decoding -> the BeNice! pipeline
(configs/benice.py:smoke with pipeline.pretrain_workdir) post-trains the converted model and
evaluates it, the zero-shot perplexity being the converted params' own (Ouro's at a loop count
chosen as on the command line). The converted Parcae is also served (configs/serve.py, a
process): its greedy completions over HTTP are the generate program's texts."""

import json
import os
import signal

import engine_reference
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest

import looped_testing as testing
from configs import benice as benice_config
from configs import convert as convert_config
from configs import generate as generate_config
from looped import data as data_lib
from looped import programs
from looped.checkpoints import model_record
from looped.data import tokenizers
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import LoopedLM, from_config
from looped.server import client

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
_PROMPTS = ("def main(", "the loop")
_BLOCK = 16  # Generation's and the server's prefill block (one block holds each prompt).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A few post-training steps on tiny data; no KV formats or samples (tests elsewhere).
_SMALL = {
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
}


def _recorded(directory: str) -> dict:
  """The architecture fields a directory records (its model_config.json)."""
  with open(os.path.join(directory, model_record.FILENAME)) as f:
    model = json.load(f)["model"]
  return {k: v for k, v in model.items() if k not in model_record.EXECUTION_FIELDS}


class ConvertEndToEndTest(testing.TempDirTestCase):
  def _convert(self, family: str) -> str:
    converted = os.path.join(self.tmp, family)
    config = convert_config.get_config()
    config.convert.source = os.path.join(_DATA, f"{family}_tiny")
    programs.run(config, converted)
    return converted

  def _generate_is_greedy_shared_decode(self, converted: str, eos: str):
    """configs/generate.py on the converted dir: its text is the tokenizer's decode of its
    tokens, and the tokens are greedy shared decoding of the converted params under the
    generator's prefill block (each request alone, engine_reference.py)."""
    config = generate_config.get_config()
    config.gen.checkpoint = converted
    testing.set_field(config, "gen.prompts", _PROMPTS)
    config.gen.max_new_tokens = 6
    config.gen.stop_at_eos = False
    config.gen.prefill_block = _BLOCK
    result = programs.run(config, os.path.join(self.tmp, "gen"))
    tok = tokenizers.HuggingFaceTokenizer(os.path.join(converted, "tokenizer.json"))
    self.assertEqual((tok.eos_id, tok.vocab_size), (tok.tokenizer.token_to_id(eos), 300))
    model_cfg, _ = model_record.model_and_data(config, converted)
    model = LoopedLM(from_config(model_cfg))
    params = testing.saved_params(model_cfg, converted)
    for prompt, gen in zip(_PROMPTS, result["generations"]):
      self.assertLen(gen.tokens, 6)
      self.assertEqual(gen.text, tok.decode(gen.tokens))
      ids = [int(t) for t in tok.encode(prompt)]
      request = GenRequest(0, tuple(ids), SamplingParams(max_new_tokens=6))
      (greedy,), _ = engine_reference.block_reference(
        model.cfg, params, [request], share_kv=True, block=config.gen.prefill_block
      )
      self.assertEqual(list(gen.tokens), greedy, prompt)
    return result["generations"]

  def _serves_the_generated_text(self, converted: str, generations):
    """configs/serve.py on the converted dir, as a process: its greedy completions over HTTP
    are the generate program's texts; SIGTERM ends it with every page free."""
    workdir = os.path.join(self.tmp, "serve")
    proc, info = testing.start_server(
      workdir,
      [
        "--config=configs/serve.py",
        f"--config.serve.checkpoint={converted}",
        # Few call shapes to warm up (one row; 1 or 16 tokens).
        "--config.serve.max_num_seqs=1",
        "--config.serve.max_num_batched_tokens=16",
        f"--config.serve.prefill_block={_BLOCK}",
        "--config.serve.token_buckets=(16,)",
      ],
    )
    try:
      url = info["url"]
      for prompt, gen in zip(_PROMPTS, generations):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        status, reply = client.request(url + "/v1/completions", "POST", body, timeout_s=240)
        self.assertEqual(status, 200, reply)
        self.assertEqual(reply["choices"][0]["text"], gen.text, prompt)
      proc.send_signal(signal.SIGTERM)
      output, _ = proc.communicate(timeout=240)
      self.assertEqual(proc.returncode, 0, output)
      with open(os.path.join(workdir, "server_stats.json")) as f:
        self.assertEqual(json.load(f)["pages_in_use_at_end"], 0)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.communicate()

  def _benice(self, converted: str, models: tuple[str, ...], recurrences: int = 0) -> dict:
    """The pipeline from the converted dir (at `recurrences`, as --config.model.num_recurrences
    would choose; 0: the recorded R): each post-training stage records the converted model,
    every reported perplexity is finite, and the zero-shot unshared perplexity is that of the
    converted params on the eval batches of the converted tokenizer."""
    config = benice_config.get_config("smoke")
    config.pipeline.pretrain_workdir = converted
    config.pipeline.models = models
    for key, value in _SMALL.items():
      testing.set_field(config, key, value)
    overrides = ()
    if recurrences:
      config.model.num_recurrences = recurrences
      overrides = ("model.num_recurrences",)
    workdir = os.path.join(self.tmp, "benice")
    report = programs.run(config, workdir, overrides)
    converted_model = _recorded(converted)
    if recurrences:
      converted_model["num_recurrences"] = recurrences
    for name in models:
      if name != "zero_shot":
        stage_dir = os.path.join(workdir, name)
        self.assertEqual(_recorded(stage_dir), converted_model, name)
        with open(os.path.join(stage_dir, model_record.FILENAME)) as f:
          data = json.load(f)["data"]
        self.assertEqual(data["tokenizer_json"], os.path.join(converted, "tokenizer.json"))
      metrics = report["models"][name]
      for key in ("ppl_unshared_eval", "ppl_shared_exact_subset", "gap_exact"):
        self.assertTrue(np.isfinite(metrics[key]), (name, key, metrics[key]))
      self.assertTrue(np.isfinite(metrics["ppl_shared_jacobi_eval"]["1"]), name)

    stage = model_record.with_recorded_model(
      config, converted, model_record.chosen_fields(overrides)
    )
    self.assertEqual(stage.model.num_recurrences, recurrences or converted_model["num_recurrences"])
    self.assertIsInstance(tokenizers.get(stage.data), tokenizers.HuggingFaceTokenizer)
    (batch,) = data_lib.make_eval_batches(stage, process_index=0, process_count=1)
    model = LoopedLM(from_config(stage.model))
    params = testing.saved_params(stage.model, converted)
    segments = batch.get("segment_ids")  # The evaluation's document masking (data config).
    logits, _ = jax.jit(model.apply)(params, jnp.asarray(batch["inputs"]), segment_ids_BxT=segments)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(batch["targets"]))
    ppl = float(np.exp(np.mean(np.asarray(ce, np.float64))))
    self.assertAlmostEqual(report["models"]["zero_shot"]["ppl_unshared_eval"] / ppl, 1.0, 5)
    return report

  def test_huginn(self):
    converted = self._convert("huginn")
    self._generate_is_greedy_shared_decode(converted, "<|end_text|>")
    # The finetune arm runs the same stage code as BeNice! (benice_pipeline_test runs both).
    report = self._benice(converted, ("zero_shot", "benice"))
    tuned = report["models"]["benice"]["ppl_unshared_eval"]
    self.assertNotAlmostEqual(tuned, report["models"]["zero_shot"]["ppl_unshared_eval"], 3)

  def test_ouro(self):
    converted = self._convert("ouro")
    self._generate_is_greedy_shared_decode(converted, "<|im_end|>")
    # Post-trained and evaluated at R = 2, not the recorded 4: the loop count is the reader's.
    report = self._benice(converted, ("zero_shot", "benice"), recurrences=2)
    kv = report["models"]["zero_shot"]["kv_bytes_per_token"]
    self.assertEqual(kv["unshared"], 2 * kv["shared"])  # Every layer looped, R = 2.

  def test_parcae(self):
    # Value embeddings in the cached values, C before the coda: generation's pages, BeNice!
    # post-training (the value-embedding tables and C train with the rest) and the pipeline's
    # shared evaluation run on them.
    converted = self._convert("parcae")
    generations = self._generate_is_greedy_shared_decode(converted, "<|end_text|>")
    self._serves_the_generated_text(converted, generations)
    report = self._benice(converted, ("zero_shot", "benice"))
    tuned = report["models"]["benice"]["ppl_unshared_eval"]
    self.assertNotAlmostEqual(tuned, report["models"]["zero_shot"]["ppl_unshared_eval"], 3)


if __name__ == "__main__":
  absltest.main()
