"""The engine section (EngineSection) from a program's validated config to an Engine: the checks
the programs that run the engine share (generation and the server), the pages a budget holds,
and the one place an EngineConfig is built from a section.

Each function takes the typed section (`schema.load`) and its name, which only names fields in
the one-line errors (`config.serve.kv_policy = ...`).
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from looped import config_checks as cc
from looped.engine import paged_cache, speculative
from looped.engine.config import EngineSection
from looped.engine.engine import EngineConfig
from looped.engine.requests import DepthParams
from looped.engine.speculative import SpeculativeParams
from looped.model import adaptive, kv_policy, mixers
from looped.model import config as model_lib
from looped.model.cache_layout import KVLayout

# The most tokens a request may draft per round when the section's default is fewer (the
# speculative calls pad k to powers of two up to it).
DEFAULT_MAX_LOOKAHEAD = 8


def check_model_and_format(settings: EngineSection, section: str, model_cfg):
  """The model the engine can page, and the section's kv_format for it: (ModelConfig, format)."""
  model_lib.validate(ml_collections.ConfigDict({"model": model_cfg}))
  cfg = model_lib.from_config(model_cfg)
  try:
    paged_cache.check_model(cfg)
  except ValueError as e:
    raise cc.ConfigError(f"config.model: {e}") from None
  fmt = settings.kv_format
  if fmt:
    try:
      mixers.check_kv_format(cfg, fmt)
    except ValueError as e:
      cc.fail(f"{section}.kv_format", fmt, str(e).rstrip("."))
  return cfg, fmt


def kv_policy_of(settings: EngineSection, section: str, cfg) -> str:
  """The section's kv_policy for the model (looped/model/kv_policy.py); 'final' when unshared."""
  name = settings.kv_policy
  kv_policy.check(name, cfg.num_recurrences, f"config.{section}.kv_policy")
  if name != kv_policy.FINAL and not mixers.all_with(cfg, "core", "kv_policies"):
    others = ", ".join(m.upper() for m in mixers.lacking(cfg, "core", "kv_policies"))
    cc.fail(f"{section}.kv_policy", name, f"{others} core layers share as 'final' only")
  return name if settings.share_kv else kv_policy.FINAL


def slots_note(cfg, layout: KVLayout, max_num_seqs: int) -> str:
  """What the budget holds before its pages, for a model with KDA layers (else '')."""
  per_seq = layout.bytes_per_sequence(cfg)
  if not per_seq:
    return ""
  return f" after {max_num_seqs} state slots of {per_seq:.0f} bytes (max_num_seqs)"


def check_attention_impl(settings: EngineSection, section: str, mesh_shape) -> str:
  """The section's attention_impl on the mesh: the paged kernel runs on one device
  (looped.engine.engine.attention_impl)."""
  name = settings.attention_impl
  if name == "pallas" and max(mesh_shape) > 1:
    cc.fail(
      f"{section}.attention_impl",
      name,
      f"the paged kernel runs on one device; a mesh of {tuple(mesh_shape)} needs 'xla' or 'auto'",
    )
  return name


def _check_buckets(section: str, name: str, value, reach: int | None) -> None:
  """A bucket tuple: () (the engine's defaults) or positive sizes, the largest >= reach."""
  if not isinstance(value, (tuple, list)) or not all(
    isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value
  ):
    cc.fail(f"{section}.{name}", value, "must be a tuple of positive integers (empty: defaults)")
  if value and reach is not None and max(value) < reach:
    cc.fail(f"{section}.{name}", value, f"must reach {reach} (the per-step limit it pads)")


def depth_params(settings: EngineSection) -> DepthParams:
  """The section's depth settings of a request that gives none (EngineConfig.depth)."""
  return adaptive.settings_of(settings)


def depth_model(settings: EngineSection, cfg):
  """The model the engine's steps run: its R raised to max_recurrences (the loop's length and
  the unshared layout's core copies, so the pages a budget holds are counted on it)."""
  top = max(settings.max_recurrences, cfg.num_recurrences)
  return dataclasses.replace(cfg, num_recurrences=top)


def check_depth(settings: EngineSection, section: str, cfg) -> None:
  """The section's depth fields against the model (looped/model/adaptive.py)."""
  top = settings.max_recurrences
  if top and top < cfg.num_recurrences:
    cc.fail(
      f"{section}.max_recurrences", top, f"must be 0 or >= the model's R = {cfg.num_recurrences}"
    )
  if settings.exit_lookup != adaptive.DEFAULT_LOOKUP and not mixers.all_with(
    cfg, "core", "attends"
  ):
    cc.fail(f"{section}.exit_lookup", settings.exit_lookup, "needs attention core layers")
  try:
    depth_params(settings).check(
      depth_model(settings, cfg).num_recurrences, cfg.exit_gate, prefix=f"config.{section}."
    )
  except ValueError as e:
    raise cc.ConfigError(str(e)) from None


def check_speculative(settings: EngineSection, section: str, cfg) -> None:
  """The section's speculation fields against the model and the other fields."""
  s = settings
  try:
    passes = speculative.parse_verify(s.speculative_verify)
  except ValueError:
    cc.fail(f"{section}.speculative_verify", s.speculative_verify, "must be 'block' or n >= 1")
  if passes > 1 and not s.share_kv:
    cc.fail(
      f"{section}.speculative_verify",
      s.speculative_verify,
      "needs share_kv: an unshared cache verifies exactly in one pass ('block')",
    )
  if passes > 1 and not mixers.all_with(cfg, "core", "attends"):
    cc.fail(f"{section}.speculative_verify", s.speculative_verify, "needs attention core layers")
  r = s.speculative_recurrences
  top = s.recurrences or cfg.num_recurrences
  if r > top:
    cc.fail(f"{section}.speculative_recurrences", r, f"must be at most the recurrences ({top})")
  depth = depth_params(s)
  if r and (depth.exits or depth.continuous_compute):
    cc.fail(
      f"{section}.speculative_recurrences",
      r,
      "drafts at a fixed depth: it takes exit_criterion 'none' and no continuous_compute",
    )


def check_section(settings: EngineSection, section: str, model_cfg, mesh_shape) -> tuple:
  """Every engine field against the model and mesh: (ModelConfig, kv_format, kv_policy)."""
  cfg, fmt = check_model_and_format(settings, section, model_cfg)
  check_depth(settings, section, cfg)
  check_speculative(settings, section, cfg)
  policy = kv_policy_of(settings, section, depth_model(settings, cfg))
  block, budget = settings.prefill_block, settings.max_num_batched_tokens
  if block > budget:
    cc.fail(
      f"{section}.prefill_block",
      block,
      f"must be at most max_num_batched_tokens ({budget}): a block is never split across steps",
    )
  check_attention_impl(settings, section, mesh_shape)
  if settings.speculative_recurrences and max(mesh_shape) > 1:
    cc.fail(
      f"{section}.speculative_recurrences",
      settings.speculative_recurrences,
      f"speculation runs on one device; a mesh of {tuple(mesh_shape)} needs 0",
    )
  _check_buckets(section, "row_buckets", settings.row_buckets, settings.max_num_seqs)
  _check_buckets(section, "token_buckets", settings.token_buckets, block)
  _check_buckets(section, "column_buckets", settings.column_buckets, None)
  value = settings.kv_budget_bytes
  if value is not None and (
    isinstance(value, bool)
    or not isinstance(value, (int, float))
    or not math.isfinite(value)
    or not value > 0
  ):
    cc.fail(f"{section}.kv_budget_bytes", value, "must be a finite number > 0 (bytes)")
  return cfg, fmt, policy


def check_budget(settings: EngineSection, section: str, cfg, policy: str, need: int, what: str):
  """ConfigError unless the section's KV budget holds `need` pages (`what` needs them)."""
  layout = kv_layout(settings, policy)
  have = num_pages(settings, cfg, policy)
  if have < need:
    cc.fail(
      f"{section}.kv_budget_bytes",
      settings.kv_budget_bytes,
      f"holds {have} pages of {layout.page_bytes(depth_model(settings, cfg)):.0f} bytes"
      f"{slots_note(cfg, layout, settings.max_num_seqs)}; {what} needs {need}",
    )


def kv_layout(settings: EngineSection, policy: str) -> KVLayout:
  """The section's KVLayout (policy: kv_policy_of's, 'final' when unshared)."""
  return KVLayout(settings.share_kv, settings.kv_format or None, policy, settings.page_size)


def num_pages(settings: EngineSection, cfg, policy: str) -> int:
  """Pages the section's KV budget holds in its layout and format (on the model looping up to
  max_recurrences)."""
  layout = kv_layout(settings, policy)
  budget = float(settings.kv_budget_bytes)
  return layout.pages_for_budget(depth_model(settings, cfg), budget, settings.max_num_seqs)


def engine_config(
  settings: EngineSection, cfg, policy: str, *, num_pages: int, mesh_shape, mesh_rules, **runtime
) -> EngineConfig:
  """The Engine's config from a validated section: the one place programs build one. runtime:
  EngineConfig's fields no section holds (top_logprobs, record_logits, ...)."""
  s = settings
  return EngineConfig(
    share_kv=s.share_kv,
    kv_format=s.kv_format or None,
    kv_policy=policy,
    num_pages=num_pages,
    page_size=s.page_size,
    max_num_batched_tokens=s.max_num_batched_tokens,
    max_num_seqs=s.max_num_seqs,
    prefill_block=s.prefill_block,
    max_model_len=cfg.max_seq_len,
    row_buckets=tuple(s.row_buckets) or None,
    token_buckets=tuple(s.token_buckets) or None,
    column_buckets=tuple(s.column_buckets) or None,
    attention_impl=s.attention_impl,
    mesh_shape=mesh_shape,
    mesh_rules=mesh_rules,
    max_recurrences=s.max_recurrences or None,
    exit_lookup=s.exit_lookup,
    depth=depth_params(s),
    speculative=SpeculativeParams(s.speculative_recurrences, s.speculative_tokens),
    speculative_verify=speculative.parse_verify(s.speculative_verify),
    max_speculative_tokens=max(s.speculative_tokens, DEFAULT_MAX_LOOKAHEAD),
    **runtime,
  )
