"""transformers configuration of a `looped` model exported by looped's export program
(configs/export.py, export.family=looped): the model's record (looped's ModelConfig fields), the
token ids and how generate() caches.

This file and modeling_looped.py are written by the `looped` project and copied verbatim into
every export folder, where config.json's `auto_map` names them, so

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

loads the model with torch and transformers only (looped itself is not needed).
"""

from __future__ import annotations

from transformers import PretrainedConfig

# looped's ModelConfig fields and their defaults (looped/model/config.py has each one's doc).
# `dtype` (looped's compute dtype) is `compute_dtype` here: transformers' `dtype` names the
# dtype of the weights, which is the dtype this model computes in.
MODEL_FIELDS = {
  "vocab_size": 257,
  "d_model": 128,
  "num_heads": 4,
  "num_kv_heads": 2,
  "head_dim": 32,
  "mlp_dim": 384,
  "mlp_type": "swiglu",
  "num_prelude_layers": 1,
  "num_core_layers": 2,
  "num_coda_layers": 1,
  "num_recurrences": 4,
  "injection": "diagonal",
  "diagonal_decay_init": 0.5,
  "state_init": "like_init",
  "state_init_std": 0.02,
  "prelude_norm": True,
  "qk_norm": True,
  "rope_base": 10000.0,
  "rope_table": False,
  "tie_embeddings": True,
  "max_seq_len": 512,
  "init_std": 0.02,
  "compute_dtype": "float32",
  "param_dtype": "float32",
  "scan_recurrences": True,
  "scan_unroll": 0,
  "remat": "none",
  "attention_impl": "auto",
  "prelude_mixers": ["gqa"],
  "core_mixers": ["gqa"],
  "coda_mixers": ["gqa"],
  "mla_kv_rank": 64,
  "mla_q_rank": 0,
  "mla_rope_dim": 32,
  "kda_conv_size": 4,
  "kda_chunk_size": 16,
  "block_norm": "pre",
  "qk_bias": False,
  "embed_scale": 1.0,
  "core_out_norm": "none",
  "exit_gate": False,
  "norm_eps": 1e-6,
  "qk_norm_eps": 1e-6,
  "value_embed_layers": [],
  "value_embed_gate_dim": 32,
  "core_out_proj": False,
}

# How generate() and a forward with use_cache=True cache, as looped's generation program
# (configs/generate.py) does by default: share_kv keeps only the core recurrences kv_policy
# caches (docs/design.md §3 of looped: 'final', the last one), and a prompt is computed in blocks
# of prefill_block tokens aligned from position 0 (0: the whole chunk as one block). Each may be
# passed to generate() or forward() instead.
GENERATION_FIELDS = {"share_kv": True, "kv_policy": "final", "prefill_block": 32}


class LoopedConfig(PretrainedConfig):
  """A looped LM: prelude -> R recurrences of one core block -> coda -> head."""

  model_type = "looped"

  def __init__(self, **kwargs):
    for name, default in {**MODEL_FIELDS, **GENERATION_FIELDS}.items():
      value = kwargs.pop(name, default)
      setattr(self, name, list(value) if isinstance(value, tuple) else value)
    # The model ties its head to the embedding itself (tie_embeddings); transformers ties nothing.
    kwargs["tie_word_embeddings"] = False
    super().__init__(**kwargs)

  def mixers(self, stage: str) -> list[str]:
    """The mixer of each layer of a stage: its pattern repeated over the stage's layers."""
    pattern = getattr(self, f"{stage}_mixers")
    count = getattr(self, f"num_{stage}_layers")
    return [pattern[i % len(pattern)] for i in range(count)]
