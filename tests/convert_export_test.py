"""Export (looped checkpoint -> Parcae folder) inverts convert exactly: the tiny Parcae folder
written by Parcae's public code, converted and exported, gives back its tensors bit for bit
(all but the RoPE buffer freqs_cis, which the public code recomputes); a random looped model with
Parcae's fields, exported and converted back, has identical params and logits; a mapping with
the RoPE row permutation skipped fails the first comparison; what Parcae cannot express is
refused in one line naming the model field, and an export that fails leaves no config.json."""

import dataclasses
import math
import os
import shutil
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

import looped_testing as testing
from configs import convert as convert_config
from configs import export as export_config
from looped import config_checks, programs
from looped.checkpoints import checkpointing, model_record
from looped.convert import hf_folder, parcae_export, torch_bin, torch_save
from looped.model import LoopedLM, from_config, init_params
from looped.model import config as model_lib

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(_REPO, "tests", "testdata", "parcae_tiny")
FILES = ["config.json", "model.safetensors", "pytorch_model.bin"]
NOT_KEPT = ("freqs_cis",)  # The RoPE table buffer: recomputed by the public code at load.

# A tiny looped model with the fields Parcae implies (value embeddings on layers 1 and 3 of 4:
# Parcae's rule at mean_backprop_depth 2; untied head; zero h_0 so logits are deterministic).
PARCAE_FIELDS = dict(
  vocab_size=320,  # >= the tiny tokenizer's ids (copied into every checkpoint here)
  d_model=32,
  num_heads=2,
  num_kv_heads=2,
  head_dim=16,
  mlp_dim=48,
  mlp_type="relu2",
  num_prelude_layers=1,
  num_core_layers=2,
  num_coda_layers=1,
  num_recurrences=3,
  injection="diagonal",
  state_init="zeros",
  state_init_std=math.sqrt(2 / (5 * 32)),  # Parcae's (converted back for any state_init)
  prelude_norm=True,
  qk_norm=True,
  rope_base=50000.0,
  tie_embeddings=False,
  max_seq_len=32,
  norm_eps=1e-5,
  qk_norm_eps=float(np.finfo(np.float32).eps),
  value_embed_layers=(1, 3),
  core_out_proj=True,
)


def tiny_cfg(**changes) -> model_lib.ModelConfig:
  return dataclasses.replace(model_lib.ModelConfig(**PARCAE_FIELDS), **changes)


def random_params(cfg, seed: int = 0):
  """Every param random (not LoopedLM's init, which zeroes some), QK-norm scales at 1 (Parcae's
  QK-norm has no weight)."""
  abstract = jax.eval_shape(
    lambda: init_params(LoopedLM(cfg), jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
  )
  leaves, tree = jax.tree_util.tree_flatten_with_path(abstract)
  rng = np.random.default_rng(seed)
  out = []
  for path, x in leaves:
    name = jax.tree_util.keystr(path)
    if "query_norm" in name or "key_norm" in name:
      out.append(np.ones(x.shape, np.float32))
    else:
      out.append((0.5 * rng.standard_normal(x.shape)).astype(np.float32))
  return jax.tree_util.tree_unflatten(tree, out)


def write_checkpoint(workdir: str, cfg, params) -> None:
  """A looped checkpoint directory as the trainer leaves one: the record (with a Hugging Face
  tokenizer), then the params."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  os.makedirs(workdir)
  shutil.copyfile(os.path.join(TINY, "tokenizer.json"), os.path.join(workdir, "tokenizer.json"))
  data = {"tokenizer": "huggingface", "tokenizer_json": os.path.join(workdir, "tokenizer.json")}
  model_record.write(workdir, model_record.make(ml_collections.ConfigDict(fields), data))
  checkpointing.save_params(workdir, 0, params)


def export(checkpoint: str, out: str):
  config = export_config.get_config()
  config.export.checkpoint = checkpoint
  return programs.run(config, out)


def convert(source: str, out: str):
  """(ModelConfig, params) of the folder converted by the convert program."""
  config = convert_config.get_config()
  config.convert.source = source
  programs.run(config, out)
  fields = model_record.read(out)["model"]
  model_cfg = ml_collections.ConfigDict(
    {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
  )
  return from_config(model_cfg), testing.saved_params(model_cfg, out)


def folder_tensors(path: str) -> dict:
  folder = hf_folder.open_folder(path)
  return hf_folder.load(folder, sorted(folder.shards))


def bit_differences(want: dict, got: dict) -> list[str]:
  """Names whose arrays differ in dtype, shape or any bit."""
  out = []
  for name in sorted(want.keys() & got.keys()):
    a, b = want[name], got[name]
    same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if not same:
      out.append(name)
  return out


class ExportTest(testing.TempDirTestCase):
  def test_converted_parcae_exports_back_bit_for_bit(self):
    cfg, params = convert(TINY, os.path.join(self.tmp, "tiny"))
    out = os.path.join(self.tmp, "exported")
    export(os.path.join(self.tmp, "tiny"), out)
    want, got = folder_tensors(TINY), folder_tensors(out)
    self.assertEqual(sorted(want.keys() - got.keys()), list(NOT_KEPT))
    self.assertEqual(sorted(got.keys() - want.keys()), [])
    self.assertEqual(bit_differences(want, got), [])
    # pytorch_model.bin (what the public code's from_pretrained reads) holds the same bits.
    path = os.path.join(out, hf_folder.TORCH_BIN)
    from_bin = torch_bin.load(path, torch_bin.read_index(path))
    self.assertEqual(sorted(from_bin), sorted(got))
    self.assertEqual(bit_differences(want, from_bin), [])
    self.assertEqual(
      sorted(n for n in os.listdir(out) if not n.startswith(".")),
      sorted(FILES + ["tokenizer.json", "tokenizer_config.json"]),
    )
    self.assertEqual(
      open(os.path.join(out, "tokenizer.json")).read(),
      open(os.path.join(TINY, "tokenizer.json")).read(),
    )
    # The exported config.json converts to the same model.
    again = convert(out, os.path.join(self.tmp, "again"))[0]
    self.assertEqual(again, cfg)
    # The round trip sees the mapping: skipping the RoPE row permutation breaks it.
    hf = parcae_export.check(cfg)
    identity = lambda h: np.arange(h)
    with mock.patch.object(parcae_export, "_inverse_half_rotation", identity):
      broken = parcae_export.to_tensors(params, cfg, hf)
    self.assertIn("transformer.core_block.0.attn.c_q.weight", bit_differences(want, broken))
    self.assertEqual(bit_differences(want, parcae_export.to_tensors(params, cfg, hf)), [])

  def test_looped_model_round_trips_through_parcae(self):
    cfg = tiny_cfg()
    params = random_params(cfg)
    write_checkpoint(os.path.join(self.tmp, "ckpt"), cfg, params)
    out = os.path.join(self.tmp, "exported")
    export(os.path.join(self.tmp, "ckpt"), out)
    self.assertEqual(
      sorted(n for n in os.listdir(out) if not n.startswith(".")), FILES + ["tokenizer.json"]
    )
    back_cfg, back = convert(out, os.path.join(self.tmp, "back"))
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

  def test_what_parcae_cannot_express_is_refused_naming_the_field(self):
    eps = float(np.finfo(np.float32).eps)
    cases = {  # One per category: MLP, injection, mixer, GQA, head width, state init, norms ...
      "mlp_type": {"mlp_type": "swiglu"},
      "injection": {"injection": "linear"},
      "core_mixers": {"core_mixers": ("mla",)},
      "coda_mixers": {"coda_mixers": ("kda",)},
      "num_kv_heads": {"num_kv_heads": 1},
      "head_dim": {"head_dim": 8},
      "state_init": {"state_init": "embed"},
      "state_init_std": {"state_init": "like_init", "state_init_std": 0.02},
      "block_norm": {"block_norm": "sandwich"},
      "core_out_norm": {"core_out_norm": "final"},
      "exit_gate": {"exit_gate": True},
      "qk_bias": {"qk_bias": True},
      "embed_scale": {"embed_scale": 2.0},
      "rope_base": {"rope_base": 10000.0},
      "qk_norm_eps": {"qk_norm_eps": 2 * eps},
      "value_embed_gate_dim": {"value_embed_gate_dim": 16},
      "value_embed_layers": {"value_embed_layers": (0, 1)},
    }
    for name, changes in cases.items():
      with self.assertRaises(config_checks.ConfigError, msg=name) as e:
        parcae_export.check(tiny_cfg(**changes))
      line = str(e.exception)
      self.assertTrue(line.startswith(f"model.{name} = "), line)
      self.assertIn("cannot be exported to Parcae", line)
      self.assertNotIn("\n", line)
    # What Parcae expresses is not refused: its like-init std, no prelude norm or QK-norm, tied
    # embeddings, no core_out_proj (C = identity), fewer value embeddings (zero tables).
    std = float(np.sqrt(2 / (5 * 32)))
    for changes in (
      {"state_init": "like_init", "state_init_std": std},
      {"prelude_norm": False, "qk_norm": False, "tie_embeddings": True},
      {"core_out_proj": False, "value_embed_layers": (3,)},
    ):
      parcae_export.check(tiny_cfg(**changes))
    # Learned QK-norm scales: Parcae's QK-norm has no weight.
    cfg = tiny_cfg()
    params = random_params(cfg)
    params["params"]["coda_0"]["attn"]["key_norm"]["scale"] *= 2
    with self.assertRaises(config_checks.ConfigError) as e:
      parcae_export.check_params(params, cfg)
    self.assertIn("params coda_0/attn/key_norm/scale is not all ones", str(e.exception))

  def test_neutral_values_where_the_model_has_no_part(self):
    # No core_out_proj and one value embedding fewer than Parcae's rule: C = identity, zero
    # tables and gates; converted back, the logits are the model's.
    cfg = tiny_cfg(core_out_proj=False, value_embed_layers=(3,), tie_embeddings=True)
    params = random_params(cfg, seed=2)
    write_checkpoint(os.path.join(self.tmp, "ckpt"), cfg, params)
    out = os.path.join(self.tmp, "exported")
    export(os.path.join(self.tmp, "ckpt"), out)
    t = folder_tensors(out)
    np.testing.assert_array_equal(t["transformer.C.weight"], np.eye(32, dtype=np.float32))
    self.assertFalse(t["value_embeds.1.weight"].any())
    self.assertFalse(t["transformer.core_block.0.attn.ve_gate.weight"].any())
    back_cfg, back = convert(out, os.path.join(self.tmp, "back"))
    ids = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    got = jax.jit(LoopedLM(back_cfg).apply)(back, ids)[0]
    want = jax.jit(LoopedLM(cfg).apply)(params, ids)[0]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

  def test_refusals_on_the_command_line_and_no_half_written_folder(self):
    cfg = tiny_cfg(mlp_type="swiglu")
    ckpt = os.path.join(self.tmp, "swiglu")
    write_checkpoint(ckpt, cfg, random_params(cfg))
    out = os.path.join(self.tmp, "out")
    done = subprocess.run(
      [
        sys.executable,
        "-m",
        "looped.main",
        "--config=configs/export.py",
        f"--workdir={out}",
        f"--config.export.checkpoint={ckpt}",
      ],
      cwd=_REPO,
      capture_output=True,
      text=True,
      timeout=600,
    )
    self.assertEqual(done.returncode, 2, done.stderr)
    lines = done.stderr.strip().splitlines()
    self.assertEqual(len(lines), 1, done.stderr)
    self.assertIn("model.mlp_type = 'swiglu' cannot be exported to Parcae", lines[0])
    self.assertFalse(os.path.exists(os.path.join(out, "config.json")))
    # A failure while writing (here the .bin) leaves no config.json; a rerun then succeeds.
    cfg = tiny_cfg()
    ckpt = os.path.join(self.tmp, "ckpt")
    write_checkpoint(ckpt, cfg, random_params(cfg))
    with mock.patch.object(torch_save, "save", side_effect=OSError("disk full")):
      with self.assertRaises(OSError):
        export(ckpt, out)
    self.assertFalse(os.path.exists(os.path.join(out, "config.json")))
    export(ckpt, out)
    self.assertEqual(
      sorted(n for n in os.listdir(out) if not n.startswith(".")), FILES + ["tokenizer.json"]
    )
    with self.assertRaises(config_checks.ConfigError) as e:  # Not over an export.
      export(ckpt, out)
    self.assertIn("is not empty", str(e.exception))
