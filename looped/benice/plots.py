"""PNG plots of the shareability report (matplotlib's Agg canvas; no display, no global state)."""

from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, path: str) -> None:
  FigureCanvasAgg(fig)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def residual_norms(path: str, models: dict) -> None:
  """Residual norm ||h_r - h_(r-1)|| and contraction ratio vs recurrence, one line per model."""
  fig = Figure(figsize=(10, 4))
  ax_res, ax_ratio = fig.subplots(1, 2)
  for name, m in models.items():
    r = np.arange(1, len(m["residual_norms"]) + 1)
    ax_res.plot(r, m["residual_norms"], marker="o", label=name)
    ax_ratio.plot(r[1:], m["contraction_ratios"], marker="o", label=name)
  ax_res.set(xlabel="recurrence r", ylabel="||h_r - h_(r-1)||", yscale="log")
  ax_res.set_title("Residual norm (unshared forward)")
  ax_ratio.axhline(1.0, color="gray", lw=0.8, ls="--")
  ax_ratio.set(xlabel="recurrence r", ylabel="residual_r / residual_(r-1)")
  ax_ratio.set_title("Contraction ratio")
  for ax in (ax_res, ax_ratio):
    ax.legend()
    ax.grid(alpha=0.3)
  _save(fig, path)


def _bars(ax, names: list, series: list, title: str, gaps: list[str]) -> None:
  """Grouped bars, zoomed (the axis does not start at 0), so each group is annotated with its
  gap in % to keep the visual difference from being misread."""
  width = 0.8 / len(series)
  x = np.arange(len(names))
  for i, (label, values) in enumerate(series):
    ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
  lo = min(min(v) for _, v in series)
  hi = max(max(v) for _, v in series)
  ax.set_ylim(0.97 * lo, 1.04 * hi)  # Zoomed: the differences are a few percent.
  for xi, text in zip(x, gaps):
    ax.annotate(text, (xi, 1.025 * hi), ha="center", fontsize=7)
  ax.set_xticks(x, names)
  ax.set(ylabel="perplexity (axis does not start at 0)")
  ax.set_title(title)
  ax.legend(fontsize=7, loc="lower right")
  ax.grid(alpha=0.3, axis="y")


def _gap_text(gap: float, ci) -> str:
  return f"gap {100 * gap:+.1f}%\n[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def perplexities(path: str, models: dict) -> None:
  """Shared vs unshared ppl per model: exact decode on the subset; Jacobi on the eval set."""
  names = list(models)
  passes = list(models[names[0]]["ppl_shared_jacobi_eval"])
  fig = Figure(figsize=(11, 4.5))
  ax_exact, ax_jacobi = fig.subplots(1, 2)
  exact = [
    ("unshared (subset)", [models[n]["ppl_unshared_subset"] for n in names]),
    ("shared exact (subset)", [models[n]["ppl_shared_exact_subset"] for n in names]),
  ]
  jacobi = [("unshared (eval)", [models[n]["ppl_unshared_eval"] for n in names])] + [
    (f"shared J{p} (eval)", [models[n]["ppl_shared_jacobi_eval"][p] for n in names]) for p in passes
  ]
  exact_gaps = [_gap_text(models[n]["gap_exact"], models[n]["gap_exact_ci95"]) for n in names]
  last = passes[-1]
  jacobi_gaps = [
    f"J{last} "
    + _gap_text(models[n]["gap_jacobi_eval"][last], models[n]["gap_jacobi_eval_ci95"][last])
    for n in names
  ]
  _bars(ax_exact, names, exact, "Exact shared decode (decode subset)", exact_gaps)
  _bars(ax_jacobi, names, jacobi, "Jacobi shared passes (eval set)", jacobi_gaps)
  _save(fig, path)


def training_curves(path: str, curves: dict) -> None:
  """Training loss (and val_loss points) per stage; BeNice!'s shared/unshared CE separately."""
  fig = Figure(figsize=(11, 4))
  ax_pre, ax_post = fig.subplots(1, 2)
  for stage, records in curves.items():
    ax = ax_pre if stage == "pretrain" else ax_post
    steps = [r["step"] for r in records]
    if "ce_unshared" in records[0]:
      ax.plot(steps, [r["ce_unshared"] for r in records], label=f"{stage} CE unshared")
      if "ce_shared" in records[0]:
        ax.plot(steps, [r["ce_shared"] for r in records], label=f"{stage} CE shared")
    else:
      ax.plot(steps, [r["loss"] for r in records], label=f"{stage} loss")
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if val:
      ax.plot(*zip(*val), marker="o", ls="--", label=f"{stage} val_loss (unshared)")
  ax_pre.set_title("Pretraining")
  ax_post.set_title("Post-training")
  for ax in (ax_pre, ax_post):
    ax.set(xlabel="step", ylabel="nats / token")
    ax.grid(alpha=0.3)
    if ax.lines:
      ax.legend(fontsize=7)
  _save(fig, path)
