"""Export to the Huginn and Ouro families inverts convert exactly: the tiny folders written by each
family's public code (tests/testdata/{huginn,ouro}_tiny), converted and exported, give back every
tensor bit for bit (Huginn's stored RoPE table freqs_cis included) and every config.json field
the converter reads; random looped models each family expresses, exported and converted back,
have identical params and logits; a Huginn mapping that skips the RoPE row permutation fails the
first comparison; what a family cannot express is refused in one line naming the model field.
Parcae's export is tests/convert_export_test.py's."""

import dataclasses
import json
import math
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from convert_export_test import (
  bit_differences,
  convert,
  folder_tensors,
  random_params,
  write_checkpoint,
)

import looped_testing as testing
from configs import export as export_config
from looped import config_checks, programs
from looped.convert import export as export_lib
from looped.convert import huginn, huginn_export, ouro, ouro_export, torch_bin
from looped.model import LoopedLM, layers
from looped.model import config as model_lib

_TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
MODULES = {"huginn": (huginn, huginn_export), "ouro": (ouro, ouro_export)}

# Tiny looped models with the fields each family implies (untied Huginn head with QK bias and a
# stored RoPE table; Ouro with GQA and a head width other than d_model / num_heads, tied).
HUGINN_FIELDS = dict(
  vocab_size=320,  # >= the tiny tokenizer's ids (copied into every checkpoint here)
  d_model=32,
  num_heads=2,
  num_kv_heads=2,
  head_dim=16,
  mlp_dim=48,
  mlp_type="swiglu",
  num_prelude_layers=1,
  num_core_layers=2,
  num_coda_layers=1,
  num_recurrences=3,
  injection="linear",
  state_init="zeros",
  state_init_std=math.sqrt(2 / (5 * 32)) * math.sqrt(32),  # Huginn's (read back for any init)
  prelude_norm=False,
  qk_norm=False,
  qk_bias=True,
  rope_base=50000.0,
  rope_table=True,
  tie_embeddings=False,
  max_seq_len=32,
  block_norm="post",
  embed_scale=math.sqrt(32),
  core_out_norm="final",
  norm_eps=1e-6,
)
OURO_FIELDS = dict(
  vocab_size=320,
  d_model=32,
  num_heads=4,
  num_kv_heads=2,
  head_dim=12,
  mlp_dim=48,
  mlp_type="swiglu",
  num_prelude_layers=0,
  num_core_layers=2,
  num_coda_layers=0,
  num_recurrences=3,
  injection="none",
  state_init="embed",
  prelude_norm=False,
  qk_norm=False,
  rope_base=10000.0,
  tie_embeddings=True,
  max_seq_len=32,
  block_norm="sandwich",
  core_out_norm="every",
  exit_gate=True,
  norm_eps=1e-6,
)
FIELDS = {"huginn": HUGINN_FIELDS, "ouro": OURO_FIELDS}


def tiny_cfg(family: str, **changes) -> model_lib.ModelConfig:
  return dataclasses.replace(model_lib.ModelConfig(**FIELDS[family]), **changes)


def looped_params(cfg, seed: int = 0):
  """Every param random, but the RoPE tables: each layer's the one LoopedLM computes (a stored
  table is one buffer in Huginn)."""
  params = random_params(cfg, seed)
  table = np.asarray(layers.rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_base))
  swap = lambda path, x: table if getattr(path[-1], "key", None) == "rope_table" else x
  return jax.tree_util.tree_map_with_path(swap, params)


def export(checkpoint: str, out: str, family: str):
  config = export_config.get_config()
  config.export.checkpoint = checkpoint
  config.export.family = family
  return programs.run(config, out)


class _ReadLog(dict):
  """A config.json dict that records the fields read from it."""

  def __init__(self, *args):
    super().__init__(*args)
    self.read = set()

  def get(self, key, default=None):
    self.read.add(key)
    return super().get(key, default)

  def __getitem__(self, key):
    self.read.add(key)
    return super().__getitem__(key)


def read_fields(family: str, config: dict) -> set[str]:
  """The config.json fields the family's converter reads from `config`."""
  log = _ReadLog(config)
  MODULES[family][0].model_config(log)
  MODULES[family][0].expected_shapes(log)
  return log.read


class ExportLoopedTest(testing.TempDirTestCase):
  def test_converted_tiny_folders_export_back_bit_for_bit(self):
    for family in ("huginn", "ouro"):
      source = os.path.join(_TESTDATA, f"{family}_tiny")
      cfg, params = convert(source, os.path.join(self.tmp, family))
      out = os.path.join(self.tmp, f"{family}_out")
      written = export(os.path.join(self.tmp, family), out, "auto")  # Picked by model.injection.
      self.assertEqual(written["family"].lower(), family)
      want, got = folder_tensors(source), folder_tensors(out)
      self.assertEqual(sorted(got), sorted(want), family)
      self.assertEqual(bit_differences(want, got), [], family)
      path = os.path.join(out, "pytorch_model.bin")  # The same bits in torch.save's layout.
      from_bin = torch_bin.load(path, torch_bin.read_index(path))
      self.assertEqual(sorted(from_bin), sorted(want), family)
      self.assertEqual(bit_differences(want, from_bin), [], family)
      with open(os.path.join(source, "config.json")) as f:
        theirs = json.load(f)
      with open(os.path.join(out, "config.json")) as f:
        mine = json.load(f)
      fields = read_fields(family, theirs)
      self.assertGreater(len(fields), 10, family)
      self.assertEqual({k: mine.get(k) for k in fields}, {k: theirs.get(k) for k in fields})
      self.assertEqual(read_fields(family, mine) - fields, set(), family)
      for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(out, name)) as a, open(os.path.join(source, name)) as b:
          self.assertEqual(a.read(), b.read(), name)
      if family == "huginn":  # The round trip sees the mapping: no RoPE row permutation breaks it.
        hf = huginn_export.check(cfg)
        identity = lambda h: np.arange(h)
        with mock.patch.object(huginn_export, "_inverse_half_rotation", identity):
          broken = huginn_export.to_tensors(params, cfg, hf)
        self.assertIn("transformer.core_block.0.attn.Wqkv.weight", bit_differences(want, broken))
        self.assertIn("transformer.prelude.0.attn.qk_bias", bit_differences(want, broken))

  def test_converted_bfloat16_folders_export_their_values(self):
    # The params are float32 after convert; the export holds the bfloat16 values widened.
    for family in ("huginn", "ouro"):
      source = os.path.join(_TESTDATA, f"{family}_tiny_bf16")
      convert(source, os.path.join(self.tmp, family))
      out = os.path.join(self.tmp, f"{family}_out")
      export(os.path.join(self.tmp, family), out, family)
      want, got = folder_tensors(source), folder_tensors(out)
      self.assertEqual(sorted(got), sorted(want), family)
      self.assertEqual({str(x.dtype) for x in want.values()}, {"bfloat16"}, family)
      widened = {name: x.astype(np.float32) for name, x in want.items()}
      self.assertEqual(bit_differences(widened, got), [], family)

  def test_looped_models_round_trip(self):
    for family in ("huginn", "ouro"):
      cfg = tiny_cfg(family)
      params = looped_params(cfg, seed=3)
      write_checkpoint(os.path.join(self.tmp, family), cfg, params)
      out = os.path.join(self.tmp, f"{family}_out")
      export(os.path.join(self.tmp, family), out, family)
      back_cfg, back = convert(out, os.path.join(self.tmp, f"{family}_back"))
      self.assertEqual(back_cfg, cfg)
      want = dict(jax.tree_util.tree_leaves_with_path(params))
      got = dict(jax.tree_util.tree_leaves_with_path(back))
      self.assertEqual(
        sorted(map(jax.tree_util.keystr, got)), sorted(map(jax.tree_util.keystr, want))
      )
      for path, x in want.items():
        np.testing.assert_array_equal(np.asarray(got[path]), x, jax.tree_util.keystr(path))
      ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
      apply = jax.jit(LoopedLM(cfg).apply)
      np.testing.assert_array_equal(apply(back, ids)[0], apply(params, ids)[0])

  def test_huginn_model_computing_its_angles_gets_their_table(self):
    # rope_table=False (a model trained by looped): freqs_cis is the table of the angles LoopedLM
    # computes; converted back, the model reads it and rotates as the original did.
    cfg = tiny_cfg("huginn", rope_table=False, tie_embeddings=True, qk_bias=False)
    write_checkpoint(os.path.join(self.tmp, "ckpt"), cfg, looped_params(cfg, seed=4))
    out = os.path.join(self.tmp, "out")
    export(os.path.join(self.tmp, "ckpt"), out, "huginn")
    table = folder_tensors(out)["freqs_cis"]
    self.assertEqual(table.shape, (1, 32, 1, 8, 2))
    angles = np.arange(32)[:, None] * 50000.0 ** (-np.arange(8) / 8)  # float64, by hand
    np.testing.assert_allclose(table[0, :, 0, :, 0], np.cos(angles), atol=1e-5)
    np.testing.assert_allclose(table[0, :, 0, :, 1], np.sin(angles), atol=1e-5)
    back_cfg, back = convert(out, os.path.join(self.tmp, "back"))
    self.assertEqual(back_cfg, dataclasses.replace(cfg, rope_table=True))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 32, 2, 16)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(32), (2, 32))
    stored = back["params"]["coda_0"]["attn"]["rope_table"]
    np.testing.assert_allclose(
      layers.rope(x, positions, 50000.0, stored), layers.rope(x, positions, 50000.0), atol=1e-6
    )

  def test_what_a_family_cannot_express_is_refused_naming_the_field(self):
    cases = {
      "huginn": {  # One per category: MLP, injection, mixers, norms, GQA, head width, h_0 ...
        "mlp_type": {"mlp_type": "relu2"},
        "injection": {"injection": "diagonal"},
        "prelude_mixers": {"prelude_mixers": ("mla",)},
        "core_mixers": {"core_mixers": ("kda",)},
        "block_norm": {"block_norm": "sandwich"},
        "core_out_norm": {"core_out_norm": "none"},
        "prelude_norm": {"prelude_norm": True},
        "qk_norm": {"qk_norm": True},
        "exit_gate": {"exit_gate": True},
        "core_out_proj": {"core_out_proj": True},
        "value_embed_layers": {"value_embed_layers": (1,)},
        "embed_scale": {"embed_scale": 1.0},
        "norm_eps": {"norm_eps": 1e-5},
        "num_kv_heads": {"num_kv_heads": 1},
        "head_dim": {"head_dim": 8},
        "state_init": {"state_init": "embed"},
        "state_init_std": {"state_init": "like_init", "state_init_std": 0.02},
      },
      "ouro": {
        "num_prelude_layers": {"num_prelude_layers": 1},
        "num_coda_layers": {"num_coda_layers": 1},
        "injection": {"injection": "linear"},
        "state_init": {"state_init": "zeros"},
        "mlp_type": {"mlp_type": "relu2"},
        "block_norm": {"block_norm": "pre"},
        "core_out_norm": {"core_out_norm": "none"},
        "exit_gate": {"exit_gate": False},
        "prelude_norm": {"prelude_norm": True},
        "qk_norm": {"qk_norm": True},
        "qk_bias": {"qk_bias": True},
        "core_out_proj": {"core_out_proj": True},
        "value_embed_layers": {"value_embed_layers": (0,)},
        "embed_scale": {"embed_scale": 2.0},
        "rope_table": {"rope_table": True},
        "norm_eps": {"norm_eps": 1e-5},
        "core_mixers": {"core_mixers": ("gqa", "mla")},
      },
    }
    for family, by_field in cases.items():
      module = MODULES[family][1]
      module.check(tiny_cfg(family))  # The base model is expressed.
      for name, changes in by_field.items():
        with self.assertRaises(config_checks.ConfigError, msg=f"{family} {name}") as e:
          module.check(tiny_cfg(family, **changes))
        line = str(e.exception)
        self.assertTrue(line.startswith(f"model.{name} = "), line)
        self.assertIn(f"cannot be exported to {module.FAMILY}", line)
        self.assertNotIn("\n", line)
    # What they express is not refused: Huginn's like-init std and tied embeddings; Ouro's
    # head width d_model / num_heads without GQA.
    std = math.sqrt(2 / (5 * 32)) * math.sqrt(32)
    huginn_export.check(tiny_cfg("huginn", state_init="like_init", state_init_std=std))
    huginn_export.check(tiny_cfg("huginn", tie_embeddings=True, qk_bias=False))
    ouro_export.check(tiny_cfg("ouro", num_kv_heads=4, head_dim=8, tie_embeddings=False))
    # Huginn stores one RoPE table: per-layer tables that differ are refused naming the param.
    cfg = tiny_cfg("huginn")
    params = looped_params(cfg)
    params["params"]["coda_0"]["attn"]["rope_table"] = params["params"]["coda_0"]["attn"][
      "rope_table"
    ].copy()
    params["params"]["coda_0"]["attn"]["rope_table"][3, 0, 0] += 1e-3
    with self.assertRaises(config_checks.ConfigError) as e:
      huginn_export.check_params(params, cfg)
    self.assertIn("params coda_0/attn/rope_table differs from prelude_0's", str(e.exception))
    # export.family='auto' picks the family by model.injection, and refuses one none has.
    for injection, module in (("linear", huginn_export), ("none", ouro_export)):
      self.assertIs(export_lib.exporter("auto", tiny_cfg("huginn", injection=injection)), module)
    with self.assertRaises(config_checks.ConfigError) as e:
      export_lib.exporter("auto", tiny_cfg("huginn", injection="additive"))
    self.assertTrue(str(e.exception).startswith("model.injection = 'additive' cannot be"))

  def test_refusal_comes_before_any_file_is_written(self):
    cfg = tiny_cfg("ouro", exit_gate=False)
    write_checkpoint(os.path.join(self.tmp, "ckpt"), cfg, random_params(cfg))
    out = os.path.join(self.tmp, "out")
    with self.assertRaises(config_checks.ConfigError) as e:
      export(os.path.join(self.tmp, "ckpt"), out, "ouro")
    self.assertIn("model.exit_gate = False cannot be exported to Ouro", str(e.exception))
    self.assertFalse(os.path.exists(os.path.join(out, "config.json")))
