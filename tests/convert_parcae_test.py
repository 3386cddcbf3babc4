"""Parcae folders as its public code writes them (tests/testdata/parcae_tiny: config.json with
`_class_name`, pytorch_model.bin from torch.save): read without torch, every tensor where the
config says, the computation docs/convert.md states reproducing the public code's logits (in
numpy, from the weights read here); converted by the convert program, the LoopedLM equals the
public code's golden logits in the parallel forward and in token-by-token decode through its
cache (also from a bfloat16 copy, against goldens computed on its values), and the same
comparison fails for a transposed weight, a skipped norm, dropped value embeddings or a dropped C;
unsupported variants are refused in one line naming the field."""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys

import convert_golden_test as golden_lib
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import looped_testing as testing
from looped import config_checks
from looped.convert import common, hf_folder, parcae, program
from looped.model import LoopedLM
from looped.model.sharing import decode_forward, jacobi_forward

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

  def test_a_variant_is_refused_in_one_line_on_the_command_line(self):
    src = os.path.join(self.tmp, "src")
    shutil.copytree(TINY, src)
    hf = json.load(open(os.path.join(src, "config.json")))
    hf["recurrent_embedding_dimension"] = 64
    json.dump(hf, open(os.path.join(src, "config.json"), "w"))
    with self.assertRaises(config_checks.ConfigError) as e:
      program.validate(_config(src))
    self.assertIn(
      "config.json recurrent_embedding_dimension = 64 is not supported", str(e.exception)
    )
    done = subprocess.run(
      [
        sys.executable,
        "-m",
        "looped.main",
        "--config=configs/convert.py",
        f"--workdir={os.path.join(self.tmp, 'w')}",
        f"--config.convert.source={src}",
      ],
      cwd=_REPO,
      capture_output=True,
      text=True,
      timeout=600,
    )
    self.assertEqual(done.returncode, 2, done.stderr)
    lines = done.stderr.strip().splitlines()
    self.assertLen(lines, 1, done.stderr)
    self.assertIn("recurrent_embedding_dimension", lines[0])

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
      "state_init": "unit",
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


class ParcaeGoldenTest(golden_lib._ConvertedTest):
  """The tiny folder converted by the convert program, against the public code's goldens."""

  SOURCE = "parcae_tiny"

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.state0 = jnp.asarray(cls.golden["state0"])

  def _logits(self, params, **fields):
    cfg = dataclasses.replace(self.cfg, **fields)
    return _forward(params, self.ids, self.state0, cfg)

  def test_converted_config(self):
    self.assertEqual(self.cfg.value_embed_layers, (1, 3))  # Core layer 0 and the coda's.
    self.assertTrue(self.cfg.core_out_proj)
    self.assertEqual((self.cfg.norm_eps, self.cfg.rope_base), (1e-5, 50_000.0))
    self.assertEqual((self.cfg.mlp_type, self.cfg.injection), ("relu2", "diagonal"))

  def test_parallel_forward_matches_golden(self):
    for r in (2, 4):
      with self.subTest(r=r):
        logits = self._logits(self.params, num_recurrences=r)
        err = golden_lib.relative_error(logits, self.golden[f"logits_r{r}"])
        self.assertLess(err, golden_lib.TOLERANCE)

  def test_decode_through_the_cache_matches_golden(self):
    for r in (2, 4):
      with self.subTest(r=r):
        logits = golden_lib.decode(self._model(r), self.params, self.ids, self.state0)
        err = golden_lib.relative_error(logits, self.golden[f"logits_r{r}"])
        self.assertLess(err, golden_lib.TOLERANCE)

  def test_a_wrong_mapping_fails_the_match(self):
    golden = self.golden["logits_r4"]
    p = self.params["params"]
    without = lambda name: {"params": {k: v for k, v in p.items() if k != name}}
    no_value_embeds = jax.tree.map(lambda x: x, self.params)
    no_value_embeds["params"]["recurrence"]["layer_0"]["attn"].pop("value_embed")
    no_value_embeds["params"]["coda_0"]["attn"].pop("value_embed")
    cases = {
      "transposed core query": (golden_lib.transposed_query(self.params), {}),
      "prelude norm skipped": (without("prelude_norm"), dict(prelude_norm=False)),
      "C skipped": (without("core_out"), dict(core_out_proj=False)),
      "value embeddings skipped": (no_value_embeds, dict(value_embed_layers=())),
    }
    for name, (params, fields) in cases.items():
      with self.subTest(name):
        err = golden_lib.relative_error(self._logits(params, **fields), golden)
        self.assertGreater(err, 100 * golden_lib.TOLERANCE)

  def test_norm_eps_against_numpy_where_it_matters(self):
    # At norm_eps = 0.5 (not Parcae's 1e-5) the numpy statement's logits move far from the
    # golden; the converted model follows them.
    folder = hf_folder.open_folder(TINY)
    hf = {**folder.config, "norm_eps": 0.5}
    w = hf_folder.load(folder, folder.shards)
    want = parcae_numpy(
      {k: v.astype(np.float64) for k, v in w.items()},
      hf,
      self.golden["input_ids"],
      self.golden["state0"].astype(np.float64),
      4,
    )
    self.assertGreater(golden_lib.relative_error(want, self.golden["logits_r4"]), 1e-2)
    params = parcae.to_params({k: w[k] for k in parcae.expected_shapes(hf)[0]}, hf)
    got = self._logits(jax.tree.map(jnp.asarray, params), norm_eps=0.5)
    self.assertLess(golden_lib.relative_error(got, want), golden_lib.TOLERANCE)

  def test_shared_decode_equals_jacobi_and_documents_stay_apart(self):
    # Value embeddings are part of the cached values: exact shared decode (the cache keeps the
    # final recurrence's K/V) equals T - 1 Jacobi passes, which read them in parallel.
    model = self._model(2)
    ids_BxT = self.ids[:, :6]
    b, t = ids_BxT.shape
    shared, _ = jax.jit(lambda p, x: decode_forward(model, p, x, share_kv=True))(
      self.params, ids_BxT
    )
    jacobi, _ = jax.jit(lambda p, x: jacobi_forward(model, p, x, t - 1))(self.params, ids_BxT)
    self.assertLess(golden_lib.relative_error(shared, jacobi), golden_lib.TOLERANCE)
    # Document masking: the second of two packed documents gives its logits alone.
    cut = 2
    segment_ids_BxT = jnp.broadcast_to(jnp.arange(t) >= cut, (b, t)).astype(jnp.int32)
    forward = jax.jit(lambda p, x, s: model.apply(p, x, segment_ids_BxT=s)[0])
    unshared = forward(self.params, ids_BxT, jnp.zeros((b, t), jnp.int32))
    # Sharing changes these logits: the equality above is not that of two unshared forwards.
    self.assertGreater(golden_lib.relative_error(shared, unshared), 100 * golden_lib.TOLERANCE)
    packed = forward(self.params, ids_BxT, segment_ids_BxT)
    alone = forward(self.params, ids_BxT[:, cut:], jnp.zeros((b, t - cut), jnp.int32))
    self.assertLess(golden_lib.relative_error(packed[:, cut:], alone), golden_lib.TOLERANCE)


@functools.partial(jax.jit, static_argnums=3)
def _forward(params, tokens_BxT, state_BxTxD, cfg):
  return LoopedLM(cfg).apply(params, tokens_BxT, initial_state_BxTxD=state_BxTxD)[0]


class ParcaeBfloat16GoldenTest(golden_lib._ConvertedTest):
  """The same weights stored in bfloat16 (tests/testdata/parcae_tiny_bf16, written by the
  public code's torch.save): goldens are the public code's float32 forward on that file's
  values, which the converted model (read as float32) reproduces."""

  SOURCE = "parcae_tiny_bf16"

  def test_parallel_forward_and_decode_match_golden(self):
    folder = hf_folder.open_folder(os.path.join(golden_lib._DATA, self.SOURCE))
    stored = hf_folder.load(folder, [n for n in folder.shards if n != "freqs_cis"])
    self.assertEqual({str(x.dtype) for x in stored.values()}, {"bfloat16"})
    state0 = jnp.asarray(self.golden["state0"])
    float32 = np.load(os.path.join(TINY, "golden.npz"))["logits_r4"]
    # The rounding moves the logits: matching the float32 folder's goldens would not pass.
    self.assertGreater(golden_lib.relative_error(self.golden["logits_r4"], float32), 1e-3)
    for r in (2, 4):
      with self.subTest(r=r):
        cfg = dataclasses.replace(self.cfg, num_recurrences=r)
        logits = _forward(self.params, self.ids, state0, cfg)
        err = golden_lib.relative_error(logits, self.golden[f"logits_r{r}"])
        self.assertLess(err, golden_lib.TOLERANCE)
    logits = golden_lib.decode(self._model(4), self.params, self.ids, state0)
    err = golden_lib.relative_error(logits, self.golden["logits_r4"])
    self.assertLess(err, golden_lib.TOLERANCE)
