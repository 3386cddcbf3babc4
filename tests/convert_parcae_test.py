"""Parcae folders as its public code writes them (tests/testdata/parcae_tiny: config.json with
`_class_name`, pytorch_model.bin from torch.save): read without torch, every tensor where the
config says, and refused in one line naming what LoopedLM lacks or the unsupported field."""

import json
import os
import shutil
import subprocess
import sys

import ml_collections
import numpy as np

import looped_testing as testing
from looped import config_checks
from looped.convert import common, hf_folder, parcae, program

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(_REPO, "tests", "testdata", "parcae_tiny")


def _config(source: str):
  return ml_collections.ConfigDict(
    {
      "program": "convert",
      "convert": {"source": source, "num_recurrences": 0, "max_seq_len": 0},
    }
  )


class ParcaeFolderTest(testing.TempDirTestCase):
  def test_reads_the_public_codes_save(self):
    folder = hf_folder.open_folder(TINY)
    self.assertEqual(folder.architecture, "ParcaeConfig")
    self.assertEqual(set(folder.shards.values()), {hf_folder.TORCH_BIN})
    expected, optional = parcae.expected_shapes(folder.config)
    common.check_tensors(hf_folder.tensor_shapes(folder), expected, optional)
    # Value embeddings on layers 1 and 3 of 4; gates on core layer 0 (id 1) and the coda's
    # layer (id 1 + 2 x 4 = 9): the public code's alternating rule, over two different counts.
    ve = sorted(n for n in expected if "value_embeds" in n or "ve_gate" in n)
    self.assertEqual(
      ve,
      [
        "transformer.coda.0.attn.ve_gate.weight",
        "transformer.core_block.0.attn.ve_gate.weight",
        "value_embeds.1.weight",
        "value_embeds.3.weight",
      ],
    )
    w = hf_folder.load(folder, ["transformer.wte.weight", "lm_head.weight", "freqs_cis"])
    # Tied embeddings: torch saved one storage under both names.
    np.testing.assert_array_equal(w["lm_head.weight"], w["transformer.wte.weight"])
    # The RoPE buffer: cos / sin of position x 50000^(-2i / head_dim) (rope_base 50000).
    hd = folder.config["n_embd"] // folder.config["num_attention_heads"]
    angles = np.arange(64)[:, None] * 50000.0 ** (-np.arange(0, hd, 2) / hd)
    np.testing.assert_allclose(w["freqs_cis"][0, :, 0, :, 0], np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(w["freqs_cis"][0, :, 0, :, 1], np.sin(angles), atol=1e-6)

  def test_value_embedding_layers_follow_two_counts(self):
    # P + B + C = 5 layers: value embeddings on layers 0, 2, 4 (the last and alternate ones);
    # gates by layer id over n_layer = B x mean_backprop_depth = 4: ids 1, 3, ... (core 0 is
    # id 1, the coda starts at id P + B x mean_recurrence = 9). So no layer has both here.
    hf = json.load(open(os.path.join(TINY, "config.json")))
    hf.update(n_layers_in_prelude=1, n_layers_in_coda=2, mean_recurrence=4, mean_backprop_depth=2)
    expected, _ = parcae.expected_shapes(hf)
    self.assertEqual(
      sorted(n for n in expected if "value_embeds" in n),
      ["value_embeds.0.weight", "value_embeds.2.weight", "value_embeds.4.weight"],
    )
    self.assertEqual(
      sorted(n for n in expected if "ve_gate" in n),
      ["transformer.coda.0.attn.ve_gate.weight", "transformer.core_block.0.attn.ve_gate.weight"],
    )

  def test_refused_in_one_line_naming_what_is_missing(self):
    with self.assertRaises(config_checks.ConfigError) as e:
      program.validate(_config(TINY))
    msg = str(e.exception)
    self.assertNotIn("\n", msg)
    for part in ("value_embeds", "transformer.C", "norm_eps = 1e-05"):
      self.assertIn(part, msg)
    done = subprocess.run(
      [
        sys.executable,
        "-m",
        "looped.main",
        "--config=configs/convert.py",
        f"--workdir={os.path.join(self.tmp, 'w')}",
        f"--config.convert.source={TINY}",
      ],
      cwd=_REPO,
      capture_output=True,
      text=True,
      timeout=600,
    )
    self.assertEqual(done.returncode, 2, done.stderr)
    lines = done.stderr.strip().splitlines()
    self.assertLen(lines, 1, done.stderr)
    self.assertIn("value_embeds", lines[0])

  def test_variants_are_refused_naming_the_field(self):
    base = json.load(open(os.path.join(TINY, "config.json")))
    cases = {
      "injection_type": "linear",
      "nonlin_name": "GELU",
      "logit_softcap": 15.0,
      "init_strategy": "takase",
      "recurrent_embedding_dimension": 64,
      "recurrent_num_attention_heads": 4,
      "recurrent_intermediation_embedding_dimension": 40,
    }
    for name, value in cases.items():
      with self.assertRaises(config_checks.ConfigError) as e:
        parcae.model_config({**base, name: value})
      self.assertIn(f"config.json {name} = {value!r} is not supported", str(e.exception))

  def test_model_pt_is_read_too(self):
    src = os.path.join(self.tmp, "src")
    shutil.copytree(TINY, src)
    os.rename(os.path.join(src, hf_folder.TORCH_BIN), os.path.join(src, hf_folder.TORCH_PT))
    folder = hf_folder.open_folder(src)
    self.assertEqual(set(folder.shards.values()), {hf_folder.TORCH_PT})
    self.assertEqual(hf_folder.tensor_shapes(folder)["transformer.C.weight"], (32, 32))
