"""Quality versus memory of the KV-sharing policies: each policy's exact-decode gap (95% CI)
against its cache bytes per token, one panel per model, from a kept pipeline report.

  python experiments/kv_policy_plot.py experiments/results/kv_policies/default_s0 \
      docs/kv_policies/default_s0.png
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

_TITLES = {
  "zero_shot": "zero-shot (pretrained)",
  "finetune": "standard finetune",
  "benice": "BeNice!",
}


def points(model: dict) -> list[tuple[str, float, float, float, float]]:
  """(policy, bytes per token, gap %, CI low %, CI high %), `final` and unshared included."""
  r = model["kv_bytes_per_token"]
  out = [("final", r["shared"], *_pct(model["gap_exact"], model["gap_exact_ci95"]))]
  for name, p in model["kv_policies"].items():
    out.append((name, p["kv_bytes_per_token"], *_pct(p["gap_exact"], p["gap_exact_ci95"])))
  out.append(("unshared", r["unshared"], 0.0, 0.0, 0.0))
  return out


def _pct(gap: float, ci) -> tuple[float, float, float]:
  return 100 * gap, 100 * ci[0], 100 * ci[1]


def plot(run: str, out: str) -> None:
  with open(os.path.join(run, "report", "shareability.json")) as f:
    models = json.load(f)["models"]
  fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), sharey=True)
  for ax, (name, model) in zip(axes, models.items()):
    for policy, nbytes, gap, lo, hi in points(model):
      ax.errorbar(nbytes, gap, yerr=[[gap - lo], [hi - gap]], fmt="o", capsize=3)
      ax.annotate(policy, (nbytes, gap), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.axhline(0.0, color="gray", lw=0.5)
    ax.set_title(_TITLES.get(name, name))
    ax.set_xlabel("KV bytes per token (bf16)")
  axes[0].set_ylabel("gap vs unshared ppl, % (exact decode, 95% CI)")
  fig.tight_layout()
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  fig.savefig(out, dpi=110)


if __name__ == "__main__":
  plot(sys.argv[1], sys.argv[2])
