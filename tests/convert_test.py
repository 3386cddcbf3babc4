"""The convert program on Hugging Face folders written here (random weights, no torch): one-line
errors before any weight is read, and a converted checkpoint that carries its model and
tokenizer and that generation reads."""

import json
import os
import subprocess
import sys

import engine_reference
import ml_collections
import numpy as np
import safetensors.numpy
from absl.testing import absltest

import looped_testing as testing
from configs import convert as convert_config
from configs import generate as generate_config
from looped import config_checks, programs
from looped.checkpoints import model_record
from looped.convert import huginn, ouro
from looped.data import tokenizers
from looped.engine import generate
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import from_config

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HUGINN = {
  "architectures": ["RavenForCausalLM"],
  "model_type": "huginn_raven",
  "n_embd": 16,
  "num_attention_heads": 2,
  "num_key_value_heads": 2,
  "intermediate_size": 24,
  "vocab_size": 260,
  "block_size": 64,
  "n_layers_in_prelude": 1,
  "n_layers_in_recurrent_block": 2,
  "n_layers_in_coda": 1,
  "mean_recurrence": 3,
  "qk_bias": True,
  "tie_embeddings": False,
  "rope_base": 50000.0,
  "norm_eps": 1e-6,
  "state_init": "like-init",
  "injection_type": "linear",
  "bias": False,
}

OURO = {
  "architectures": ["OuroForCausalLM"],
  "model_type": "ouro",
  "hidden_size": 16,
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 8,
  "intermediate_size": 24,
  "num_hidden_layers": 2,
  "total_ut_steps": 3,
  "vocab_size": 260,
  "max_position_embeddings": 64,
  "rope_theta": 10000.0,
  "rms_norm_eps": 1e-6,
  "tie_word_embeddings": False,
  "hidden_act": "silu",
}


def write_folder(path: str, hf: dict, family, shards: int = 2, seed: int = 0) -> dict:
  """A Hugging Face folder for `hf` with random float32 weights in `shards` shards and an
  index, plus testing's byte-level tokenizer.json; returns the tensors."""
  rng = np.random.default_rng(seed)
  shapes, _ = family.expected_shapes(hf)
  tensors = {n: rng.normal(0, 0.3, s).astype(np.float32) for n, s in sorted(shapes.items())}
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf, f)
  names = sorted(tensors)
  weight_map = {}
  for i in range(shards):
    shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
    part = names[i::shards]
    safetensors.numpy.save_file({n: tensors[n] for n in part}, os.path.join(path, shard))
    weight_map.update({n: shard for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  testing.write_byte_level_tokenizer(os.path.join(path, "tokenizer.json"))
  return tensors


def _config(source: str, **fields):
  config = convert_config.get_config()
  config.convert.source = source
  for key, value in fields.items():
    testing.set_field(config, key, value)
  return config


class ConvertErrorsTest(testing.TempDirTestCase):
  """Bad input fails in one line before any weight is read."""

  def _fails(self, source, pattern, **fields):
    with self.assertRaisesRegex(config_checks.ConfigError, pattern):
      programs.validate(_config(source, **fields), os.path.join(self.tmp, "w"))
    self.assertFalse(os.path.exists(os.path.join(self.tmp, "w")))

  def test_unknown_architecture_names_it_and_the_supported_ones(self):
    src = os.path.join(self.tmp, "src")
    write_folder(src, HUGINN, huginn)
    with open(os.path.join(src, "config.json"), "w") as f:
      json.dump({**HUGINN, "architectures": ["LlamaForCausalLM"]}, f)
    self._fails(
      src,
      r"architectures = \['LlamaForCausalLM'\] is not supported; supported: LoopedForCausalLM, "
      r"OuroForCausalLM, ParcaeConfig, RavenForCausalLM\.$",
    )

  def test_missing_shard_is_named(self):
    src = os.path.join(self.tmp, "src")
    write_folder(src, HUGINN, huginn, shards=3)
    os.remove(os.path.join(src, "model-00002-of-00003.safetensors"))
    self._fails(src, r"shard model-00002-of-00003.safetensors listed in .* is missing")

  def test_shape_mismatch_names_tensor_and_both_shapes(self):
    src = os.path.join(self.tmp, "src")
    write_folder(src, {**HUGINN, "intermediate_size": 20}, huginn)
    with open(os.path.join(src, "config.json"), "w") as f:
      json.dump(HUGINN, f)  # config.json now says 24.
    self._fails(
      src,
      r"tensor transformer.coda.0.mlp.fc.weight has shape \(40, 16\), but config.json "
      r"implies \(48, 16\)",
    )

  def test_other_bad_inputs(self):
    self._fails(os.path.join(self.tmp, "nope"), "convert.source.*existing directory")
    src = os.path.join(self.tmp, "src")
    os.makedirs(src)
    self._fails(src, "has no config.json")
    write_folder(src, HUGINN, huginn)
    self._fails(src, "convert.num_recurrences", **{"convert.num_recurrences": -1})
    self._fails(  # Past Huginn's stored RoPE table (block_size 64 rows).
      src, "convert.max_seq_len = 65.*RoPE table holds 64 positions", **{"convert.max_seq_len": 65}
    )
    with open(os.path.join(src, "config.json"), "w") as f:
      json.dump({**HUGINN, "injection_type": "add"}, f)
    self._fails(src, r"injection_type = 'add' is not supported: supported: 'linear'")
    with open(os.path.join(src, "config.json"), "w") as f:
      json.dump({k: v for k, v in HUGINN.items() if k != "mean_recurrence"}, f)
    self._fails(src, "config.json has no field 'mean_recurrence'")
    with open(os.path.join(src, "config.json"), "w") as f:
      json.dump(HUGINN, f)
    os.remove(os.path.join(src, "tokenizer.json"))
    self._fails(src, "has no tokenizer.json")

  def test_tokenizer_larger_than_the_vocabulary_is_refused(self):
    src = os.path.join(self.tmp, "src")
    write_folder(src, {**HUGINN, "vocab_size": 256}, huginn)  # The tokenizer has 257 ids.
    self._fails(
      src,
      r"tokenizer.json needs 257 ids \(EOS id 256\) but the model's vocab_size \(from "
      r"config.json\) is 256\.$",
    )

  def test_command_line_error_is_one_line(self):
    src = os.path.join(self.tmp, "src")
    write_folder(src, HUGINN, huginn, shards=3)
    os.remove(os.path.join(src, "model-00003-of-00003.safetensors"))
    command = [
      sys.executable,
      "-m",
      "looped.main",
      "--config=configs/convert.py",
      f"--workdir={os.path.join(self.tmp, 'w')}",
      f"--config.convert.source={src}",
    ]
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, timeout=600)
    self.assertEqual(done.returncode, 2, done.stderr)
    lines = done.stderr.strip().splitlines()
    self.assertLen(lines, 1, done.stderr)
    self.assertIn("shard model-00003-of-00003.safetensors", lines[0])


class ConvertTest(testing.TempDirTestCase):
  def _convert(self, hf, family, **fields):
    src = os.path.join(self.tmp, "src")
    tensors = write_folder(src, hf, family)
    out = os.path.join(self.tmp, "converted")
    programs.run(_config(src, **fields), out)
    return src, out, tensors

  def test_huginn_checkpoint_carries_model_and_tokenizer(self):
    fields = {"convert.num_recurrences": 5, "convert.max_seq_len": 32}
    _, out, tensors = self._convert(HUGINN, huginn, **fields)
    record = model_record.read(out)
    self.assertEqual(record["model"]["num_recurrences"], 5)
    self.assertEqual(record["model"]["block_norm"], "post")
    self.assertEqual(record["data"]["tokenizer"], "huggingface")
    self.assertEqual(record["data"]["tokenizer_json"], os.path.join(out, "tokenizer.json"))
    # Weights are placed, transposed and split as the family module says.
    config = generate_config.get_config()
    config.gen.checkpoint = out
    model_cfg, data_cfg = generate.model_and_data(config)
    params = testing.saved_params(model_cfg, out)["params"]
    np.testing.assert_array_equal(params["embed"]["embedding"], tensors["transformer.wte.weight"])
    np.testing.assert_array_equal(params["head"]["kernel"], tensors["lm_head.weight"].T)
    fc = tensors["transformer.core_block.1.mlp.fc.weight"]
    np.testing.assert_array_equal(params["recurrence"]["layer_1"]["mlp"]["up"]["kernel"], fc[24:].T)
    # The stored RoPE table, cut to the converted context, in every attention layer.
    table = tensors["freqs_cis"][0, :32, 0]
    for scope in (params["prelude_0"], params["recurrence"]["layer_0"], params["coda_0"]):
      np.testing.assert_array_equal(scope["attn"]["rope_table"], table)
    self.assertIsInstance(tokenizers.get(data_cfg), tokenizers.HuggingFaceTokenizer)

  def test_ouro_checkpoint_generates_with_its_tokenizer(self):
    _, out, _ = self._convert(OURO, ouro)
    config = generate_config.get_config()
    config.gen.checkpoint = out
    config.gen.prompts = "def f(x):"
    config.gen.max_new_tokens = 5
    config.gen.stop_at_eos = False
    result = programs.run(config, os.path.join(self.tmp, "gen"))
    gen = result["generations"][0]
    self.assertLen(gen.tokens, 5)
    tok = tokenizers.HuggingFaceTokenizer(os.path.join(out, "tokenizer.json"))
    self.assertEqual(gen.text, tok.decode(gen.tokens))
    # Shared decode of the converted params under the generator's prefill block, the request
    # alone on a dense cache (engine_reference.py).
    model_cfg, _ = generate.model_and_data(config)
    cfg = from_config(model_cfg)
    params = testing.saved_params(model_cfg, out)
    prompt = [int(t) for t in tok.encode("def f(x):")]
    request = GenRequest(0, tuple(prompt), SamplingParams(max_new_tokens=5))
    (greedy,), _ = engine_reference.block_reference(
      cfg, params, [request], share_kv=True, block=config.gen.prefill_block
    )
    self.assertEqual(gen.tokens, greedy)

  def test_rerun_into_a_converted_workdir_is_refused(self):
    src, out, _ = self._convert(OURO, ouro)
    with self.assertRaisesRegex(config_checks.ConfigError, "already holds checkpoints"):
      programs.run(_config(src), out)


class TokenizerTest(testing.TempDirTestCase):
  def test_huggingface_tokenizer_round_trips_and_names_eos(self):
    path = os.path.join(self.tmp, "tokenizer.json")
    testing.write_byte_level_tokenizer(path)
    tok = tokenizers.get(
      ml_collections.ConfigDict({"tokenizer": "huggingface", "tokenizer_json": path})
    )
    text = "def f(x):\n  return 'é'"
    ids = tok.encode(text)
    self.assertEqual(tok.decode(ids), text)
    self.assertEqual(tok.eos_id, 256)
    self.assertEqual(tok.vocab_size, 257)
    self.assertEqual(tok.decode(np.append(ids, tok.eos_id)), text)
    self.assertEqual(tok.num_bytes(ids), len(text.encode("utf-8")))
    with self.assertRaisesRegex(config_checks.ConfigError, "data.tokenizer_json"):
      tokenizers.get(ml_collections.ConfigDict({"tokenizer": "huggingface", "tokenizer_json": ""}))

  def test_eos_is_tokenizer_configs_eos_token_else_a_known_name(self):
    for family, named, configured in (("huginn", 2, 2), ("ouro", 0, 2)):
      # The reference folders' tokenizers: Huginn's EOS is <|end_text|> (id 2), Ouro's
      # tokenizer_config.json names <|im_end|> (id 2) though <|endoftext|> (id 0) is known.
      source = os.path.join(_REPO, "tests", "testdata", f"{family}_tiny")
      directory = os.path.join(self.tmp, family)
      os.makedirs(directory)
      path = os.path.join(directory, "tokenizer.json")
      with open(os.path.join(source, "tokenizer.json")) as f, open(path, "w") as g:
        g.write(f.read())
      self.assertEqual(tokenizers.HuggingFaceTokenizer(path).eos_id, named, family)
      with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": {"content": "<|im_end|>"}}, f)  # The older dict form.
      self.assertEqual(tokenizers.HuggingFaceTokenizer(path).eos_id, 2, family)
      with open(os.path.join(source, "tokenizer_config.json")) as f:
        eos = json.load(f)["eos_token"]
      with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": eos}, f)
      tok = tokenizers.HuggingFaceTokenizer(path)
      self.assertEqual((tok.eos_id, tok.vocab_size), (configured, 300), family)
      with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|not_in_the_vocabulary|>"}, f)
      self.assertEqual(tokenizers.HuggingFaceTokenizer(path).eos_id, named, family)


if __name__ == "__main__":
  absltest.main()
