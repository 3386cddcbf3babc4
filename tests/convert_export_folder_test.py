"""Export folders are clean, for every family: no workdir file (`.lock`) beside the export's, every
file 0644 whatever the umask, config.json naming the checkpoint's bos/eos/pad ids (Parcae's in its
free-form `hf_config`, the only place its loaders accept) and the weights' dtype, export.dtype
casting the weights (float32 or bfloat16; the looped family keeps looped's float32-only params),
Parcae's special_tokens_map.json and a chat_template.jinja kept through convert (where the server
reads the template) and export, and a Parcae config.json key ParcaeConfig lacks refused in one
line naming it. The looped family (export.family=looped, and
what 'auto' writes when no public family expresses the model): its folder converts back to the
same model record, identical params and the same greedy tokens, sharded or not; its bytes
tokenizer file gives looped's byte ids; its modeling code is copied verbatim and knows every
model field. transformers running the folder is tests/convert_hf_looped_test.py's."""

import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import ml_collections
import ml_dtypes
import numpy as np
from convert_export_looped_test import looped_params
from convert_export_looped_test import tiny_cfg as public_cfg
from convert_export_test import TINY, convert, folder_tensors, random_params
from convert_export_test import tiny_cfg as parcae_cfg

import looped_testing as testing
from configs import export as export_config
from looped import config_checks, programs
from looped.checkpoints import checkpointing, model_record
from looped.convert import export as export_lib
from looped.convert import looped_export, looped_family, parcae, tokenizer_files, torch_bin
from looped.data import tokenizers
from looped.model import LoopedLM
from looped.model import config as model_lib
from looped.model.kv_cache import init_cache
from looped.server import chat

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# parcae_tiny's tokenizer_config.json names these; their ids in its tokenizer.json.
NAMED = {
  "bos_token_id": "<|begin_text|>",
  "eos_token_id": "<|end_text|>",
  "pad_token_id": "<|pad|>",
}
LOOPED = dataclasses.replace(testing.TINY_MODEL, vocab_size=320, max_seq_len=32)


def checkpoint(workdir: str, cfg, params, tokenizer: str = "huggingface") -> str:
  """A checkpoint as the trainer (bytes) or convert (parcae_tiny's tokenizer.json and
  tokenizer_config.json) leaves one."""
  fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
  os.makedirs(workdir)
  data = {"tokenizer": "bytes"}
  if tokenizer == "huggingface":
    for name in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copyfile(os.path.join(TINY, name), os.path.join(workdir, name))
    data = {"tokenizer": "huggingface", "tokenizer_json": os.path.join(workdir, "tokenizer.json")}
  model_record.write(workdir, model_record.make(ml_collections.ConfigDict(fields), data))
  checkpointing.save_params(workdir, 0, params)
  return workdir


def export(source: str, out: str, family: str, **fields) -> dict:
  config = export_config.get_config()
  config.export.checkpoint = source
  config.export.family = family
  for key, value in fields.items():
    config.export[key] = value
  return programs.run(config, out)


def read_config(folder: str) -> dict:
  with open(os.path.join(folder, "config.json")) as f:
    return json.load(f)


def greedy(cfg, params, prompt, n: int):
  """Greedy tokens of LoopedLM's token-by-token decoding (unshared cache)."""
  model = LoopedLM(cfg)
  cache = init_cache(cfg, 1, len(prompt) + n, False)
  apply = jax.jit(lambda p, x, c: model.apply(p, x, cache=c))
  logits, aux = apply(params, jnp.asarray([prompt], jnp.int32), cache)
  out = []
  for _ in range(n):
    out.append(int(jnp.argmax(logits[0, -1])))
    logits, aux = apply(params, jnp.asarray([[out[-1]]], jnp.int32), aux["cache"])
  return out


class ExportFolderTest(testing.TempDirTestCase):
  def test_every_family_writes_a_clean_folder_naming_its_token_ids(self):
    import tokenizers as hf_tokenizers

    vocab = hf_tokenizers.Tokenizer.from_file(os.path.join(TINY, "tokenizer.json"))
    ids = {key: vocab.token_to_id(name) for key, name in NAMED.items()}
    self.assertEqual(len(set(ids.values())), 3)  # Three different tokens: each is read.
    models = {
      "parcae": parcae_cfg(),
      "huginn": public_cfg("huginn"),
      "ouro": public_cfg("ouro"),
      "looped": LOOPED,
    }
    previous = os.umask(0o077)  # Files the export did not make 0644 would come out 0600.
    try:
      for family, cfg in models.items():
        params = looped_params(cfg)  # Random, but one RoPE table (Huginn stores one).
        source = checkpoint(os.path.join(self.tmp, family), cfg, params)
        out = os.path.join(self.tmp, f"{family}_out")
        written = export(source, out, family)
        names = sorted(os.listdir(out))
        self.assertEqual(names, sorted(written["files"]), family)  # No .lock, no partial dir.
        modes = {n: oct(os.stat(os.path.join(out, n)).st_mode & 0o777) for n in names}
        self.assertEqual(set(modes.values()), {"0o644"}, (family, modes))
        hf = read_config(out)
        if family == "parcae":  # ParcaeConfig's fields only: its loaders refuse other keys.
          self.assertEqual(set(hf) - parcae.CONFIG_KEYS, set())
          self.assertEqual({k: hf["hf_config"][k] for k in ids}, ids)
        else:
          self.assertEqual({k: hf[k] for k in ids}, ids, family)
          self.assertEqual(hf["torch_dtype"], "float32", family)
    finally:
      os.umask(previous)
    self.assertIn("tokenizer_config.json", os.listdir(os.path.join(self.tmp, "looped_out")))
    # On the command line too: the lock looped.main takes on the workdir does not stay.
    out = os.path.join(self.tmp, "cli_out")
    command = [sys.executable, "-m", "looped.main", "--config=configs/export.py"]
    command += [f"--workdir={out}", f"--config.export.checkpoint={self.tmp}/looped"]
    command += ["--config.export.family=auto"]
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, timeout=600)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertEqual(
      sorted(os.listdir(out)), sorted(os.listdir(os.path.join(self.tmp, "looped_out")))
    )

  def test_parcae_keeps_its_tokenizer_files_and_refuses_unknown_keys(self):
    source = os.path.join(self.tmp, "parcae_tiny")
    shutil.copytree(TINY, source)
    special = {"bos_token": "<|begin_text|>", "eos_token": "<|end_text|>", "pad_token": "<|pad|>"}
    with open(os.path.join(source, "special_tokens_map.json"), "w") as f:
      json.dump(special, f)
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
    with open(os.path.join(source, "chat_template.jinja"), "w") as f:
      f.write(template)
    convert(source, os.path.join(self.tmp, "converted"))
    rendered = chat.from_folder(os.path.join(self.tmp, "converted"))
    self.assertEqual(rendered.source, template)
    out = os.path.join(self.tmp, "out")
    export(os.path.join(self.tmp, "converted"), out, "parcae")
    with open(os.path.join(out, "special_tokens_map.json")) as f:
      self.assertEqual(json.load(f), special)
    with open(os.path.join(out, "chat_template.jinja")) as f:
      self.assertEqual(f.read(), template)
    self.assertEqual(read_config(out)["hf_config"]["eos_token_id"], 2)
    with open(os.path.join(source, "config.json")) as f:
      hf = json.load(f)
    hf["eos_token_id"] = 2  # A key transformers' configs have and ParcaeConfig has not.
    with open(os.path.join(source, "config.json"), "w") as f:
      json.dump(hf, f)
    with self.assertRaises(config_checks.ConfigError) as e:
      convert(source, os.path.join(self.tmp, "refused"))
    line = str(e.exception)
    self.assertTrue(line.startswith("config.json eos_token_id = 2 is not supported"), line)
    self.assertIn("ParcaeConfig has no such field", line)
    self.assertNotIn("\n", line)

  def test_export_dtype_casts_the_weights(self):
    cfg = public_cfg("huginn")
    params = looped_params(cfg, seed=1)
    source = checkpoint(os.path.join(self.tmp, "ckpt"), cfg, params)
    export(source, os.path.join(self.tmp, "f32"), "huginn")
    export(source, os.path.join(self.tmp, "bf16"), "huginn", dtype="bfloat16")
    wide, narrow = (folder_tensors(os.path.join(self.tmp, n)) for n in ("f32", "bf16"))
    self.assertEqual({x.dtype for x in wide.values()}, {np.dtype(np.float32)})
    for name, x in narrow.items():
      self.assertEqual(x.dtype, ml_dtypes.bfloat16, name)
      self.assertEqual(x.tobytes(), wide[name].astype(ml_dtypes.bfloat16).tobytes(), name)
    path = os.path.join(self.tmp, "bf16", "pytorch_model.bin")
    from_bin = torch_bin.load(path, torch_bin.read_index(path))
    self.assertEqual(
      {k: v.tobytes() for k, v in from_bin.items()}, {k: v.tobytes() for k, v in narrow.items()}
    )
    self.assertEqual(read_config(os.path.join(self.tmp, "bf16"))["torch_dtype"], "bfloat16")
    # 'checkpoint' (the default) writes a bfloat16 model as bfloat16; the looped family keeps
    # the params LoopedLM holds in float32 (the injection's decay) float32.
    cfg16 = dataclasses.replace(LOOPED, param_dtype="bfloat16", dtype="bfloat16")
    params16 = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), random_params(LOOPED))
    for scope in ("A_log", "dt"):
      inject = params16["params"]["recurrence"]["inject"]
      inject[scope] = inject[scope].astype(np.float32)
    source = checkpoint(os.path.join(self.tmp, "ckpt16"), cfg16, params16)
    export(source, os.path.join(self.tmp, "looped16"), "looped")
    tensors = folder_tensors(os.path.join(self.tmp, "looped16"))
    wide = {k for k, x in tensors.items() if x.dtype != ml_dtypes.bfloat16}
    self.assertEqual(wide, {"model.recurrence.inject.A_log", "model.recurrence.inject.dt"})
    self.assertEqual(read_config(os.path.join(self.tmp, "looped16"))["torch_dtype"], "bfloat16")

  def test_looped_folders_convert_back_to_the_same_model(self):
    variants = {
      "default": LOOPED,  # Also sharded below.
      "hybrid": dataclasses.replace(
        LOOPED,
        prelude_mixers=("kda",),
        core_mixers=("kda", "mla"),
        coda_mixers=("mla",),
        mla_kv_rank=16,
        mla_q_rank=8,
        mla_rope_dim=8,
        dtype="bfloat16",  # An execution field: recorded and read back too.
      ),
      "huginn-like": dataclasses.replace(
        public_cfg("huginn"), exit_gate=True, value_embed_layers=(0,), value_embed_gate_dim=16
      ),
    }
    for name, cfg in variants.items():
      with self.subTest(name):
        params = random_params(cfg, seed=2)
        source = checkpoint(os.path.join(self.tmp, name), cfg, params, tokenizer="bytes")
        out = os.path.join(self.tmp, f"{name}_out")
        shards = {"max_shard_bytes": 40_000} if name == "default" else {}
        export(source, out, "looped", **shards)
        if shards:
          index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
          self.assertGreater(len(set(index["weight_map"].values())), 2)
          self.assertNotIn("model.safetensors", os.listdir(out))
        back_cfg, back = convert(out, os.path.join(self.tmp, f"{name}_back"))
        self.assertEqual(back_cfg, cfg)
        want = dict(jax.tree_util.tree_leaves_with_path(params))
        got = dict(jax.tree_util.tree_leaves_with_path(back))
        self.assertEqual(
          sorted(map(jax.tree_util.keystr, got)), sorted(map(jax.tree_util.keystr, want))
        )
        for path, x in want.items():
          self.assertEqual(np.asarray(got[path]).tobytes(), np.asarray(x).tobytes(), path)
        if name == "default":
          prompt = [5, 17, 99, 3, 250]
          self.assertEqual(greedy(back_cfg, back, prompt, 6), greedy(cfg, params, prompt, 6))
        # The tokenizer convert reads back is the bytes tokenizer's ids.
        record = model_record.read(os.path.join(self.tmp, f"{name}_back"))
        tok = tokenizers.HuggingFaceTokenizer(record["data"]["tokenizer_json"])
        text = "def f(x):\n\treturn 'é' + x  # ü"
        self.assertEqual(
          tok.encode(text).tolist(), tokenizers.BytesTokenizer().encode(text).tolist()
        )
    # The modeling code is copied verbatim.
    for name in looped_export.MODELING_FILES:
      with open(os.path.join(self.tmp, "default_out", name), "rb") as a:
        with open(os.path.join(looped_export.HERE, name), "rb") as b:
          self.assertEqual(a.read(), b.read(), name)

  def test_bytes_tokenizer_file_gives_looped_byte_ids(self):
    import tokenizers as hf_tokenizers

    names = tokenizer_files.write_bytes_tokenizer(self.tmp, 64)
    self.assertEqual(names, ["tokenizer.json", "tokenizer_config.json"])
    tok = hf_tokenizers.Tokenizer.from_file(os.path.join(self.tmp, "tokenizer.json"))
    ours = tokenizers.BytesTokenizer()
    texts = [
      "hello world",
      "  two  spaces\nand\ttabs\r\n",
      "é ü 中文 🙂",
      "".join(map(chr, range(1, 128))),
    ]
    for text in texts:
      ids = tok.encode(text).ids
      self.assertEqual(ids, ours.encode(text).tolist(), text)
      self.assertEqual(tok.decode(ids), text)
    self.assertEqual(tok.token_to_id(tokenizer_files.BYTES_EOS), tokenizers.BYTES_EOS)
    self.assertEqual(tok.get_vocab_size(), 257)
    hf = tokenizers.HuggingFaceTokenizer(os.path.join(self.tmp, "tokenizer.json"))
    self.assertEqual((hf.eos_id, hf.vocab_size), (256, 257))
    self.assertEqual(tokenizer_files.token_ids({"tokenizer": "bytes"}), dict.fromkeys(NAMED, 256))

  def test_auto_writes_looped_when_no_public_family_expresses_the_model(self):
    default = model_lib.ModelConfig()  # The README's and BeNice!'s model: SwiGLU, diagonal.
    self.assertIs(export_lib.choose("auto", default), looped_export)
    self.assertIs(export_lib.choose("auto", parcae_cfg()), export_lib.parcae_export)
    with self.assertRaises(config_checks.ConfigError):
      export_lib.choose("parcae", default).check(default)
    # A Parcae-shaped model with learned QK-norm scales: refused by Parcae after the restore,
    # so 'auto' writes it as looped.
    cfg = parcae_cfg()
    params = random_params(cfg)
    params["params"]["coda_0"]["attn"]["key_norm"]["scale"] *= 2
    source = checkpoint(os.path.join(self.tmp, "ckpt"), cfg, params)
    self.assertEqual(export(source, os.path.join(self.tmp, "out"), "auto")["family"], "looped")

  def test_modeling_code_knows_every_model_field(self):
    fields = [f.name for f in dataclasses.fields(model_lib.ModelConfig)]
    self.assertEqual(sorted(looped_export.MODEL_FIELDS), sorted(fields))
    with open(os.path.join(looped_export.HERE, "configuration_looped.py")) as f:
      tree = ast.parse(f.read())
    assigned = {
      node.targets[0].id: ast.literal_eval(node.value)
      for node in tree.body
      if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    renamed = [looped_family.RENAMED.get(f, f) for f in fields]
    self.assertEqual(sorted(assigned["MODEL_FIELDS"]), sorted(renamed))
    # A field the modeling code does not know, or a mixer it does not compute: one line.
    known = tuple(f for f in looped_export.MODEL_FIELDS if f != "exit_gate")
    with mock.patch.object(looped_export, "MODEL_FIELDS", known):
      looped_export.check(LOOPED)  # exit_gate at its default: nothing to compute.
      with self.assertRaises(config_checks.ConfigError) as e:
        looped_export.check(dataclasses.replace(LOOPED, exit_gate=True))
    self.assertTrue(str(e.exception).startswith("model.exit_gate = True cannot be exported to"))
    with mock.patch.object(looped_export, "MIXERS", ("gqa", "mla")):
      with self.assertRaises(config_checks.ConfigError) as e:
        looped_export.check(dataclasses.replace(LOOPED, core_mixers=("kda", "gqa")))
    self.assertTrue(str(e.exception).startswith("model.core_mixers = ('kda', 'gqa') cannot be"))
    self.assertNotIn("\n", str(e.exception))


if __name__ == "__main__":
  from absl.testing import absltest

  absltest.main()
