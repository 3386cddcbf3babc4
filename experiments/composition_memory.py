"""KV-cache memory per token of each mixer of experiments/composition.sh, relative to bf16
unshared GQA, at a given context (KDA's per-sequence state amortised over it).

  python experiments/composition_memory.py [--context=4096]
"""

from __future__ import annotations

import argparse

from configs import benice
from looped.model import from_config, mixers

FORMATS = ("bf16", "fp8", "mxfp8", "nvfp4")


def table(context: int) -> str:
  configs = {}
  for name in benice.MIXERS:
    c = benice.get_config(name)
    configs[name] = from_config(c.model)
  base = mixers.cache_bytes(configs["gqa"], "bf16")["per_token"]["unshared"]
  lines = [
    f"KV-cache bytes per token at {context} tokens of context (KDA state / {context}), "
    "shared / unshared, relative to bf16 unshared GQA "
    f"({base:.0f} B/token):",
    "",
    "| mixer | " + " | ".join(FORMATS) + " |",
    "|---|" + "---|" * len(FORMATS),
  ]
  for name, cfg in configs.items():
    cells = []
    for fmt in FORMATS:
      b = mixers.cache_bytes(cfg, fmt)
      per = {k: b["per_token"][k] + b["per_sequence"][k] / context for k in ("shared", "unshared")}
      cells.append(f"{per['shared'] / base:.3f} / {per['unshared'] / base:.3f}")
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--context", type=int, default=4096)
  print(table(parser.parse_args().context))
