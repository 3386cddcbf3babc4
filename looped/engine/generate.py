"""Program 'generate': restore a trained model and generate from prompts on the paged engine.

validate(config) checks every field, the checkpoint directory, the prompts and that the KV
budget holds the longest request, before anything is restored or compiled. run(config, workdir)
streams the text of a single prompt as it is produced, and writes WORKDIR/generations.jsonl
(one object per prompt) and WORKDIR/summary.json (tokens/s, TTFT, hit rate, pages used).
"""

from __future__ import annotations

import io
import json
import os
import sys
from typing import Any

import ml_collections
from absl import logging

from looped import config_checks as cc
from looped import schema
from looped.checkpoints import model_record, restore
from looped.data import tokenizers
from looped.engine import checks
from looped.engine import mesh as mesh_lib
from looped.engine.config import GenConfig
from looped.engine.engine import Engine
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import config as model_lib
from looped.model.looped_lm import LoopedLM


def model_and_data(
  config, checkpoint: str | None = None, chosen: tuple[str, ...] = ()
) -> tuple[ml_collections.ConfigDict, ml_collections.ConfigDict]:
  """`model` and `data` sections describing the checkpoint's model: those recorded beside it
  (model_config.json or a stage dir's stage_config.json), else config's (a directory written
  before records existed); checkpoint defaults to gen.checkpoint. chosen: the recorded fields
  taken from config.model instead (model_record.READER_FIELDS set on the command line)."""
  return model_record.model_and_data(
    config, config.gen.checkpoint if checkpoint is None else checkpoint, chosen
  )


def _read_lines(path: str) -> list[str]:
  """A prompts file's lines (universal newlines); bytes that are not UTF-8 fail naming the line,
  as a config error rather than a traceback."""
  with open(path, "rb") as f:
    raw = f.read()
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = raw.count(b"\n", 0, e.start) + 1
    column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
    cc.fail("gen.prompts", path, f"line {line} is not UTF-8 (byte {column}: {e.reason})")
  return [line.rstrip("\n") for line in io.StringIO(text, newline=None)]


def load_prompts(g: GenConfig) -> list[str]:
  """Prompts from gen.prompts: inline (a string or a tuple of strings) or a file."""
  value = g.prompts
  if isinstance(value, str) and value and os.path.isfile(value):
    lines = _read_lines(value)
    if value.endswith(".jsonl"):
      prompts = []
      for i, line in enumerate(lines):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
        except json.JSONDecodeError as e:
          cc.fail("gen.prompts", value, f"line {i + 1} is not JSON ({e.msg})")
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
          cc.fail("gen.prompts", value, f'line {i + 1} must be an object with a "prompt" string')
        prompts.append(row["prompt"])
    else:
      prompts = [line.replace("\\n", "\n") for line in lines if line]
  elif isinstance(value, str):
    prompts = [value] if value else []
  elif isinstance(value, (tuple, list)) and all(isinstance(p, str) for p in value):
    prompts = list(value)
  else:
    cc.fail("gen.prompts", value, "must be a string, a tuple of strings or a prompts file")
  if not prompts:
    cc.fail("gen.prompts", value, "holds no prompt")
  if not all(prompts):
    cc.fail("gen.prompts", value, f"prompt {prompts.index('')} is empty")
  return prompts


def sampling_params(g: GenConfig, tokenizer, index: int) -> SamplingParams:
  """Prompt `index`'s sampler from the typed gen section."""
  return SamplingParams(
    max_new_tokens=g.max_new_tokens,
    temperature=float(g.temperature),
    top_k=g.top_k,
    top_p=float(g.top_p),
    seed=g.seed + index,
    stop_token_ids=(tokenizer.eos_id,) if g.stop_at_eos else (),
    stop_strings=tuple(g.stop_strings),
  )


def model_source(config) -> str:
  """The checkpoint directory whose recorded model this program uses (looped.programs)."""
  return config.gen.checkpoint


def validate(config, chosen: tuple[str, ...] = ()) -> GenConfig:
  """Checks every field before any compute; raises ConfigError naming the field. Returns the
  typed section."""
  cc.choice(config, "program", ("generate",))
  g = schema.load(GenConfig, config, "gen")
  restore.check_checkpoint(config, "gen")
  model_cfg, data_cfg = model_and_data(config, chosen=chosen)
  mesh_shape, _ = mesh_lib.from_config(config, model_lib.from_config(model_cfg))
  cfg, _, policy = checks.check_section(g, "gen", model_cfg, mesh_shape)
  if isinstance(g.stop_strings, str) or not all(isinstance(s, str) and s for s in g.stop_strings):
    cc.fail("gen.stop_strings", g.stop_strings, "must be a tuple of non-empty strings")
  prompts = load_prompts(g)
  tokenizer = tokenizers.get(data_cfg)
  lengths = [len(tokenizer.encode(p)) for p in prompts]
  if max(lengths) >= cfg.max_seq_len:  # Not even one new token fits: the prompt is at fault.
    i = lengths.index(max(lengths))
    cc.fail(
      "gen.prompts",
      g.prompts,
      f"prompt {i} is {lengths[i]} tokens; the model's max_seq_len {cfg.max_seq_len} leaves no "
      "room for a new token",
    )
  longest = max(lengths) + g.max_new_tokens
  if longest > cfg.max_seq_len:
    cc.fail(
      "gen.max_new_tokens",
      g.max_new_tokens,
      f"the longest prompt ({max(lengths)} tokens) plus max_new_tokens exceeds the model's "
      f"max_seq_len {cfg.max_seq_len}",
    )
  if g.kv_budget_bytes is not None:
    need = -(-(longest - 1) // g.page_size)
    checks.check_budget(g, "gen", cfg, policy, need, "the longest request")
  return g


class _Stream:
  """Prints the part of a request's text not printed yet, token by token."""

  def __init__(self):
    self.printed = 0

  def __call__(self, event) -> None:
    sys.stdout.write(event.text[self.printed :])
    sys.stdout.flush()
    self.printed = len(event.text)


def run(config, workdir: str, chosen: tuple[str, ...] = ()) -> dict[str, Any]:
  g = validate(config, chosen)
  model_cfg, data_cfg = model_and_data(config, chosen=chosen)
  cfg = model_lib.from_config(model_cfg)
  model = LoopedLM(cfg)
  tokenizer = tokenizers.get(data_cfg)
  params = restore.restore_params(model, g.checkpoint, g.step, "gen.checkpoint")
  prompts = load_prompts(g)
  requests = [
    GenRequest(
      i,
      tuple(int(t) for t in tokenizer.encode(p)),
      sampling_params(g, tokenizer, i),
      prompt_text=p,
    )
    for i, p in enumerate(prompts)
  ]
  policy = checks.kv_policy_of(g, "gen", cfg)
  mesh_shape, mesh_rules = mesh_lib.from_config(config, cfg)
  if g.kv_budget_bytes is None:
    num_pages = sum(-(-(r.prompt_len + r.output_len) // g.page_size) for r in requests)
  else:
    num_pages = checks.num_pages(g, cfg, policy)
  settings = checks.engine_config(
    g, cfg, policy, num_pages=num_pages, mesh_shape=mesh_shape, mesh_rules=mesh_rules
  )
  engine = Engine(model, params, settings, decode=tokenizer.decode)
  fmt = settings.kv_format
  stream = g.stream and len(prompts) == 1
  if stream:
    sys.stdout.write(prompts[0])
  generations = engine.generate(requests, on_token=_Stream() if stream else None)
  if stream:
    sys.stdout.write("\n")
  summary = {
    **engine.summary(generations),
    "share_kv": g.share_kv,
    "kv_policy": policy,
    "kv_format": fmt or "raw",
    "checkpoint": g.checkpoint,
  }
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "generations.jsonl"), "w") as f:
    for gen in generations:
      f.write(json.dumps(gen.record()) + "\n")
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  logging.info(
    "generate: %d prompts, %d tokens, %.1f tokens/s, hit rate %s, peak pages %d/%d; wrote %s",
    len(generations),
    summary["generated_tokens"],
    summary["tokens_per_s"] or 0.0,
    summary["hit_rate"],
    summary["peak_pages_in_use"],
    num_pages,
    workdir,
  )
  if summary["speculative_rounds"]:
    logging.info(
      "speculative decoding: %d rounds, %d tokens drafted, %d accepted (acceptance rate %.3f)",
      summary["speculative_rounds"],
      summary["drafted_tokens"],
      summary["accepted_tokens"],
      summary["acceptance_rate"] or 0.0,
    )
  return {"generations": generations, "summary": summary}
