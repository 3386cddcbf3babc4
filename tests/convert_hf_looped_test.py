"""The looped family (export.family=looped) in transformers: the exported folder loads with
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` (this project's modeling
code, looped/convert/hf_looped, no missing or unexpected weight) and computes LoopedLM's logits
within 1e-5 relative (float32) for every mixer and layout: GQA (QK-norm or QK bias and a stored
RoPE table, value embeddings), MLA, KDA and a KDA + MLA hybrid; every injection, block norm and
core-output norm; in parallel and through its cache, unshared and shared (token by token, block
prefill, KV policies caching several recurrences), at the recorded R and another. Padded rows
compute as each row alone; generate() greedy gives the tokens of looped's own decoding and of the
generation program (configs/generate.py); a bfloat16 export stays bfloat16 and matches the
bfloat16 model. A transposed weight or a shared cache that keeps the wrong recurrence fails the
comparison. Needs the optional extra (pip install -e '.[hf]': torch and transformers); the
folder itself, the round trip back and the other families are tests/convert_export_folder_test.py's.
"""

import dataclasses
import json
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl.testing import absltest
from convert_export_test import folder_tensors, random_params, write_checkpoint

import looped_testing as testing
from configs import export as export_config
from configs import generate as generate_config
from looped import config_checks, programs
from looped.convert import looped_export, looped_family
from looped.data import tokenizers
from looped.model import LoopedLM, init_params, kv_policy, layers
from looped.model.kv_cache import init_cache

try:
  import torch
  import transformers

  transformers.utils.logging.disable_progress_bar()
  _HAVE_HF = True
except ImportError:
  _HAVE_HF = False

TOLERANCE = 1e-5  # Max |transformers - looped| over max |looped|, float32.
BF16_TOLERANCE = 2**-5  # The same in bfloat16: a few units of its last place (8 bits).

# The tiny test model (P/B/C 1/2/1, R 3, 4 query and 2 KV heads of 8) with the parcae_tiny
# tokenizer's ids (write_checkpoint records it). Each variant is a mixer and layout.
BASE = dataclasses.replace(testing.TINY_MODEL, vocab_size=320, max_seq_len=32)
MLA = dict(mla_kv_rank=16, mla_rope_dim=8)
VARIANTS = {
  # The default model (README, BeNice!): diagonal injection, SwiGLU, QK-norm, like_init, tied.
  "gqa default": {},
  "gqa huginn-like": dict(
    injection="linear",
    block_norm="post",
    core_out_norm="final",
    qk_norm=False,
    qk_bias=True,
    rope_table=True,
    embed_scale=2.0,
    tie_embeddings=False,
    state_init="zeros",
    prelude_norm=False,
  ),
  "gqa parcae-like": dict(
    mlp_type="relu2", value_embed_layers=(1, 3), value_embed_gate_dim=16, core_out_proj=True
  ),
  "gqa ouro-like": dict(
    num_prelude_layers=0,
    num_coda_layers=0,
    injection="none",
    state_init="embed",
    block_norm="sandwich",
    core_out_norm="every",
    exit_gate=True,
    prelude_norm=False,
  ),
  "mla": dict(prelude_mixers=("mla",), core_mixers=("mla",), coda_mixers=("mla",), **MLA),
  "mla low-rank query": dict(core_mixers=("mla",), mla_q_rank=12, injection="additive", **MLA),
  # h_0 zeros: looped's own decode of an all-KDA model (no per-token cache) draws like_init's
  # noise for positions below the chunk's length only, unlike its parallel forward.
  "kda": dict(
    prelude_mixers=("kda",), core_mixers=("kda",), coda_mixers=("kda",), state_init="zeros"
  ),
  "hybrid kda + mla": dict(
    prelude_mixers=("kda",), core_mixers=("kda", "mla"), coda_mixers=("kda",), **MLA
  ),
}


def relative_error(ours, reference) -> float:
  ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
  return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def visible_params(cfg, seed: int = 0):
  """Random params of a visible scale (0.2 N(0, 1); norm scales 0.5 N(0, 1), QK-norm ones) and
  LoopedLM's own RoPE table where the model stores one."""
  params = random_params(cfg, seed)
  table = np.asarray(layers.rope_table(cfg.max_seq_len, cfg.head_dim, cfg.rope_base))

  def fix(path, x):
    name = jax.tree_util.keystr(path)
    if "rope_table" in name:
      return table
    return x if "norm" in name else 0.4 * x

  return jax.tree_util.tree_map_with_path(fix, params)


def export(cfg, params, directory: str, **fields) -> str:
  """The folder export.family=looped writes for a checkpoint of (cfg, params)."""
  write_checkpoint(directory + "_ckpt", cfg, params)
  config = export_config.get_config()
  config.export.checkpoint = directory + "_ckpt"
  config.export.family = "looped"
  for key, value in fields.items():
    config.export[key] = value
  programs.run(config, directory)
  return directory


def load(folder: str, dtype=None):
  """The folder through transformers' auto classes; fails on a missing or unexpected weight."""
  kwargs = {"dtype": dtype} if dtype is not None else {}
  model, info = transformers.AutoModelForCausalLM.from_pretrained(
    folder, trust_remote_code=True, output_loading_info=True, **kwargs
  )
  assert not info["missing_keys"] and not info["unexpected_keys"], info
  return model.eval()


def looped_chunks(cfg, params, ids, chunks, share_kv, policy="final"):
  """LoopedLM's decode logits of `ids` fed in `chunks` ((start, end); each call one block)."""
  model = LoopedLM(cfg)
  cache = init_cache(cfg, ids.shape[0], ids.shape[1], share_kv, None, None, policy)
  apply = jax.jit(lambda p, x, c: model.apply(p, x, cache=c))
  out = []
  for start, end in chunks:
    logits, aux = apply(params, jnp.asarray(ids[:, start:end], jnp.int32), cache)
    cache = aux["cache"]
    out.append(np.asarray(logits))
  return np.concatenate(out, 1)


def torch_chunks(model, ids, chunks, **options):
  """The transformers model's logits of `ids` fed in `chunks` through its cache."""
  cache, out = None, []
  with torch.no_grad():
    for start, end in chunks:
      o = model(
        torch.tensor(ids[:, start:end]),
        past_key_values=cache,
        use_cache=True,
        prefill_block=0,
        **options,
      )
      cache = o.past_key_values
      out.append(o.logits.numpy())
  return np.concatenate(out, 1)


def torch_logits(model, ids, **options):
  with torch.no_grad():
    return model(torch.tensor(ids), **options).logits.numpy()


def looped_greedy(cfg, params, prompt, n: int, share_kv: bool, block: int):
  """Greedy tokens of LoopedLM's own decoding: the prompt in blocks of `block` positions, then
  one token per call (what the generation engine computes)."""
  model = LoopedLM(cfg)
  cache = init_cache(cfg, 1, len(prompt) + n, share_kv)
  apply = jax.jit(lambda p, x, c: model.apply(p, x, cache=c))
  for start in range(0, len(prompt), block):
    chunk = jnp.asarray([prompt[start : start + block]], jnp.int32)
    logits, aux = apply(params, chunk, cache)
    cache = aux["cache"]
  out = []
  for _ in range(n):
    out.append(int(jnp.argmax(logits[0, -1])))
    logits, aux = apply(params, jnp.asarray([[out[-1]]], jnp.int32), cache)
    cache = aux["cache"]
  return out


def modeling_module(model):
  """The modeling_looped module transformers imported from the folder."""
  return sys.modules[type(model).__module__]


@absltest.skipUnless(_HAVE_HF, "needs the optional extra: pip install -e '.[hf]'")
class HfLoopedTest(testing.TempDirTestCase):
  def test_logits_match_looped_for_every_mixer_and_layout(self):
    ids = np.random.default_rng(1).integers(0, BASE.vocab_size, (2, 8))
    chunks = [(0, 3)] + [(t, t + 1) for t in range(3, 8)]  # A prompt, then token by token.
    for i, (name, changes) in enumerate(VARIANTS.items()):
      with self.subTest(name):
        cfg = dataclasses.replace(BASE, **changes)
        params = visible_params(cfg, seed=i)
        model = load(export(cfg, params, os.path.join(self.tmp, f"v{i}")), torch.float32)
        deeper = dataclasses.replace(cfg, num_recurrences=cfg.num_recurrences + 1)
        parallel = np.asarray(LoopedLM(cfg).apply(params, jnp.asarray(ids, jnp.int32))[0])
        errors = {
          "parallel": relative_error(torch_logits(model, ids), parallel),
          "parallel R'": relative_error(
            torch_logits(model, ids, num_recurrences=deeper.num_recurrences),
            LoopedLM(deeper).apply(params, jnp.asarray(ids, jnp.int32))[0],
          ),
        }
        shared = looped_chunks(cfg, params, ids, chunks, True)
        for share in (False, True):
          want = shared if share else looped_chunks(cfg, params, ids, chunks, False)
          got = torch_chunks(model, ids, chunks, share_kv=share)
          errors[f"decode share_kv={share}"] = relative_error(got, want)
        got = torch_chunks(
          model, ids, chunks, share_kv=True, num_recurrences=deeper.num_recurrences
        )
        errors["decode shared R'"] = relative_error(
          got, looped_chunks(deeper, params, ids, chunks, True)
        )
        print(name, {k: f"{v:.1e}" for k, v in errors.items()})
        for what, err in errors.items():
          self.assertLessEqual(err, TOLERANCE, f"{name}: {what}")
        # Sharing changes these models' outputs, so the shared comparison sees its reads.
        self.assertGreater(relative_error(shared, parallel), 100 * TOLERANCE, name)

  def test_kv_policies_block_prefill_and_padded_rows(self):
    cfg = dataclasses.replace(BASE, **VARIANTS["hybrid kda + mla"])
    gqa = BASE
    params, gqa_params = visible_params(cfg, seed=3), visible_params(gqa, seed=4)
    model = load(export(cfg, params, os.path.join(self.tmp, "hybrid")), torch.float32)
    gqa_model = load(export(gqa, gqa_params, os.path.join(self.tmp, "gqa")), torch.float32)
    module = modeling_module(gqa_model)
    for name in (
      "final",
      "first",
      "full",
      "stride2",
      "keep_last2",
      "huginn_mod2",
      "boundaries:1-3",
    ):
      for r in (3, 5):
        try:
          want = kv_policy.parse(name, r).reads
        except config_checks.ConfigError:  # Not a policy for this R: both refuse.
          with self.assertRaises(ValueError):
            module.kv_policy_reads(name, r)
          continue
        self.assertEqual(module.kv_policy_reads(name, r), want, (name, r))
    ids = np.random.default_rng(2).integers(0, BASE.vocab_size, (2, 12))
    chunks = [(0, 4)] + [(t, t + 1) for t in range(4, 12)]
    for policy in ("stride2", "keep_first2", "first"):  # Policies caching 2, 2 and 1 copies.
      got = torch_chunks(gqa_model, ids, chunks, share_kv=True, kv_policy=policy)
      want = looped_chunks(gqa, gqa_params, ids, chunks, True, policy)
      self.assertLessEqual(relative_error(got, want), TOLERANCE, policy)
    # Block prefill: an 11-token chunk in blocks of 4 aligned from 0, then one token.
    blocks = [(0, 4), (4, 8), (8, 11), (11, 12)]
    for m, c, p in ((model, cfg, params), (gqa_model, gqa, gqa_params)):
      with torch.no_grad():
        first = m(torch.tensor(ids[:, :11]), use_cache=True, prefill_block=4)
        rest = m(torch.tensor(ids[:, 11:12]), past_key_values=first.past_key_values)
      got = np.concatenate([first.logits.numpy(), rest.logits.numpy()], 1)
      want = looped_chunks(c, p, ids, blocks, True)
      self.assertLessEqual(relative_error(got, want), TOLERANCE, c.core_mixers)
      self.assertGreater(relative_error(want, looped_chunks(c, p, ids, [(0, 12)], True)), 1e-3)
    # Left-padded rows (3 and 0 pads) compute what each row alone does, in blocks of 4.
    mask = np.ones((2, 11), np.int64)
    mask[0, :3] = 0
    padded = ids[:, :11].copy()
    padded[0, :3] = 0
    with torch.no_grad():
      first = model(
        torch.tensor(padded), attention_mask=torch.tensor(mask), use_cache=True, prefill_block=4
      )
      rest = model(torch.tensor(ids[:, 11:12]), past_key_values=first.past_key_values)
    row0 = np.concatenate([first.logits.numpy()[:1, 3:], rest.logits.numpy()[:1]], 1)
    alone = np.concatenate([ids[:1, 3:11], ids[:1, 11:12]], 1)
    want0 = looped_chunks(cfg, params, alone, [(0, 4), (4, 8), (8, 9)], True)
    self.assertLessEqual(relative_error(row0, want0), TOLERANCE)
    row1 = np.concatenate([first.logits.numpy()[1:], rest.logits.numpy()[1:]], 1)
    want1 = looped_chunks(cfg, params, ids[1:], blocks, True)
    self.assertLessEqual(relative_error(row1, want1), TOLERANCE)

  def test_generate_greedy_equals_looped_decoding_and_the_generation_program(self):
    cfg = dataclasses.replace(BASE, max_seq_len=40)
    params = visible_params(cfg, seed=5)
    folder = export(cfg, params, os.path.join(self.tmp, "gen"))
    model = load(folder, torch.float32)
    with open(os.path.join(folder, "config.json")) as f:
      hf = json.load(f)
    tok = tokenizers.HuggingFaceTokenizer(os.path.join(folder, "tokenizer.json"))
    self.assertEqual(hf["eos_token_id"], tok.eos_id)
    # The generation program's defaults: shared cache, 'final', the prompt in blocks of 32.
    self.assertEqual((hf["share_kv"], hf["kv_policy"], hf["prefill_block"]), (True, "final", 32))
    prompt = [int(t) for t in np.random.default_rng(6).integers(0, 290, 11)]
    for share in (True, False):
      with torch.no_grad():
        out = model.generate(
          torch.tensor([prompt]),
          max_new_tokens=8,
          do_sample=False,
          share_kv=share,
          prefill_block=4,
          eos_token_id=None,
        )
      want = looped_greedy(cfg, params, prompt, 8, share, 4)
      self.assertEqual(out[0, len(prompt) :].tolist(), want, share)
    # EOS ends generate() (config.json's id): the first greedy token made the EOS.
    with torch.no_grad():
      out = model.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=want[0]
      )
    self.assertEqual(out[0, len(prompt) :].tolist(), want[:1])
    # configs/generate.py on the checkpoint: the same greedy tokens as generate() on the folder.
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    text = "The sky is blue and the"
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    self.assertEqual(ids, [int(t) for t in tok.encode(text)])
    self.assertGreater(len(ids), 4)
    config = generate_config.get_config()
    config.gen.checkpoint = folder + "_ckpt"
    config.gen.prompts = text
    config.gen.max_new_tokens = 10
    config.gen.prefill_block = 4
    config.gen.stop_at_eos = False
    config.gen.stream = False
    gen = programs.run(config, os.path.join(self.tmp, "gen_program"))["generations"][0]
    with torch.no_grad():
      out = model.generate(
        torch.tensor([ids]), max_new_tokens=10, do_sample=False, prefill_block=4, eos_token_id=None
      )
    self.assertEqual(out[0, len(ids) :].tolist(), list(gen.tokens))

  def test_bfloat16_export_stays_bfloat16_and_matches_the_bfloat16_model(self):
    cfg16 = dataclasses.replace(BASE, dtype="bfloat16", param_dtype="bfloat16")
    params32 = visible_params(BASE, seed=7)
    abstract = jax.eval_shape(
      lambda: init_params(LoopedLM(cfg16), jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    )
    params16 = jax.tree.map(lambda x, a: jnp.asarray(x, a.dtype), params32, abstract)
    folder = export(cfg16, params16, os.path.join(self.tmp, "bf16"))
    wide = export(BASE, params32, os.path.join(self.tmp, "f32"))
    narrowed = export(BASE, params32, os.path.join(self.tmp, "f32_as_bf16"), dtype="bfloat16")
    tensors, tensors32 = folder_tensors(folder), folder_tensors(wide)
    kept = {k for k in tensors if k.endswith(looped_export.FLOAT32)}
    self.assertEqual(kept, {"model.recurrence.inject.A_log", "model.recurrence.inject.dt"})
    for name, x in tensors.items():
      self.assertEqual(x.dtype, np.float32 if name in kept else ml_dtypes.bfloat16, name)
      self.assertEqual(x.tobytes(), tensors32[name].astype(x.dtype).tobytes(), name)
    narrow = folder_tensors(narrowed)
    self.assertEqual(
      {k: v.tobytes() for k, v in narrow.items()}, {k: v.tobytes() for k, v in tensors.items()}
    )
    size = lambda f: os.path.getsize(os.path.join(f, "model.safetensors"))
    self.assertLess(size(folder), 0.6 * size(wide))
    with open(os.path.join(folder, "config.json")) as f:
      self.assertEqual(json.load(f)["torch_dtype"], "bfloat16")
    model = load(folder, "auto")  # config.json's dtype.
    self.assertEqual(model.dtype, torch.bfloat16)
    self.assertEqual(model.model.recurrence.inject.A_log.dtype, torch.float32)
    ids = np.random.default_rng(8).integers(0, BASE.vocab_size, (2, 10))
    want = np.asarray(LoopedLM(cfg16).apply(params16, jnp.asarray(ids, jnp.int32))[0])
    err = relative_error(torch_logits(model, ids), want)
    wide_logits = LoopedLM(BASE).apply(params32, jnp.asarray(ids, jnp.int32))[0]
    print(f"bfloat16: {err:.1e} (looped's float32 model: {relative_error(want, wide_logits):.1e})")
    self.assertLessEqual(err, BF16_TOLERANCE)

  def test_a_transposed_weight_or_a_wrong_shared_read_fails(self):
    cfg = BASE
    params = visible_params(cfg, seed=9)
    ids = np.random.default_rng(10).integers(0, BASE.vocab_size, (2, 8))
    want = np.asarray(LoopedLM(cfg).apply(params, jnp.asarray(ids, jnp.int32))[0])
    square = ("recurrence", "inject", "B", "kernel")  # [D, D]: its transpose has its shape.
    to_torch = looped_family.to_torch
    skipped = lambda path, x: x.reshape(x.shape[0], -1) if path == square else to_torch(path, x)
    with mock.patch.object(looped_family, "to_torch", skipped):
      folder = export(cfg, params, os.path.join(self.tmp, "transposed"))
    err = relative_error(torch_logits(load(folder, torch.float32), ids), want)
    self.assertGreater(err, 100 * TOLERANCE)
    model = load(export(cfg, params, os.path.join(self.tmp, "right")), torch.float32)
    self.assertLessEqual(relative_error(torch_logits(model, ids), want), TOLERANCE)
    chunks = [(0, 2)] + [(t, t + 1) for t in range(2, 8)]
    shared = looped_chunks(cfg, params, ids, chunks, True)
    self.assertLessEqual(
      relative_error(torch_chunks(model, ids, chunks, share_kv=True), shared), TOLERANCE
    )
    cache_class = modeling_module(model).LoopedCache
    before_final = property(lambda self: (self.num_recurrences - 1,))  # Keeps recurrence R - 1.
    with mock.patch.object(cache_class, "cached", before_final):
      err = relative_error(torch_chunks(model, ids, chunks, share_kv=True), shared)
    self.assertGreater(err, 100 * TOLERANCE)
    # stride2 caches recurrences 2 and 3 of R = 3: reading the other copy is seen too.
    strided = looped_chunks(cfg, params, ids, chunks, True, "stride2")
    wrong_copy = lambda reads, r: 1 - sorted(set(reads)).index(reads[r - 1])
    with mock.patch.object(modeling_module(model), "read_slot", wrong_copy):
      err = relative_error(
        torch_chunks(model, ids, chunks, share_kv=True, kv_policy="stride2"), strided
      )
    self.assertGreater(err, 100 * TOLERANCE)


if __name__ == "__main__":
  absltest.main()
