"""Writes tests/testdata/{huginn,ouro}_tiny/: tiny random checkpoints of two public looped LMs,
saved by their own PyTorch reference code, plus golden logits (golden.npz).

  python tests/make_looped_references.py \
    --huginn_modeling_file=PATH/raven_modeling_minimal.py \
    --ouro_modeling_file=PATH/modeling_ouro.py

With --dtype=bfloat16 it writes {huginn,ouro}_tiny_bf16/ instead: the same weights rounded to
bfloat16 and saved as bfloat16 (Huginn's RoPE buffer freqs_cis too, as a bfloat16 checkpoint of
the public code stores it), and goldens from the reference in float32 on that file's values
(the model rebuilt in float32 and the saved shards loaded into it, buffers included).

Needs torch, transformers, safetensors, tokenizers and numpy; CI runs none of it and reads the
committed files. The modeling files are not part of this repository: each is imported from its
own directory as a package, next to its config module (raven_config_minimal.py,
configuration_ouro.py). It ends with a numpy-only re-implementation of both families checked
against the goldens; `--check` runs just that. Sources, versions and the computation each
family performs are in tests/testdata/LOOPED_REFERENCES.md.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys

import numpy as np

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
VOCAB = 300
BATCH, SEQ = 2, 12
SHARD = "200KB"  # several safetensors shards per model
SKIP = ("self", "kwargs", "torch_dtype", "transformers_version")
TEXTS = (
  "the loop runs the same layers again and again on every token",
  "a recurrent depth model shares weights across its recurrences",
)
CORPUS = TEXTS + (
  "looped language models reuse one block of layers several times per token.",
  "each recurrence refines the latent state; the cache may be shared across them.",
  "Huginn injects the embedding at every step; Ouro loops all of its layers.",
)


def need(module: str):
  try:
    return importlib.import_module(module)
  except ImportError:
    sys.exit(f"error: {module} is not installed (pip install torch transformers safetensors)")


def load_reference(modeling_file: str, package: str):
  """Imports modeling_file as `package.<name>`, so its relative config import resolves."""
  if not os.path.isfile(modeling_file):
    sys.exit(f"error: modeling file not found: {modeling_file}")
  directory = os.path.dirname(os.path.abspath(modeling_file))
  spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
  spec.submodule_search_locations = [directory]
  sys.modules[package] = importlib.util.module_from_spec(spec)
  name = os.path.splitext(os.path.basename(modeling_file))[0]
  try:
    return importlib.import_module(f"{package}.{name}")
  except ImportError as e:  # e.g. its config module is not beside it
    sys.exit(f"error: cannot import {modeling_file}: {e}")


# Chat templates in each family's chat format, for tokenizer_config.json (the server renders
# them as transformers does: tests/server_chat_test.py). Huginn-0125's: the text token, then per
# message a header with its role and the trimmed content ending the turn; the reply's header
# names Huginn. Ouro's tokens are ChatML's: here with a system message when the chat has none.
HUGINN_CHAT_TEMPLATE = (
  "{% for message in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
  "{{ '<|begin_header|>' + message['role'] + '<|end_header|>\n\n' + message['content'] | trim"
  " + '<|end_turn|>' }}{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|begin_header|>Huginn<|end_header|>\n\n' }}{% endif %}"
)
OURO_CHAT_TEMPLATE = (
  "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
  "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
  "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(out: str, specials: list[str], chat_template: str) -> list[list[int]]:
  """A byte-level BPE with VOCAB entries (ids < VOCAB) and its config (the chat template
  included); returns TEXTS encoded to SEQ ids."""
  tokenizers = need("tokenizers")
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=specials,
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(list(CORPUS), trainer=trainer)
  assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
  tok.save(os.path.join(out, "tokenizer.json"))
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": 64,
    "bos_token": specials[1],
    "eos_token": specials[2],
    "pad_token": specials[0],
    "chat_template": chat_template,
  }
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")
  ids = [tok.encode(t).ids[:SEQ] for t in TEXTS]
  assert all(len(i) == SEQ for i in ids), [len(i) for i in ids]
  return ids


def randomize(torch, model, seed: int, emb_std: float, bias_mean: float = 0.0):
  """Weights random but not degenerate: norms around 1, linears N(0, 1/fan_in), biases random."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
      if p.ndim == 1 and ("norm" in name or "ln_f" in name):
        p.copy_(1.0 + 0.3 * (2 * torch.rand(p.shape, generator=g) - 1))
      elif p.ndim == 1:  # a bias
        p.copy_(bias_mean + 0.5 * torch.randn(p.shape, generator=g))
      elif "wte" in name or "embed_tokens" in name:
        p.copy_(emb_std * torch.randn(p.shape, generator=g))
      elif p.ndim == 2:
        p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
      else:  # Huginn's qk_bias (2, 1, heads, head_dim)
        p.copy_(0.3 * torch.randn(p.shape, generator=g))


def config_fields(config, extra: dict) -> dict:
  """The config's own __init__ fields (the names real checkpoints use), then `extra`."""
  names = [n for n in inspect.signature(type(config).__init__).parameters if n not in SKIP]
  return {**{n: getattr(config, n) for n in names if hasattr(config, n)}, **extra}


def save_checkpoint(model, out: str, config: dict):
  """Sharded safetensors + index; config.json as given; no copy of the reference code."""
  model.save_pretrained(out, max_shard_size=SHARD, safe_serialization=True)
  for name in os.listdir(out):
    if name.endswith(".py") or name == "generation_config.json":
      os.remove(os.path.join(out, name))
  index = os.path.join(out, "model.safetensors.index.json")
  assert os.path.isfile(index), "expected a sharded checkpoint"
  with open(index) as f:
    shards = set(json.load(f)["weight_map"].values())
  assert len(shards) >= 2, shards
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write("\n")


def round_to(torch, model, dtype: str):
  """Every parameter rounded to `dtype` (kept float32): the values a `dtype` file will hold."""
  if dtype == "bfloat16":
    with torch.no_grad():
      for p in model.parameters():
        p.copy_(p.to(torch.bfloat16).float())


def save_as(torch, model, out: str, config: dict, dtype: str):
  """save_checkpoint with every tensor (buffers included) in `dtype`; the model is left float32."""
  save_checkpoint(model.to(getattr(torch, dtype)), out, config)
  model.float()


def load_saved(torch, model, out: str):
  """The saved shards loaded into `model` (float32), as from_pretrained loads a checkpoint in
  float32: parameters and persistent buffers take the file's values."""
  from safetensors.torch import load_file

  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  state = {}
  for shard in shards:
    state.update(load_file(os.path.join(out, shard)))
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  for name, t in model.state_dict().items():
    if name in state:
      assert torch.equal(t, state[name].float()), name
  return model


def versions(torch, dtype: str | None = None) -> dict:
  import transformers

  if dtype:  # as config.json fields
    return {"torch_dtype": dtype, "transformers_version": transformers.__version__}
  return {"torch": torch.__version__, "transformers": transformers.__version__}


def np32(t) -> np.ndarray:
  return t.detach().float().cpu().numpy().astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Huginn-0125 (RavenForCausalLM).


def huginn(modeling_file: str, out: str, seed: int, dtype: str = "float32"):
  torch = need("torch")
  ref = load_reference(modeling_file, "huginn_reference")
  cfg_mod = importlib.import_module("huginn_reference.raven_config_minimal")
  torch.manual_seed(seed)
  config = cfg_mod.RavenConfig(
    n_embd=64,
    n_heads=4,
    n_layers=5,
    block_size=64,
    vocab_size=VOCAB,
    padding_multiple=4,
    tie_embeddings=True,
    intermediate_size=96,
    bias=False,
    n_layers_in_recurrent_block=2,
    mean_recurrence=4,
    mean_backprop_depth=2,
    n_layers_in_prelude=2,
    n_layers_in_coda=1,
    qk_bias=True,
    rope_base=50_000.0,
    norm_eps=1e-6,
    torch_dtype="float32",
  )
  model = ref.RavenForCausalLM(config).float().eval()
  # wte is scaled by sqrt(n_embd) on input; N(0, 1/n_embd) keeps the scaled embeddings ~N(0, 1).
  randomize(torch, model, seed, emb_std=config.n_embd**-0.5)
  round_to(torch, model, dtype)
  assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "untied"

  os.makedirs(out, exist_ok=True)
  ids = torch.tensor(
    write_tokenizer(out, ["<|pad|>", "<|begin_text|>", "<|end_text|>"], HUGINN_CHAT_TEMPLATE)
  )
  saved = config_fields(
    config,
    {
      "architectures": ["RavenForCausalLM"],
      "model_type": "huginn_raven",
      "auto_map": {
        "AutoConfig": "raven_config_minimal.RavenConfig",
        "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
      },
      "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_heads,
      **versions(torch, dtype),
    },
  )
  save_as(torch, model, out, saved, dtype)
  # Rebuilt in float32 and loaded from the file: freqs_cis is the stored table.
  model = load_saved(torch, ref.RavenForCausalLM(config).float().eval(), out)
  assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr(), "untied"

  # The recurrent state's initial value: the reference draws it per call with torch.randn +
  # trunc_normal_ (initialize_state). Drawn once here and passed as input_states, so the JAX
  # side can reuse it; init_scale=0.0 is the reference's deterministic zero init.
  embeds = model.transformer.wte(ids) * model.emb_scale
  torch.manual_seed(seed + 1)
  state0 = model.initialize_state(embeds, scale=1.0)
  golden = {"input_ids": ids.numpy().astype(np.int32), "state0": np32(state0)}

  def run(steps: int, init: str, **kw):
    extra = {"input_states": kw.pop("states")} if init == "state0" else {"init_scale": 0.0}
    return model(num_steps=steps, **extra, **kw)  # an int: a 0-d tensor breaks len() there

  with torch.no_grad():
    for steps in (2, 4):
      for init in ("zero", "state0"):
        kw = {"states": state0} if init == "state0" else {}
        o = run(steps, init, input_ids=ids, **kw)
        golden[f"logits_{init}_r{steps}"] = np32(o.logits)
        golden[f"latents_{init}_r{steps}"] = np32(o.latent_states)
      # Token-by-token decoding with the reference's own cache (HuginnDynamicCache, "full").
      for init in ("zero", "state0"):
        cache = ref.HuginnDynamicCache()
        steps_logits = []
        for t in range(SEQ):
          kw = {"states": state0[:, t : t + 1]} if init == "state0" else {}
          o = run(
            steps,
            init,
            input_ids=ids[:, t : t + 1],
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.tensor([t]),
            **kw,
          )
          cache = o.past_key_values
          steps_logits.append(o.logits)
        golden[f"decode_logits_{init}_r{steps}"] = np32(torch.cat(steps_logits, 1))
        err = np.abs(golden[f"decode_logits_{init}_r{steps}"] - golden[f"logits_{init}_r{steps}"])
        print(f"huginn r={steps} {init}: |decode - parallel| max {err.max():.2e}")
  golden["meta"] = np.array(json.dumps({"seed": seed, **versions(torch), "dtype": dtype}))
  np.savez_compressed(os.path.join(out, "golden.npz"), **golden)


# ---------------------------------------------------------------------------------------------
# Ouro (OuroForCausalLM).


def ouro(modeling_file: str, out: str, seed: int, dtype: str = "float32"):
  torch = need("torch")
  ref = load_reference(modeling_file, "ouro_reference")
  cfg_mod = importlib.import_module("ouro_reference.configuration_ouro")
  torch.manual_seed(seed)
  config = cfg_mod.OuroConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    hidden_act="silu",
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_theta=1_000_000.0,
    total_ut_steps=4,
    early_exit_threshold=1.0,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="float32",
  )
  config._attn_implementation = "eager"
  model = ref.OuroForCausalLM(config).float().eval()
  randomize(torch, model, seed, emb_std=1.0, bias_mean=-1.0)
  round_to(torch, model, dtype)

  os.makedirs(out, exist_ok=True)
  ids = torch.tensor(
    write_tokenizer(out, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], OURO_CHAT_TEMPLATE)
  )
  saved = config_fields(
    config,
    {
      "architectures": ["OuroForCausalLM"],
      "model_type": "ouro",
      "auto_map": {
        "AutoConfig": "configuration_ouro.OuroConfig",
        "AutoModel": "modeling_ouro.OuroModel",
        "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM",
      },
      "head_dim": config.head_dim,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": config.eos_token_id,
      "pad_token_id": config.pad_token_id,
      **versions(torch, dtype),
    },
  )
  save_as(torch, model, out, saved, dtype)
  # Rebuilt in float32 and loaded from the file (the rotary inv_freq is not stored).
  model = load_saved(torch, ref.OuroForCausalLM(config).float().eval(), out)

  golden = {"input_ids": ids.numpy().astype(np.int32)}

  def set_steps(n: int):
    model.config.total_ut_steps = n
    model.model.config.total_ut_steps = n
    model.model.total_ut_steps = n

  with torch.no_grad():
    for steps in (4, 2):
      set_steps(steps)
      # Parallel forward: OuroModel returns per-UT-step (normed) states and exit-gate logits.
      # Step k never sees later steps, so total_ut_steps=2 gives the first 2 of these.
      _, hidden, gate = model.model(input_ids=ids, use_cache=False)
      hidden, gate = (
        torch.stack(hidden),
        torch.stack(gate)[..., 0],
      )  # (steps, B, S, D), (steps, B, S)
      step_logits = model.lm_head(hidden)
      if steps == 4:
        golden.update(step_hidden_r4=np32(hidden), step_gate_r4=np32(gate))
        golden["step_logits_r4"] = np32(step_logits)
      else:
        assert np.array_equal(np32(hidden), golden["step_hidden_r4"][:steps])
      # OuroForCausalLM's default path: exit_threshold = config.early_exit_threshold (1.0).
      o = model(input_ids=ids, use_cache=False)
      golden[f"logits_r{steps}"] = np32(o.logits)
      o = model(input_ids=ids, use_cache=False, exit_threshold=None, exit_at_step=steps - 1)
      assert torch.equal(o.logits, step_logits[-1])
      if steps == 4:  # a threshold the cumulative exit probability crosses at varied steps
        o = model(input_ids=ids, use_cache=False, exit_threshold=0.5)
        golden["logits_exit0.5_r4"] = np32(o.logits)
      # Token-by-token decoding with the reference's cache (one KV slot per UT step and layer).
      cache, decoded = None, []
      for t in range(SEQ):
        o = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
        assert isinstance(o.past_key_values, ref.UniversalTransformerCache)
        cache = o.past_key_values
        decoded.append(o.logits)
      golden[f"decode_logits_r{steps}"] = np32(torch.cat(decoded, 1))
      err = np.abs(golden[f"decode_logits_r{steps}"] - golden[f"logits_r{steps}"])
      print(f"ouro r={steps}: |decode - parallel| max {err.max():.2e}")
  golden["meta"] = np.array(json.dumps({"seed": seed, **versions(torch), "dtype": dtype}))
  np.savez_compressed(os.path.join(out, "golden.npz"), **golden)


# ---------------------------------------------------------------------------------------------
# A second, numpy-only implementation of both families, written from LOOPED_REFERENCES.md and
# reading the safetensors shards directly: it checks the goldens and the spec at once.


def read_checkpoint(out: str) -> tuple[dict, dict]:
  """(config.json, {name: float64 array}) from a sharded safetensors checkpoint."""
  with open(os.path.join(out, "config.json")) as f:
    config = json.load(f)
  with open(os.path.join(out, "model.safetensors.index.json")) as f:
    shards = sorted(set(json.load(f)["weight_map"].values()))
  params = {}
  for shard in shards:
    with open(os.path.join(out, shard), "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      header, data = json.loads(f.read(n)), f.read()
    for name, t in header.items():
      if name != "__metadata__":
        assert t["dtype"] in ("F32", "BF16"), (name, t["dtype"])
        lo, hi = t["data_offsets"]
        if t["dtype"] == "BF16":  # the top 16 bits of a float32
          x = (np.frombuffer(data[lo:hi], np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
          x = np.frombuffer(data[lo:hi], np.float32)
        params[name] = x.reshape(t["shape"]).astype(np.float64)
  return config, params


def rms_norm(x, w, eps):
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def silu(x):
  return x / (1 + np.exp(-x))


def attention(q, k, v):
  """(B, S, H, hd) each, causal, scale hd**-0.5 -> (B, S, H * hd)."""
  s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  y = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)
  return y.reshape(*y.shape[:2], -1)


def rope_angles(seq: int, hd: int, theta: float):
  inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)  # float32, as both refs
  ang = np.outer(np.arange(seq, dtype=np.float32), inv).astype(np.float64)
  return np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]  # (1, S, 1, hd/2)


def huginn_numpy(out: str, ids, steps: int, state0=None):
  c, p = read_checkpoint(out)
  e_dim, heads, eps = c["n_embd"], c["n_heads"], c["norm_eps"]
  hd = e_dim // heads
  cos, sin = rope_angles(ids.shape[1], hd, c["rope_base"])
  if "freqs_cis" in p:  # the stored table (1, block_size, 1, hd/2, 2), which the reference reads
    table = p["freqs_cis"][:, : ids.shape[1]]
    cos, sin = table[..., 0], table[..., 1]

  def rope(x):  # interleaved pairs (x[2i], x[2i+1])
    a, b = x[..., 0::2], x[..., 1::2]
    return np.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(x.shape)

  def block(x, n):
    qkv = rms_norm(x, p[f"{n}.norm_1.weight"], eps) @ p[f"{n}.attn.Wqkv.weight"].T
    q, k, v = np.split(qkv, [e_dim, 2 * e_dim], -1)
    q, k, v = (t.reshape(*t.shape[:2], heads, hd) for t in (q, k, v))
    q, k = q + p[f"{n}.attn.qk_bias"][0], k + p[f"{n}.attn.qk_bias"][1]
    a = attention(rope(q), rope(k), v) @ p[f"{n}.attn.proj.weight"].T
    x = rms_norm(a + x, p[f"{n}.norm_2.weight"], eps)
    g, u = np.split(rms_norm(x, p[f"{n}.norm_3.weight"], eps) @ p[f"{n}.mlp.fc.weight"].T, 2, -1)
    m = (silu(g) * u) @ p[f"{n}.mlp.proj.weight"].T
    return rms_norm(m + x, p[f"{n}.norm_4.weight"], eps)

  wte = p["transformer.wte.weight"]
  e = wte[ids] * np.sqrt(e_dim)
  for i in range(c["n_layers_in_prelude"]):
    e = block(e, f"transformer.prelude.{i}")
  x = np.zeros_like(e) if state0 is None else state0.astype(np.float64)
  for _ in range(steps):
    x = np.concatenate([x, e], -1) @ p["transformer.adapter.weight"].T
    for i in range(c["n_layers_in_recurrent_block"]):
      x = block(x, f"transformer.core_block.{i}")
  x = latents = rms_norm(x, p["transformer.ln_f.weight"], eps)
  for i in range(c["n_layers_in_coda"]):
    x = block(x, f"transformer.coda.{i}")
  x = rms_norm(x, p["transformer.ln_f.weight"], eps)
  return x @ p.get("lm_head.weight", wte).T, latents


def ouro_numpy(out: str, ids, steps: int):
  c, p = read_checkpoint(out)
  heads, kv_heads, hd, eps = (
    c["num_attention_heads"],
    c["num_key_value_heads"],
    c["head_dim"],
    c["rms_norm_eps"],
  )
  cos, sin = rope_angles(ids.shape[1], hd, c["rope_theta"])
  cos, sin = np.concatenate([cos, cos], -1), np.concatenate([sin, sin], -1)

  def rope(x):  # rotate_half: first half / second half
    x1, x2 = np.split(x, 2, -1)
    return x * cos + np.concatenate([-x2, x1], -1) * sin

  def layer(x, n):
    h = rms_norm(x, p[f"{n}.input_layernorm.weight"], eps)
    q, k, v = (h @ p[f"{n}.self_attn.{w}_proj.weight"].T for w in "qkv")
    q = q.reshape(*q.shape[:2], heads, hd)
    k, v = (np.repeat(t.reshape(*t.shape[:2], kv_heads, hd), heads // kv_heads, 2) for t in (k, v))
    a = attention(rope(q), rope(k), v) @ p[f"{n}.self_attn.o_proj.weight"].T
    x = x + rms_norm(a, p[f"{n}.input_layernorm_2.weight"], eps)
    h = rms_norm(x, p[f"{n}.post_attention_layernorm.weight"], eps)
    g, u = h @ p[f"{n}.mlp.gate_proj.weight"].T, h @ p[f"{n}.mlp.up_proj.weight"].T
    m = (silu(g) * u) @ p[f"{n}.mlp.down_proj.weight"].T
    return x + rms_norm(m, p[f"{n}.post_attention_layernorm_2.weight"], eps)

  x, hidden, gate = p["model.embed_tokens.weight"][ids], [], []
  for _ in range(steps):
    for i in range(c["num_hidden_layers"]):
      x = layer(x, f"model.layers.{i}")
    x = rms_norm(x, p["model.norm.weight"], eps)
    hidden.append(x)
    gate.append(x @ p["model.early_exit_gate.weight"][0] + p["model.early_exit_gate.bias"][0])
  head = p.get("lm_head.weight", p["model.embed_tokens.weight"])
  return np.stack(hidden) @ head.T, np.stack(hidden), np.stack(gate)


def ouro_exit(step_logits, gate, threshold: float):
  """OuroForCausalLM's exit_threshold path: per token, the first step whose cumulative exit
  probability reaches threshold (else the last); float32 as the reference."""
  lam = 1 / (1 + np.exp(-gate.astype(np.float32)))
  remaining, pdf = np.ones_like(lam[0]), []
  for i in range(len(lam)):
    pdf.append(lam[i] * remaining if i < len(lam) - 1 else remaining)
    remaining = remaining * (1 - lam[i])
  reached = np.cumsum(np.stack(pdf), 0) >= np.float32(threshold)
  step = np.where(reached.any(0), reached.argmax(0), len(lam) - 1)  # (B, S)
  return np.take_along_axis(step_logits, step[None, ..., None], 0)[0], step


def check(out_dir: str, suffix: str = "", atol: float = 1e-4):
  """Recomputes every parallel golden (of the {family}_tiny{suffix} folders) with the numpy
  implementations above."""
  worst = {}
  out = os.path.join(out_dir, f"huginn_tiny{suffix}")
  if os.path.isdir(out):
    g = np.load(os.path.join(out, "golden.npz"))
    for steps in (2, 4):
      for init, state in (("zero", None), ("state0", g["state0"])):
        logits, latents = huginn_numpy(out, g["input_ids"], steps, state)
        worst[f"huginn logits_{init}_r{steps}"] = np.abs(
          logits - g[f"logits_{init}_r{steps}"]
        ).max()
        worst[f"huginn latents_{init}_r{steps}"] = np.abs(
          latents - g[f"latents_{init}_r{steps}"]
        ).max()
  out = os.path.join(out_dir, f"ouro_tiny{suffix}")
  if os.path.isdir(out):
    g = np.load(os.path.join(out, "golden.npz"))
    logits, hidden, gate = ouro_numpy(out, g["input_ids"], 4)
    for name, value in (("step_logits", logits), ("step_hidden", hidden), ("step_gate", gate)):
      worst[f"ouro {name}_r4"] = np.abs(value - g[f"{name}_r4"]).max()
    for steps in (2, 4):
      chosen, _ = ouro_exit(g["step_logits_r4"][:steps], g["step_gate_r4"][:steps], 1.0)
      worst[f"ouro logits_r{steps}"] = np.abs(chosen - g[f"logits_r{steps}"]).max()
    chosen, step = ouro_exit(g["step_logits_r4"], g["step_gate_r4"], 0.5)
    worst["ouro logits_exit0.5_r4"] = np.abs(chosen - g["logits_exit0.5_r4"]).max()
    print("ouro exit steps at threshold 0.5:", step.tolist())
  for name, err in worst.items():
    print(f"numpy check {name}: max |err| {err:.1e}")
  bad = [name for name, err in worst.items() if not err <= atol]
  if bad or not worst:
    sys.exit(f"error: numpy re-implementation disagrees with the goldens: {bad or 'no goldens'}")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--huginn_modeling_file", help="raven_modeling_minimal.py (Huginn-0125)")
  parser.add_argument("--ouro_modeling_file", help="modeling_ouro.py (Ouro)")
  parser.add_argument("--out_dir", default=TESTDATA)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--dtype",
    choices=("float32", "bfloat16"),
    default="float32",
    help="stored weight dtype; bfloat16 writes {family}_tiny_bf16 (goldens in float32 compute)",
  )
  parser.add_argument("--check", action="store_true", help="only run the numpy check (no torch)")
  args = parser.parse_args()
  suffix = "_bf16" if args.dtype == "bfloat16" else ""
  if args.check:
    return check(args.out_dir, suffix)
  if not (args.huginn_modeling_file or args.ouro_modeling_file):
    sys.exit("error: give --huginn_modeling_file=PATH and/or --ouro_modeling_file=PATH")
  need("torch")
  need("transformers")
  need("safetensors")
  if args.huginn_modeling_file:
    out = os.path.join(args.out_dir, f"huginn_tiny{suffix}")
    huginn(args.huginn_modeling_file, out, args.seed, args.dtype)
  if args.ouro_modeling_file:
    out = os.path.join(args.out_dir, f"ouro_tiny{suffix}")
    ouro(args.ouro_modeling_file, out, args.seed, args.dtype)
  check(args.out_dir, suffix)


if __name__ == "__main__":
  main()
