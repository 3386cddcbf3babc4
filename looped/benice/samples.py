"""Greedy samples for the report: each model continues the first eval rows, unshared and with the
shared cache, side by side, so a reader sees what a sharing gap does to text.

Generation runs on the engine (looped/engine): the unshared layout is ordinary decoding, the
shared one exact shared decode (docs/design.md §3), both greedy, so the two columns differ only
by what sharing changes. Models with KDA layers get no samples (the engine cannot page a
per-sequence state).
"""

from __future__ import annotations

import json

import numpy as np

from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import GenRequest
from looped.engine.sampling import SamplingParams
from looped.model import mixers
from looped.model.looped_lm import LoopedLM

PAGE_SIZE = 16  # Engine page size for the samples (their pool is sized to hold every request).


def supported(model: LoopedLM) -> bool:
  """Whether every layer pages its cache (a model with a per-sequence state gets no samples)."""
  return mixers.all_with(model.cfg, None, "pages_its_cache")


def prompts(eval_batches: list[dict], num: int, prompt_tokens: int) -> list[tuple[int, ...]]:
  """The first `prompt_tokens` tokens of the first `num` eval rows."""
  rows = np.concatenate([b["inputs"] for b in eval_batches])[:num]
  return [tuple(int(t) for t in row[:prompt_tokens]) for row in rows]


def generate(
  model: LoopedLM, params, prompt_ids, new_tokens: int, decode, kv_policy: str = "final"
) -> list[dict]:
  """Per prompt: its text and the greedy continuations (text and ids) of both layouts (the
  shared one under kv_policy, looped/model/kv_policy.py)."""
  out = [{"prompt": decode(p)} for p in prompt_ids]
  n, prompt = len(prompt_ids), max(len(p) for p in prompt_ids)
  length = prompt + new_tokens
  pages = -(-length // PAGE_SIZE)
  for layout in ("unshared", "shared"):
    # Unshared, every prompt prefills in one call; shared, one token per call (prefill block 1:
    # exact shared decode, what the report's shared gap measures). Every call pads to all rows
    # and the whole table: few shapes to compile.
    engine = Engine(
      model,
      params,
      EngineConfig(
        share_kv=layout == "shared",
        kv_policy=kv_policy if layout == "shared" else "final",
        num_pages=n * pages,
        page_size=PAGE_SIZE,
        max_num_seqs=n,
        max_num_batched_tokens=n * prompt,
        prefill_block=1 if layout == "shared" else prompt,
        max_model_len=length,
        row_buckets=(n,),
        token_buckets=(1, prompt, n * prompt),
        column_buckets=(pages,),
      ),
      decode=decode,
    )
    requests = [
      GenRequest(i, p, SamplingParams(max_new_tokens=new_tokens), prompt_text=decode(p))
      for i, p in enumerate(prompt_ids)
    ]
    for row, gen in zip(out, engine.generate(requests)):
      row[layout], row[f"{layout}_tokens"] = gen.text, gen.tokens
  for row in out:
    same = np.asarray(row["unshared_tokens"]) == np.asarray(row["shared_tokens"])
    row["agree_tokens"] = int(np.argmin(same)) if not same.all() else len(same)
  return out


def _inline(text: str) -> str:
  """Text as one Markdown code span: escapes as JSON does (newlines stay visible)."""
  return "`" + json.dumps(text, ensure_ascii=False)[1:-1].replace("`", "'") + "`"


def markdown(models: dict) -> str:
  """The samples of every model that has them, unshared above shared."""
  lines = []
  for name, m in models.items():
    for i, row in enumerate(m.get("samples") or ()):
      n = len(row["shared_tokens"])
      lines += [
        f"- **{name}**, eval row {i}: prompt {_inline(row['prompt'])}",
        f"  - unshared: {_inline(row['unshared'])}",
        f"  - shared (exact): {_inline(row['shared'])} (first {row['agree_tokens']} of {n} "
        "tokens equal to unshared)",
      ]
  if not lines:
    return ""
  return "\n".join(["Greedy samples (generation engine), unshared vs shared cache:", ""] + lines)
