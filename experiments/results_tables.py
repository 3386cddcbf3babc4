r"""Every results table of README.md and docs/, printed from the reports in experiments/results/.

  python experiments/results_tables.py                  # the names of the tables
  python experiments/results_tables.py gap_sweep        # print one table
  python experiments/results_tables.py --check          # do README.md and docs/ hold them? (exit 1)
  python experiments/results_tables.py --write          # rewrite them in place

A page holds a generated table between two marker lines, which Markdown does not render:

  <!-- table: gap_sweep -->
  | point | ... |
  <!-- end table -->

`--check` compares the text between each pair of markers with what this script prints for that
name; tests/docs_test.py runs the same check, so a table edited by hand, or a report changed
without regenerating its table, fails the tests. The tables are built by the scripts that own
them (experiments/gap_table.py, experiments/composition_table.py,
experiments/composition_memory.py, experiments/recipe_table.py, experiments/depth_table.py) and,
for the pipeline reports, by the functions below.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from collections.abc import Callable

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)  # Run as a script from anywhere: the experiments/ scripts import too.
sys.path.insert(0, os.path.join(_REPO, "experiments"))

import composition_memory  # noqa: E402
import composition_table  # noqa: E402
import depth_table  # noqa: E402
import gap_table  # noqa: E402
import recipe_table  # noqa: E402

from configs import pretrain  # noqa: E402
from looped import kv_quant  # noqa: E402
from looped.benice import collect, timing  # noqa: E402
from looped.benice.report import MISSING, block_sizes, gap_with_ci, pct  # noqa: E402
from looped.model import from_config, mixers  # noqa: E402

RESULTS = os.path.join(_REPO, "experiments", "results")
# Pages that may hold generated tables, relative to the repository root.
PAGES = ("README.md", "docs/*.md")
_MARKER = re.compile(
  r"^<!-- table: (?P<name>[a-z0-9_]+) -->\n(?P<body>.*?)^<!-- end table -->$", re.M | re.S
)

_MODEL_NAMES = {
  "zero_shot": "zero-shot (pretrained)",
  "finetune": "standard finetune",
  "benice": "BeNice!",
}


def _results(*parts: str) -> str:
  return os.path.join(RESULTS, *parts)


def _report(run: str) -> dict:
  return collect.load(_results(run))


def _floats(xs, fmt: str = "{:.2f}") -> str:
  return " ".join(fmt.format(x) for x in xs)


def gap_sweep() -> str:
  return gap_table.table(gap_table.points([_results("gap_sweep")]))


def _composition_runs() -> dict:
  return composition_table.load_runs(sorted(glob.glob(_results("composition", "*_s[0-9]"))))


def composition() -> str:
  return composition_table.table(_composition_runs())


def composition_per_seed() -> str:
  return composition_table.per_seed_table(_composition_runs())


def composition_memory_table() -> str:
  return composition_memory.table(4096)


def kv_bytes() -> str:
  """Bytes per token of the default model's cache in each KV format (scales included, nvfp4's
  per-token tensor scale not), shared and unshared; computed from the code, not a report."""
  cfg = from_config(pretrain.get_config().model)
  base = mixers.cache_bytes(cfg, "bf16")["per_token"]["unshared"]
  lines = [
    "| format | bytes/value | shared B/token | unshared B/token | shared / (bf16 unshared) |",
    "|---|---:|---:|---:|---:|",
  ]
  for fmt in kv_quant.FORMATS:
    b = mixers.cache_bytes(cfg, fmt)["per_token"]
    lines.append(
      f"| {fmt} | {kv_quant.bytes_per_value(fmt, cfg.head_dim):g} | {b['shared']:.0f} | "
      f"{b['unshared']:.0f} | {b['shared'] / base:.3f} |"
    )
  return "\n".join(lines)


def default_command() -> str:
  """The main command's report (default_command/default_s0): one row per model."""
  models = _report("default_command/default_s0")["models"]
  rows = next(iter(models.values()))["decode_subset"]["rows"]
  lines = [
    f"| model | ppl unshared | ppl shared exact ({rows} rows) | gap exact [95% CI] | "
    "gap J4 [95% CI] | K drift r=1..R (core layer 0) | contraction r=2..R |",
    "|---|---:|---:|---:|---:|---|---|",
  ]
  for name, m in models.items():
    lines.append(
      f"| {_MODEL_NAMES[name]} | {m['ppl_unshared_subset']:.3f} | "
      f"{m['ppl_shared_exact_subset']:.3f} | {gap_with_ci(m['gap_exact'], m['gap_exact_ci95'])} | "
      f"{gap_with_ci(m['gap_jacobi_eval']['4'], m['gap_jacobi_eval_ci95']['4'])} | "
      f"{_floats(m['kv_drift']['k'][0])} | {_floats(m['contraction_ratios'])} |"
    )
  return "\n".join(lines)


def default_command_timing() -> str:
  """The main command's stage table (default_command/default_s0/timing.json)."""
  with open(_results("default_command", "default_s0", "timing.json")) as f:
    table = timing.markdown(json.load(f))
  return table.split("\n\n")[0]


def default_command_kv_formats() -> str:
  """The main command's models read through each KV format; bytes relative to bf16 unshared."""
  models = _report("default_command/default_s0")["models"]
  lines = [
    "| model | KV format | ppl unshared | ppl shared exact | gap exact [95% CI] | "
    "KV B/token shared / unshared (x bf16 unshared) |",
    "|---|---|---:|---:|---:|---|",
  ]
  for name, m in models.items():
    base = m["kv_bytes_per_token"]["unshared"]
    for fmt, f in [("fp32 (none)", m)] + list(m["kv_formats"].items()):
      kv = f["kv_bytes_per_token"]
      size = (
        "-"
        if fmt == "fp32 (none)"
        else f"{kv['shared']:.0f} / {kv['unshared']:.0f} "
        f"({kv['shared'] / base:.3f} / {kv['unshared'] / base:.3f})"
      )
      lines.append(
        f"| {_MODEL_NAMES[name]} | {fmt} | {f['ppl_unshared_subset']:.3f} | "
        f"{f['ppl_shared_exact_subset']:.3f} | {gap_with_ci(f['gap_exact'], f['gap_exact_ci95'])} "
        f"| {size} |"
      )
  return "\n".join(lines)


def _gap2(gap: float | None, ci) -> str:
  """A gap and its 95% interval in percent with two decimals (the default model's gaps are
  hundredths of a percent); 'missing' where the report has none."""
  if gap is None:
    return MISSING
  return f"{100 * gap:+.2f}% [{100 * ci[0]:+.2f}, {100 * ci[1]:+.2f}]"


# Runs of the block prefill table (experiments/results/block_prefill/): (regime, run).
# Runs of the block-prefill table (experiments/results/block_prefill/): (regime, run, names).
_BLOCK_PREFILL_RUNS = (
  ("default", "default_s0", _MODEL_NAMES),
  ("`:fixed`", "fixed_s0", _MODEL_NAMES),
  ("`:fixed`", "fixed_s0_benice_c16", {"benice": "BeNice! trained with C = 16 reads"}),
)


def block_prefill() -> str:
  """Block prefill gaps of the default model and the `:fixed` variant, seed 0 (and BeNice!
  trained with block reads, benice.prefill_block = 16, from the same pretraining): C = 1 is exact
  shared decode (gap_exact); every gap over the same 128 rows, vs their unshared perplexity."""
  runs = [
    (regime, names, _report(f"block_prefill/{run}")["models"])
    for regime, run, names in _BLOCK_PREFILL_RUNS
  ]
  blocks = block_sizes(m for _, _, models in runs for m in models.values())
  sub = next(iter(runs[0][2].values()))["decode_subset"]
  t = sub["tokens"] // sub["rows"]  # Tokens per row: a block of C >= t is the whole row.
  lines = [
    f"| regime | model | ppl unshared ({sub['rows']} rows) | gap C=1 (exact decode) [95% CI] | "
    + " | ".join(f"gap C={c}{' (>= T: unshared)' if c >= t else ''} [95% CI]" for c in blocks)
    + " |",
    "|---|---|---:|---:|" + "---:|" * len(blocks),
  ]
  for regime, names, models in runs:
    for name, m in models.items():
      gaps = [
        _gap2(m.get("gap_block", {}).get(str(c)), m.get("gap_block_ci95", {}).get(str(c)))
        for c in blocks
      ]
      lines.append(
        f"| {regime} | {names[name]} | {m['ppl_unshared_subset']:.3f} | "
        f"{_gap2(m['gap_exact'], m['gap_exact_ci95'])} | " + " | ".join(gaps) + " |"
      )
  return "\n".join(lines)


# The `:fixed` regime's rows: (label, run prefix, model); each run exists per seed (_s0, _s1).
_FIXED_ROWS = (
  ("zero-shot (pretrained)", "fixed", "zero_shot"),
  ("standard finetune", "fixed", "finetune"),
  ("BeNice! (`all`, kv_passes 3: the `:fixed` default)", "fixed", "benice"),
  ("BeNice! (`all`, kv_passes 0: the paper's)", "benice_kv0_all", "benice"),
  ("BeNice! (`first`, kv_passes 0: the paper's wording)", "benice_kv0_first", "benice"),
  ("BeNice! (`first`, kv_passes 3; on the rerun pretraining)", "benice_kv3_first", "benice"),
  ("stochastic-depth pretraining, same architecture (zero-shot)", "poisson", "zero_shot"),
)


def fixed_regime() -> str:
  """BeNice! in the `:fixed` regime, seeds 0 and 1 (experiments/results/fixed_regime/)."""
  lines = [
    "| model | seed | ppl unshared | ppl shared exact | gap exact [95% CI] | gap J1 [95% CI] | "
    "gap J4 [95% CI] |",
    "|---|---|---:|---:|---:|---:|---:|",
  ]
  for label, run, model in _FIXED_ROWS:
    for seed in (0, 1):
      m = _report(f"fixed_regime/{run}_s{seed}")["models"][model]
      jacobi = [gap_with_ci(m["gap_jacobi_eval"][n], m["gap_jacobi_eval_ci95"][n]) for n in "14"]
      lines.append(
        f"| {label} | {seed} | {m['ppl_unshared_subset']:.3f} | "
        f"{m['ppl_shared_exact_subset']:.3f} | {gap_with_ci(m['gap_exact'], m['gap_exact_ci95'])} "
        f"| {jacobi[0]} | {jacobi[1]} |"
      )
  return "\n".join(lines)


def fixed_regime_reruns() -> str:
  """Seed 0's and seed 1's `:fixed` pipelines run twice: the exact gaps side by side."""
  lines = [
    "| seed | model | ppl unshared (first run / rerun) | gap exact, first run | gap exact, rerun |",
    "|---|---|---|---:|---:|",
  ]
  for seed in (0, 1):
    first = _report(f"fixed_regime/fixed_s{seed}")["models"]
    rerun = _report(f"fixed_regime/fixed_s{seed}_rerun")["models"]
    for model in ("zero_shot", "finetune", "benice"):
      a, b = first[model], rerun[model]
      lines.append(
        f"| {seed} | {_MODEL_NAMES[model]} | {a['ppl_unshared_subset']:.5f} / "
        f"{b['ppl_unshared_subset']:.5f} | {gap_with_ci(a['gap_exact'], a['gap_exact_ci95'])} | "
        f"{gap_with_ci(b['gap_exact'], b['gap_exact_ci95'])} |"
      )
  return "\n".join(lines)


def headline() -> str:
  """README's results table: the exact-decode sharing gap of each model, with where it is from."""
  default = _report("default_command/default_s0")["models"]
  fixed = [_report(f"fixed_regime/fixed_s{s}")["models"] for s in (0, 1)]
  poisson = [_report(f"fixed_regime/poisson_s{s}")["models"] for s in (0, 1)]
  runs = _composition_runs()

  def seeds(ms: list[dict], model: str) -> str:
    return " / ".join(pct(m[model]["gap_exact"]) for m in ms)

  lines = [
    "| setting | zero-shot | standard finetune | BeNice! | from |",
    "|---|---:|---:|---:|---|",
    f"| main command: stochastic depth, default model, seed 0 | "
    f"{pct(default['zero_shot']['gap_exact'])} | {pct(default['finetune']['gap_exact'])} | "
    f"{pct(default['benice']['gap_exact'])} | "
    "[default command](docs/results.md#the-default-command) |",
    f"| `:fixed` regime (fixed depth), seeds 0 / 1 | {seeds(fixed, 'zero_shot')} | "
    f"{seeds(fixed, 'finetune')} | {seeds(fixed, 'benice')} | "
    "[`:fixed` regime](docs/results.md#benice-in-the-fixed-regime) |",
    f"| same architecture, stochastic depth, seeds 0 / 1 | {seeds(poisson, 'zero_shot')} | - | - "
    "| [`:fixed` regime](docs/results.md#benice-in-the-fixed-regime) |",
  ]
  for mixer in composition_table.MIXERS:
    reports = [r["models"] for r in runs[("fixed", mixer)]]
    lines.append(
      f"| {mixer.upper() if mixer != 'hybrid' else 'KDA:MLA hybrid'}, fixed depth (smaller "
      f"scale), seeds 0 / 1 | {seeds(reports, 'zero_shot')} | {seeds(reports, 'finetune')} | "
      f"{seeds(reports, 'benice')} | [composition](docs/results.md#mixers-the-composition-table) |"
    )
  return "\n".join(lines)


def recipe_sweep() -> str:
  """The BeNice! recipe sweep in the `:fixed` regime (experiments/results/recipe/)."""
  return recipe_table.markdown(recipe_table.rows(recipe_table.load_runs(_results("recipe"))))


def recipe_mla() -> str:
  """The configured recipe and distillation with every layer MLA (`:fixed,mla`)."""
  return recipe_table.markdown(recipe_table.rows(recipe_table.load_runs(_results("recipe_mla"))))


def recipe_wide() -> str:
  """The capacity test: the configured recipe on a 1.5x wider `:fixed` model."""
  return recipe_table.markdown(recipe_table.rows(recipe_table.load_runs(_results("recipe_wide"))))


def recipe_curves() -> str:
  """Seed 0's finetune and BeNice! learning curves to 1,000 steps."""
  return recipe_table.curves_table(_results("recipe_curves", "curves_s0"))


# Runs of the KV-policy table (experiments/results/kv_policies/): (regime, run, model names).
_KV_POLICY_RUNS = (
  ("default", "default_s0", _MODEL_NAMES),
  ("`:fixed` seed 0", "fixed_s0", _MODEL_NAMES),
  ("`:fixed` seed 1", "fixed_s1", _MODEL_NAMES),
  ("tiny Parcae", "parcae_tiny_s0", {"zero_shot": "converted (random weights)"}),
)


def kv_policies() -> str:
  """Each KV-sharing policy's exact-decode gap and bytes for the default model's and the
  `:fixed` variant's three stages (seeds 0 and 1) and the converted tiny Parcae
  (experiments/results/kv_policies/): `final` is the
  report's own exact gap, the unshared cache the reference every gap is measured against."""
  lines = [
    "| regime | model | KV policy | c(r), r = 1..R | cached recurrences | KV B/token (bf16) | "
    "ppl shared exact | gap exact [95% CI] |",
    "|---|---|---|---|---|---:|---:|---:|",
  ]
  for regime, run, model_names in _KV_POLICY_RUNS:
    for name, m in _report(f"kv_policies/{run}")["models"].items():
      kv, policies = m["kv_bytes_per_token"], m["kv_policies"]
      r = len(next(iter(policies.values()))["reads"])
      rows = [("final", " ".join([str(r)] * r), str(r), kv["shared"], m)]
      for policy, p in policies.items():
        reads, cached = " ".join(map(str, p["reads"])), " ".join(map(str, p["cached"]))
        rows.append((policy, reads, cached, p["kv_bytes_per_token"], p))
      for policy, reads, cached, nbytes, p in rows:
        lines.append(
          f"| {regime} | {model_names[name]} | {policy} | {reads} | {cached} | {nbytes:,.0f} | "
          f"{p['ppl_shared_exact_subset']:.3f} | {_gap2(p['gap_exact'], p['gap_exact_ci95'])} |"
        )
      lines.append(
        f"| {regime} | {model_names[name]} | unshared | - | all {r} | {kv['unshared']:,.0f} | "
        f"{m['ppl_unshared_subset']:.3f} | 0 |"
      )
  return "\n".join(lines)


# The live serving sweep (benchmarks/serve_replay.py's --out JSON, per-request times dropped),
# and the earlier one: the default model, served by the engine before the chunk write.
_SERVING_LIVE = ("serving_live", "serve_sweep.json")
_SERVING_LIVE_DENSE_WRITE = "serve_sweep_dense_write.json"
# The same runs simulated with every step priced 12% dearer (what the engine-alone runs measured).
_SERVING_LIVE_SCALED = "serve_sweep_scaled.json"
# The equal-quality sweep: the default model's BeNice! stage (sharing gaps 0.0%) on a faster stream.
_SERVING_LIVE_BENICE = "serve_sweep_benice.json"
_PAPER = {"hit rate": 0.314, "output tok/s": 0.236, "TTFT p90": -0.836}  # Simulated, its abstract.


def _serving_configs(name: str = _SERVING_LIVE[1]) -> list[dict]:
  with open(_results(_SERVING_LIVE[0], name)) as f:
    return json.load(f)["configs"]


def _median(values) -> float:
  v = sorted(values)
  n = len(v)
  return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def _spread(values, fmt: str) -> str:
  """median [min-max] over the repeats."""
  lo, hi = min(values), max(values)
  med = fmt.format(_median(values))
  return med if fmt.format(lo) == fmt.format(hi) else f"{med} [{fmt.format(lo)}-{fmt.format(hi)}]"


_LIVE_FIGURES = (
  ("hit rate", lambda m: m["hit_rate"], "{:.3f}"),
  ("output tok/s", lambda m: m["output_tokens_per_s"], "{:.1f}"),
  ("TTFT p50 (s)", lambda m: m["ttft_s"]["p50"], "{:.1f}"),
  ("TTFT p90 (s)", lambda m: m["ttft_s"]["p90"], "{:.1f}"),
  ("TPOT p50 (ms)", lambda m: 1e3 * m["tpot_s"]["p50"], "{:.0f}"),
  ("preemptions", lambda m: m["preemptions"], "{:.0f}"),
  ("mean step (ms)", lambda m: 1e3 * m["mean_step_s"], "{:.1f}"),
)


def serving_live(name: str = _SERVING_LIVE[1]) -> str:
  """Each configuration of the live sweep: median [min-max] over its repeats."""
  configs = _serving_configs(name)
  head = ["KV budget", "pages", "format", "layout", "runs"] + [n for n, _, _ in _LIVE_FIGURES]
  lines = ["| " + " | ".join(head) + " |", "|---:|---:|---|---|" + "---:|" * (len(head) - 4)]
  for c in configs:
    cells = [f"{c['budget'] / 1e6:g} MB", str(c["num_pages"]), c["kv_format"], c["layout"]]
    cells.append(str(len(c["measured"])))
    cells += [_spread([get(m) for m in c["measured"]], fmt) for _, get, fmt in _LIVE_FIGURES]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def _depth_reports() -> dict:
  return depth_table.load(_results("test_time_depth"))


_SPECULATIVE_MODELS = {"default_benice": "default, BeNice!", "fixed_benice": "`:fixed`, BeNice!"}


def speculative_quality() -> str:
  """Speculative decoding's teacher-forced path under sharing (experiments/speculative_quality.py):
  block verification of k tokens against exact shared decode, per model."""
  lines = [
    "| model | ppl exact shared decode | ppl unshared (vs exact [95% CI]) | "
    + " | ".join(f"k={k}: ppl (vs exact [95% CI])" for k in (2, 4, 8))
    + " |",
    "|---|---:|---:|" + "---:|" * 3,
  ]
  for name, label in _SPECULATIVE_MODELS.items():
    with open(_results("speculative", name, "quality.json")) as f:
      results = json.load(f)["results"]
    cell = lambda r: f"{r['ppl']:.3f} ({gap_with_ci(r['gap_vs_exact_shared'], r['gap_ci95'])})"
    exact = results["exact shared decode (C=1)"]["ppl"]
    blocks = " | ".join(cell(results[f"block C={k}"]) for k in (2, 4, 8))
    lines.append(f"| {label} | {exact:.3f} | {cell(results['unshared'])} | {blocks} |")
  return "\n".join(lines)


def speculative_engine() -> str:
  """Decode tokens/s with and without speculation (benchmarks/engine.py --speculative_sweep)."""
  lines = [
    "| model | layout | batch | setting | tokens/s | speed-up | acceptance | tokens/round | "
    "identical requests | agreement |",
    "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, label in _SPECULATIVE_MODELS.items():
    with open(_results("speculative", f"engine_{name}.json")) as f:
      rows = json.load(f)["speculative_sweep"]
    for r in rows:
      tail = "- | - | - | - |"
      if r["setting"] != "plain":
        tail = (
          f"{r['acceptance_rate']:.2f} | {r['tokens_per_round']:.2f} | "
          f"{r['identical_requests']}/8 | {r['agreement']:.3f} |"
        )
      lines.append(
        f"| {label} | {r['layout']} | {r['max_num_seqs']} | {r['setting']} | "
        f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f} | {tail}"
      )
  return "\n".join(lines)


def serving_live_changes(name: str = _SERVING_LIVE[1]) -> str:
  """Shared over unshared at each budget and format (medians over repeats; the range pairs the
  worst shared run with the best unshared one and the reverse), beside the paper's figures."""
  by = {(c["budget"], c["kv_format"], c["layout"]): c for c in _serving_configs(name)}
  figures = (
    ("hit rate", lambda m: m["hit_rate"], "{:.3f}"),
    ("output tok/s", lambda m: m["output_tokens_per_s"], "{:.1f}"),
    ("TTFT p90", lambda m: m["ttft_s"]["p90"], "{:.1f} s"),
  )
  lines = [
    "| KV budget | format | " + " | ".join(f"{f[0]}: unshared -> shared" for f in figures) + " |",
    "|---:|---|" + "---:|" * len(figures),
  ]
  for (budget, fmt, layout), shared in by.items():
    if layout != "shared":
      continue
    unshared = by[(budget, fmt, "unshared")]
    cells = [f"{budget / 1e6:g} MB", fmt]
    for _, get, fmt in figures:
      u = [get(m) for m in unshared["measured"]]
      s = [get(m) for m in shared["measured"]]
      change = _median(s) / _median(u) - 1
      bounds = sorted((min(s) / max(u) - 1, max(s) / min(u) - 1))
      cells.append(
        f"{fmt.format(_median(u))} -> {fmt.format(_median(s))}: **{change:+.0%}** "
        f"[{bounds[0]:+.0%}, {bounds[1]:+.0%}]"
      )
    lines.append("| " + " | ".join(cells) + " |")
  paper = " | ".join(f"{_PAPER[f[0]]:+.1%}" for f in figures)
  lines.append(f"| the paper (simulated) | | {paper} |")
  return "\n".join(lines)


def serving_live_sim(name: str = _SERVING_LIVE[1]) -> str:
  """The simulator's prediction for each configuration: measured / simulated, the median over
  the repeats, and what the padded engine computes over what the batch needs (simulated)."""
  lines = [
    "| KV budget | format | layout | hit rate measured / sim | output tok/s | TTFT p50 | "
    "TTFT p90 | mean step | padded tokens | padded attention |",
    "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
  ]
  ratio = lambda c, get: _median([get(m) for m in c["measured"]]) / get(c["simulated"])
  for c in _serving_configs(name):
    sim = c["simulated"]
    cells = [f"{c['budget'] / 1e6:g} MB", c["kv_format"], c["layout"]]
    cells.append(f"{_median([m['hit_rate'] for m in c['measured']]):.3f} / {sim['hit_rate']:.3f}")
    for get in (
      lambda m: m["output_tokens_per_s"],
      lambda m: m["ttft_s"]["p50"],
      lambda m: m["ttft_s"]["p90"],
      lambda m: m["mean_step_s"],
    ):
      cells.append(f"{ratio(c, get):.2f}")
    cells += [f"{sim['padded_token_ratio']:.2f}", f"{sim['padded_attention_ratio']:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
  "headline": headline,
  "default_command": default_command,
  "default_command_kv_formats": default_command_kv_formats,
  "default_command_timing": default_command_timing,
  "gap_sweep": gap_sweep,
  "fixed_regime": fixed_regime,
  "block_prefill": block_prefill,
  "kv_policies": kv_policies,
  "fixed_regime_reruns": fixed_regime_reruns,
  "composition": composition,
  "composition_per_seed": composition_per_seed,
  "composition_memory": composition_memory_table,
  "kv_bytes": kv_bytes,
  "recipe_sweep": recipe_sweep,
  "recipe_curves": recipe_curves,
  "recipe_mla": recipe_mla,
  "recipe_wide": recipe_wide,
  "serving_live": serving_live,
  "serving_live_changes": serving_live_changes,
  "serving_live_sim": serving_live_sim,
  "serving_live_changes_dense_write": lambda: serving_live_changes(_SERVING_LIVE_DENSE_WRITE),
  "serving_live_sim_scaled": lambda: serving_live_sim(_SERVING_LIVE_SCALED),
  "serving_live_benice": lambda: serving_live(_SERVING_LIVE_BENICE),
  "serving_live_changes_benice": lambda: serving_live_changes(_SERVING_LIVE_BENICE),
  "serving_live_sim_benice": lambda: serving_live_sim(_SERVING_LIVE_BENICE),
  "speculative_quality": speculative_quality,
  "speculative_engine": speculative_engine,
  "test_time_depth_exits": lambda: depth_table.exits_table(_depth_reports()),
  "test_time_depth_fixed": lambda: depth_table.fixed_table(_depth_reports()),
}


def pages(root: str = _REPO) -> list[str]:
  out = []
  for pattern in PAGES:
    out += sorted(glob.glob(os.path.join(root, pattern)))
  return out


def blocks(text: str) -> list[tuple[str, str]]:
  """(name, body) of every generated table in a page, body without its trailing newline."""
  return [(m["name"], m["body"].rstrip("\n")) for m in _MARKER.finditer(text)]


def check(root: str = _REPO) -> list[str]:
  """One line per generated table that differs from this script's output (or is unknown)."""
  problems, cache = [], {}
  for path in pages(root):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    for name, body in blocks(text):
      rel = os.path.relpath(path, root)
      if name not in TABLES:
        problems.append(f"{rel}: unknown table '{name}' (known: {', '.join(TABLES)})")
        continue
      if name not in cache:
        cache[name] = TABLES[name]()
      if body != cache[name]:
        problems.append(
          f"{rel}: table '{name}' differs from `python experiments/results_tables.py {name}`"
        )
  return problems


def write(root: str = _REPO) -> list[str]:
  """Rewrite every generated table in place; returns the pages changed."""
  changed = []
  for path in pages(root):
    with open(path, encoding="utf-8") as f:
      text = f.read()
    new = _MARKER.sub(
      lambda m: f"<!-- table: {m['name']} -->\n{TABLES[m['name']]()}\n<!-- end table -->", text
    )
    if new != text:
      with open(path, "w", encoding="utf-8") as f:
        f.write(new)
      changed.append(os.path.relpath(path, root))
  return changed


def main(argv: list[str]) -> int:
  if not argv:
    print("\n".join(TABLES))
    return 0
  if argv == ["--check"]:
    problems = check()
    print("\n".join(problems) if problems else "every generated table is up to date")
    return 1 if problems else 0
  if argv == ["--write"]:
    print("\n".join(write()) or "nothing to rewrite")
    return 0
  unknown = [a for a in argv if a not in TABLES]
  if unknown:
    print(__doc__ + f"\nunknown table(s): {', '.join(unknown)}", file=sys.stderr)
    return 2
  print("\n\n".join(TABLES[a]() for a in argv))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
