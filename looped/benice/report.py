"""The shareability report: JSON, a Markdown table and the plots, from the evaluations."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform

from looped.benice import plots, samples, stages
from looped.train.metrics_writer import read_metrics


def build(config, results: dict, stage_dirs: dict) -> dict:
  """{'models': {name: metrics}, 'stages': where each model came from, 'settings': ...}."""
  return {
    "models": results,
    "stages": {
      stage: {
        "workdir": os.path.abspath(d),
        "step": stages.latest_step(d),
        "parent": stages.recorded_parent(d),
      }
      for stage, d in stage_dirs.items()
    },
    "settings": {
      "seed": config.seed,
      "pretrain_depth": config.depth.to_dict(),
      "post_depth": config.post.depth.to_dict(),
      "post_train": config.post.train.to_dict(),
      "benice": config.benice.to_dict(),
      "eval": json.loads(json.dumps(config.eval.to_dict())),
      "versions": versions(),
    },
  }


def versions() -> dict:
  """Python and the numerics-relevant packages: reruns in another environment can differ in the
  last digits (XLA's fusion and reduction order change between releases)."""
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "grain"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def _floats(values, fmt="{:.3f}") -> str:
  return " ".join(fmt.format(v) for v in values)


def pct(x: float) -> str:
  return f"{100 * x:+.1f}%"


def gap_with_ci(gap: float, ci) -> str:
  """'+1.2% [+0.8, +1.6]': a gap and its 95% interval, in percent."""
  return f"{pct(gap)} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


MISSING = "missing"  # A block-prefill gap the evaluation does not have (never shown as 0).


def block_sizes(models) -> list[int]:
  """Every block prefill size C measured in any of these metrics dicts, ascending."""
  return sorted({int(c) for m in models for c in m.get("gap_block", {})})


def block_gap(m: dict, c: int) -> str:
  """Block prefill's gap at C with its 95% interval, or MISSING where `m` has none: a report
  from before block prefill was evaluated, or C not among its eval.prefill_blocks."""
  gaps = m.get("gap_block", {})
  if str(c) not in gaps:
    return MISSING
  return gap_with_ci(gaps[str(c)], m["gap_block_ci95"][str(c)])


def summary(m: dict) -> str:
  """One log line per model."""
  jacobi = ", ".join(f"J{n} {p:.3f}" for n, p in m["ppl_shared_jacobi_eval"].items())
  blocks = "".join(f", C={c} {block_gap(m, c)}" for c in block_sizes([m]))
  return (
    f"ppl unshared (eval) {m['ppl_unshared_eval']:.3f}; subset: unshared "
    f"{m['ppl_unshared_subset']:.3f}, shared exact {m['ppl_shared_exact_subset']:.3f} "
    f"(gap {gap_with_ci(m['gap_exact'], m['gap_exact_ci95'])}{blocks}); eval {jacobi}; "
    f"K drift r=1 {_floats([layer[0] for layer in m['kv_drift']['k']], '{:.2f}')}"
  )


def policy_note(m: dict) -> str:
  """Names the KV-sharing policy the shared metrics read by, where it is not 'final'."""
  policy = m.get("kv_policy", "final")  # Reports from before policies: 'final'.
  if policy == "final":
    return ""
  return f" Shared metrics under KV-sharing policy {policy} (docs/design.md §3)."


def markdown(report: dict) -> str:
  models = report["models"]
  first = next(iter(models.values()))
  passes = list(first["ppl_shared_jacobi_eval"])
  subset = first["decode_subset"]
  blocks = block_sizes(models.values())
  header = (
    ["model", "ppl unshared (eval)"]
    + [f"ppl shared J{n} (eval)" for n in passes]
    + [f"gap J{n} (eval) [95% CI]" for n in passes]
    + ["ppl unshared (subset)", "ppl shared exact (subset)", "gap exact [95% CI]"]
    + [f"gap block C={c} [95% CI]" for c in blocks]
    + ["K drift r=1..R (core layer 0)", "contraction r=2..R", "KV B/token shared / unshared"]
  )
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for name, m in models.items():
    kv = m["kv_bytes_per_token"]
    row = (
      [name, f"{m['ppl_unshared_eval']:.3f}"]
      + [f"{m['ppl_shared_jacobi_eval'][n]:.3f}" for n in passes]
      + [gap_with_ci(m["gap_jacobi_eval"][n], m["gap_jacobi_eval_ci95"][n]) for n in passes]
      + [f"{m['ppl_unshared_subset']:.3f}", f"{m['ppl_shared_exact_subset']:.3f}"]
      + [gap_with_ci(m["gap_exact"], m["gap_exact_ci95"])]
      + [block_gap(m, c) for c in blocks]
      + [_floats(m["kv_drift"]["k"][0], "{:.2f}"), _floats(m["contraction_ratios"], "{:.2f}")]
      + [f"{kv['shared']:.0f} / {kv['unshared']:.0f}"]
    )
    lines.append("| " + " | ".join(row) + " |")
  lines.append("")
  lines.append(
    f"(eval): the whole eval set ({first['eval_tokens']} tokens); (subset): its first "
    f"{subset['rows']} rows ({subset['tokens']} tokens), where exact shared decode runs token "
    "by token. Each gap is shared / unshared ppl - 1 over the same tokens, with a 95% bootstrap "
    "interval over rows. Jn: n Jacobi shared passes. "
    + (
      "Block C: block prefill on the subset, blocks of C tokens from position 0 reading the "
      "shared cache before their block and their own recurrence's K/V inside it (C = 1 is exact "
      f"decode; C >= the row length is the unshared forward; {MISSING}: not evaluated). "
      if blocks
      else ""
    )
    + "K drift: ||K_r - K_R|| / ||K_R|| of the unshared forward; contraction: ratio of "
    "consecutive residual norms ||h_r - h_(r-1)||. KV bytes per token in bf16." + policy_note(first)
  )
  if any(m.get("kv_policies") for m in models.values()):
    lines += ["", kv_policies_markdown(models)]
  if any(m.get("kv_formats") for m in models.values()):
    lines += ["", kv_formats_markdown(models)]
  if any(m.get("samples") for m in models.values()):
    lines += ["", samples.markdown(models)]
  return "\n".join(lines)


def kv_policies_markdown(models: dict) -> str:
  """Exact shared decode's gap under each extra KV-sharing policy, beside its bytes per token."""
  header = [
    "model",
    "KV policy",
    "c(r), r = 1..R",
    "cached recurrences",
    "KV B/token",
    "ppl shared exact (subset)",
    "gap exact [95% CI]",
  ]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for name, m in models.items():
    for policy, f in m.get("kv_policies", {}).items():
      lines.append(
        f"| {name} | {policy} | {' '.join(map(str, f['reads']))} | "
        f"{' '.join(map(str, f['cached']))} | {f['kv_bytes_per_token']:.0f} | "
        f"{f['ppl_shared_exact_subset']:.3f} | {gap_with_ci(f['gap_exact'], f['gap_exact_ci95'])} |"
      )
  lines.append("")
  lines.append(
    "KV-sharing policies (docs/design.md §3): recurrence r reads recurrence c(r)'s cached K/V "
    "of earlier tokens; the cache keeps one copy per core layer for each cached recurrence. "
    "Gap: exact shared decode under the policy vs unshared ppl on the decode subset, 95% "
    "bootstrap interval over rows; KV bytes per token in bf16."
  )
  return "\n".join(lines)


def kv_formats_markdown(models: dict) -> str:
  """Perplexities with the cache read through each KV format, and its bytes per token."""
  first = next(iter(models.values()))
  base = first["kv_bytes_per_token"]["unshared"]  # Unshared bf16: the reference memory.
  header = [
    "model",
    "KV format",
    "ppl unshared (eval)",
    "ppl unshared (subset)",
    "ppl shared exact (subset)",
    "gap exact [95% CI]",
    "KV bytes shared / unshared (x bf16 unshared)",
  ]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for name, m in models.items():
    rows = [("none (fp32)", m)] + list(m.get("kv_formats", {}).items())
    for fmt, f in rows:
      kv = f["kv_bytes_per_token"] if fmt != "none (fp32)" else None
      size = (
        "-"
        if kv is None
        else f"{kv['shared']:.0f} / {kv['unshared']:.0f} "
        f"({kv['shared'] / base:.3f} / {kv['unshared'] / base:.3f})"
        if base  # 0 for an all-KDA model: no per-token cache (state bytes in cache_bytes).
        else f"{kv['shared']:.0f} / {kv['unshared']:.0f}"
      )
      lines.append(
        f"| {name} | {fmt} | {f['ppl_unshared_eval']:.3f} | {f['ppl_unshared_subset']:.3f} | "
        f"{f['ppl_shared_exact_subset']:.3f} | {gap_with_ci(f['gap_exact'], f['gap_exact_ci95'])}"
        f" | {size} |"
      )
  lines.append("")
  lines.append(
    "Every read of an earlier position's K/V goes through the format's per-token quantize/"
    "dequantize (unshared forward, Jacobi passes and exact shared decode, whose cache stores "
    "the packed bytes); 'none' keeps float32 K/V. Gap: exact shared vs unshared ppl on the "
    "decode subset, both in that format."
  )
  return "\n".join(lines)


def _curves(stage_dirs: dict) -> dict:
  out = {}
  for stage, d in stage_dirs.items():
    if os.path.exists(os.path.join(d, "metrics.jsonl")):
      out[stage] = read_metrics(d)
  return out


def write(report_dir: str, report: dict, stage_dirs: dict) -> None:
  """shareability.json, shareability.md and the PNG plots under report_dir."""
  os.makedirs(report_dir, exist_ok=True)
  with open(os.path.join(report_dir, "shareability.json"), "w") as f:
    json.dump(report, f, indent=1)
  with open(os.path.join(report_dir, "shareability.md"), "w") as f:
    f.write(markdown(report) + "\n")
  plots.residual_norms(os.path.join(report_dir, "residual_norms.png"), report["models"])
  plots.perplexities(os.path.join(report_dir, "perplexity.png"), report["models"])
  plots.training_curves(os.path.join(report_dir, "training_curves.png"), _curves(stage_dirs))
