"""Parcae folders as its public code writes them (tests/testdata/parcae_tiny: config.json with
`_class_name`, pytorch_model.bin from torch.save): read without torch, every tensor where the
config says, the computation docs/convert.md states reproducing the public code's logits (in
numpy, from the weights read here), and refused in one line naming what LoopedLM lacks or the
unsupported field."""

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


def _rms(x, w=None, eps=1e-5):
  y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  return y if w is None else y * w


def _has_ve(layer, n):
  return layer % 2 == (n - 1) % 2


def parcae_numpy(w: dict, hf: dict, ids, state0, steps: int):
  """Parcae's forward in numpy, written from docs/convert.md (Parcae): an independent statement
  of what the public code computes, checked against its goldens."""
  d, n = hf["n_embd"], hf["num_attention_heads"]
  hd, eps = d // n, hf["norm_eps"]
  p, b, c = hf["n_layers_in_prelude"], hf["n_layers_in_recurrent_block"], hf["n_layers_in_coda"]
  n_layer = b * hf["mean_backprop_depth"]
  t = ids.shape[1]
  inv = 50000.0 ** (-np.arange(0, hd, 2) / hd)  # rope_settings dropped: base 50000
  ang = np.arange(t)[:, None] * inv  # (T, hd/2)
  cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]

  def rope(x):  # interleaved pairs (x[2i], x[2i+1])
    a, b_ = x[..., 0::2], x[..., 1::2]
    return np.stack([a * cos - b_ * sin, b_ * cos + a * sin], -1).reshape(x.shape)

  def block(x, name, layer_id, ve_index):
    bsz = x.shape[0]
    h = _rms(x, w[f"{name}.norm_1.weight"], eps)
    q = (h @ w[f"{name}.attn.c_q.weight"].T).reshape(bsz, t, -1, hd)
    k = (h @ w[f"{name}.attn.c_k.weight"].T).reshape(bsz, t, -1, hd)
    v = (h @ w[f"{name}.attn.c_v.weight"].T).reshape(bsz, t, -1, hd)
    gate = w.get(f"{name}.attn.ve_gate.weight")
    table = w.get(f"value_embeds.{ve_index}.weight")
    assert (gate is not None) == _has_ve(layer_id, n_layer)
    if gate is not None and table is not None:
      g = 2 / (1 + np.exp(-(h[..., :32] @ gate.T)))  # (B, T, K)
      v = v + g[..., None] * table[ids].reshape(v.shape)
    q, k = _rms(rope(q), eps=np.finfo(np.float32).eps), _rms(rope(k), eps=np.finfo(np.float32).eps)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a = a / a.sum(-1, keepdims=True)
    y = np.einsum("bhqk,bkhd->bqhd", a, v).reshape(bsz, t, d)
    x = x + y @ w[f"{name}.attn.c_proj.weight"].T
    h = _rms(x, w[f"{name}.norm_2.weight"], eps) @ w[f"{name}.mlp.fc.weight"].T
    return x + (0.5 * np.maximum(h, 0) ** 2) @ w[f"{name}.mlp.proj.weight"].T

  e = w["transformer.wte.weight"][ids]
  for i in range(p):
    e = block(e, f"transformer.prelude.{i}", i, i)
  e = _rms(e, w["transformer.ln_prelude.weight"], eps)
  dt = np.log1p(np.exp(w["transformer.adapter.dt_bias"]))
  decay = np.exp(-dt * np.exp(w["transformer.adapter.A_log"]))
  x = state0
  for _ in range(steps):
    x = decay * x + dt * (e @ w["transformer.adapter.B"].T)
    for j in range(b):
      x = block(x, f"transformer.core_block.{j}", p + j, p + j)
  x = x @ w["transformer.C.weight"].T
  for i in range(c):
    x = block(x, f"transformer.coda.{i}", p + b * hf["mean_recurrence"] + i, p + b + i)
  return _rms(x, w["transformer.ln_f.weight"], eps) @ w["lm_head.weight"].T


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

  def test_numpy_statement_reproduces_the_public_codes_logits(self):
    folder = hf_folder.open_folder(TINY)
    w = {k: v.astype(np.float64) for k, v in hf_folder.load(folder, folder.shards).items()}
    golden = np.load(os.path.join(TINY, "golden.npz"))
    ids, state0 = golden["input_ids"], golden["state0"].astype(np.float64)
    for steps in (2, 4):
      want = golden[f"logits_r{steps}"]
      got = parcae_numpy(w, folder.config, ids, state0, steps)
      err = np.abs(got - want).max() / np.abs(want).max()
      self.assertLess(err, 1e-5, f"R = {steps}")
    # The comparison sees each part: a transposed weight, a skipped value embedding, an
    # identity in place of C, a prelude norm without its weight.
    broken = {
      "transformer.core_block.0.attn.c_q.weight": w["transformer.core_block.0.attn.c_q.weight"].T,
      "value_embeds.1.weight": 0 * w["value_embeds.1.weight"],
      "transformer.C.weight": np.eye(w["transformer.C.weight"].shape[0]),
      "transformer.ln_prelude.weight": np.ones_like(w["transformer.ln_prelude.weight"]),
    }
    want = golden["logits_r4"]
    for name, value in broken.items():
      got = parcae_numpy({**w, name: value}, folder.config, ids, state0, 4)
      self.assertGreater(np.abs(got - want).max() / np.abs(want).max(), 1e-2, name)

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
