"""Tables, shared-vs-unshared comparisons and plots of a serve_sim sweep."""

from __future__ import annotations

import os
from typing import Any

# The paper's best relative improvements of KV-sharing (abstract): hit rate, throughput, p90 TTFT.
PAPER = {"hit_rate": 0.314, "throughput": 0.236, "ttft_p90": -0.836}


def variant_name(share_kv: bool, kv_format: str) -> str:
  return f"{'shared' if share_kv else 'unshared'}+{kv_format}"


def gb(budget: float | None) -> str:
  return "unbounded" if budget is None else f"{budget / 1e9:g} GB"


def _rel(new: float | None, old: float | None) -> float | None:
  if new is None or old is None or old == 0:
    return None
  return new / old - 1.0


def improvements(runs: list[dict[str, Any]]) -> dict[str, Any]:
  """Each shared variant against the unshared baseline at the same budget.

  The baseline is unshared bf16 when it was run, else unshared in the same format. Hit rate is
  reported both as a difference in points and relative; throughput (output tokens/s) and p90
  TTFT relative. `best` holds the most favourable value of each over the budgets.
  """
  by_key = {(r["kv_budget_bytes"], r["share_kv"], r["kv_format"]): r for r in runs}
  rows = []
  for r in runs:
    if not r["share_kv"]:
      continue
    budget = r["kv_budget_bytes"]
    base = by_key.get((budget, False, "bf16")) or by_key.get((budget, False, r["kv_format"]))
    if base is None:
      continue
    rows.append(
      {
        "variant": variant_name(True, r["kv_format"]),
        "baseline": variant_name(False, base["kv_format"]),
        "kv_budget_bytes": budget,
        "hit_rate_points": None
        if r["hit_rate"] is None or base["hit_rate"] is None
        else r["hit_rate"] - base["hit_rate"],
        "hit_rate": _rel(r["hit_rate"], base["hit_rate"]),
        "throughput": _rel(r["output_tokens_per_s"], base["output_tokens_per_s"]),
        "ttft_p90": _rel(r["ttft_s"]["p90"], base["ttft_s"]["p90"]),
      }
    )
  best = {}
  for variant in sorted({row["variant"] for row in rows}):
    mine = [row for row in rows if row["variant"] == variant]
    best[variant] = {}
    for metric, pick in (
      ("hit_rate_points", max),
      ("hit_rate", max),
      ("throughput", max),
      ("ttft_p90", min),
    ):
      values = [(row[metric], row["kv_budget_bytes"]) for row in mine if row[metric] is not None]
      if values:
        value, budget = pick(values, key=lambda v: v[0])
        best[variant][metric] = {"value": value, "kv_budget_bytes": budget}
  return {"per_budget": rows, "best": best}


def _pct(x: float | None, points: bool = False) -> str:
  if x is None:
    return "n/a"
  return f"{100 * x:+.1f} pp" if points else f"{100 * x:+.1f}%"


def _num(x: float | None, fmt: str) -> str:
  return "n/a" if x is None else format(x, fmt)


def markdown(results: dict[str, Any]) -> str:
  """The sweep as Markdown: one row per run, then the improvements next to the paper's."""
  lines = [
    "| layout | budget | pages | hit rate (ideal) | req/s | out tok/s | TTFT p50 / p90 / p99 (s) "
    "| TPOT p50 / p90 (ms) | preempt | rejected | busy |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results["runs"]:
    ttft, tpot = r["ttft_s"], r["tpot_s"]
    tpot_ms = [None if v is None else 1e3 * v for v in (tpot["p50"], tpot["p90"])]
    lines.append(
      f"| {variant_name(r['share_kv'], r['kv_format'])} | {gb(r['kv_budget_bytes'])} "
      f"| {r['num_pages'] if r['num_pages'] is not None else 'inf'} "
      f"| {_num(r['hit_rate'], '.3f')} ({_num(r.get('ideal_lru_hit_rate'), '.3f')}) "
      f"| {_num(r['requests_per_s'], '.3f')} "
      f"| {_num(r['output_tokens_per_s'], '.0f')} "
      f"| {_num(ttft['p50'], '.2f')} / {_num(ttft['p90'], '.2f')} / {_num(ttft['p99'], '.2f')} "
      f"| {_num(tpot_ms[0], '.1f')} / {_num(tpot_ms[1], '.1f')} | {r['preemptions']} "
      f"| {r['num_rejected']} | {_num(r['busy_fraction'], '.2f')} |"
    )
  offered = results.get("trace", {}).get("offered_requests_per_s")
  lines += [
    "",
    "(ideal): hit rate of an LRU cache of whole blocks as large as the budget with no room taken "
    "by running requests (traces.ideal_hit_rate).",
  ]
  if offered:
    lines += [
      "",
      f"Offered load: {offered:.3f} requests/s. A run whose req/s falls short of it could not keep "
      "up: its queue grew for the whole trace, and its TTFT is mostly that queueing.",
    ]
  rows = results["improvements"]["per_budget"]
  if rows:
    lines += [
      "",
      "| shared variant vs baseline | budget | hit rate | out tok/s | p90 TTFT |",
      "|---|---|---|---|---|",
    ]
    for row in rows:
      lines.append(
        f"| {row['variant']} vs {row['baseline']} | {gb(row['kv_budget_bytes'])} "
        f"| {_pct(row['hit_rate_points'], points=True)} ({_pct(row['hit_rate'])}) "
        f"| {_pct(row['throughput'])} | {_pct(row['ttft_p90'])} |"
      )
    lines += [
      "",
      "| best over budgets | hit rate | out tok/s | p90 TTFT |",
      "|---|---|---|---|",
      f"| paper (BeNice!) | {_pct(PAPER['hit_rate'])} | {_pct(PAPER['throughput'])} "
      f"| {_pct(PAPER['ttft_p90'])} |",
    ]
    for variant, best in results["improvements"]["best"].items():

      def cell(metric, points=False, best=best):
        if metric not in best:
          return "n/a"
        return f"{_pct(best[metric]['value'], points)} @ {gb(best[metric]['kv_budget_bytes'])}"

      lines.append(
        f"| {variant} | {cell('hit_rate_points', True)}; {cell('hit_rate')} "
        f"| {cell('throughput')} | {cell('ttft_p90')} |"
      )
  return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], out_dir: str) -> list[str]:
  """hit_rate.png, throughput.png and ttft_p90.png against the budget, one line per variant.

  Unbounded runs cannot sit on a budget axis; they are drawn as dashed horizontal lines.
  """
  import matplotlib

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt

  panels = (  # (file, y label, value, log y: TTFT spans orders of magnitude under load)
    ("hit_rate.png", "prefix-cache hit rate", lambda r: r["hit_rate"], False),
    ("throughput.png", "output tokens / s", lambda r: r["output_tokens_per_s"], False),
    ("ttft_p90.png", "p90 TTFT (s)", lambda r: r["ttft_s"]["p90"], True),
  )
  ticks = sorted({r["kv_budget_bytes"] / 1e9 for r in runs if r["kv_budget_bytes"] is not None})
  variants = sorted({(r["share_kv"], r["kv_format"]) for r in runs}, reverse=True)
  paths = []
  for filename, ylabel, value, log_y in panels:
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (share, fmt) in enumerate(variants):
      color = f"C{i}"
      mine = [r for r in runs if (r["share_kv"], r["kv_format"]) == (share, fmt)]
      bounded = sorted(
        (r["kv_budget_bytes"] / 1e9, value(r))
        for r in mine
        if r["kv_budget_bytes"] is not None and value(r) is not None
      )
      if bounded:
        xs, ys = zip(*bounded)
        ax.plot(xs, ys, marker="o", color=color, label=variant_name(share, fmt))
      for r in mine:
        if r["kv_budget_bytes"] is None and value(r) is not None:
          ax.axhline(
            value(r),
            color=color,
            linestyle="--",
            linewidth=1,
            label=f"{variant_name(share, fmt)} unbounded",
          )
    ax.set_xscale("log")
    if ticks:
      ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
      ax.minorticks_off()
    if log_y:
      ax.set_yscale("log")
    ax.set_xlabel("KV budget (GB)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out_dir, filename)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)
  return paths
