"""Config checks the programs that run the engine share (generation and the server): the model
must be one the engine can page, and the KV format one that model can store."""

import ml_collections

from looped import config_checks as cc
from looped import kv_quant
from looped.engine import paged_cache
from looped.model import config as model_lib
from looped.model import kv_policy, mixers


def check_model_and_format(config, section: str, model_cfg):
  """The model the engine can page, and `{section}.kv_format` for it: (ModelConfig, format)."""
  model_lib.validate(ml_collections.ConfigDict({"model": model_cfg}))
  cfg = model_lib.from_config(model_cfg)
  try:
    paged_cache.check_model(cfg)
  except ValueError as e:
    raise cc.ConfigError(f"config.model: {e}") from None
  fmt = cc.string(config, f"{section}.kv_format", allow_empty=True)
  if fmt:
    cc.choice(config, f"{section}.kv_format", ("",) + kv_quant.FORMATS)
    try:
      mixers.check_kv_format(cfg, fmt)
    except ValueError as e:
      cc.fail(f"{section}.kv_format", fmt, str(e).rstrip("."))
  return cfg, fmt


def check_kv_policy(config, section: str, cfg) -> str:
  """`{section}.kv_policy` for the model (looped/model/kv_policy.py); 'final' when unshared."""
  name = cc.get(config, f"{section}.kv_policy")
  kv_policy.check(name, cfg.num_recurrences, f"config.{section}.kv_policy")
  if name != kv_policy.FINAL and "kda" in cfg.mixers("core"):
    cc.fail(f"{section}.kv_policy", name, "KDA core layers share as 'final' only")
  return name if cc.get(config, f"{section}.share_kv") else kv_policy.FINAL


def slots_note(cfg, share_kv: bool, max_num_seqs: int) -> str:
  """What the budget holds before its pages, for a model with KDA layers (else '')."""
  per_seq = paged_cache.bytes_per_sequence(cfg, share_kv)
  if not per_seq:
    return ""
  return f" after {max_num_seqs} state slots of {per_seq:.0f} bytes (max_num_seqs)"


def check_prefill_block(config, section: str) -> int:
  """`{section}.prefill_block`: within the per-step token budget (a block is one call, never
  split across steps)."""
  block, budget = config[section].prefill_block, config[section].max_num_batched_tokens
  if block > budget:
    cc.fail(
      f"{section}.prefill_block",
      block,
      f"must be at most max_num_batched_tokens ({budget}): a block is never split across steps",
    )
  return block


def check_attention_impl(config, section: str, mesh_shape) -> str:
  """`{section}.attention_impl` on the mesh: the paged kernel runs on one device
  (looped.engine.engine.attention_impl)."""
  name = cc.get(config, f"{section}.attention_impl")
  if name == "pallas" and max(mesh_shape) > 1:
    cc.fail(
      f"{section}.attention_impl",
      name,
      f"the paged kernel runs on one device; a mesh of {tuple(mesh_shape)} needs 'xla' or 'auto'",
    )
  return name
