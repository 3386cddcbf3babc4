r"""lm-evaluation-harness's `local-completions` against the HTTP server, shared vs unshared KV.

  python benchmarks/lm_eval/run_server_eval.py --lm_eval=lm_eval \
      --checkpoint=benice=/tmp/fixed/benice --checkpoint=finetune=/tmp/fixed/finetune \
      --out=/tmp/lm_eval_scores.json

For each checkpoint (NAME=DIR: a trainer workdir or a pipeline stage dir) and each layout
(unshared, shared) it starts `configs/serve.py` on the checkpoint in a subprocess (this
interpreter, port 0), waits for WORKDIR/server.json, runs

  lm_eval --model local-completions --include_path benchmarks/lm_eval --tasks TASKS \
      --model_args model=NAME,base_url=URL/v1/completions,tokenizer_backend=remote,...

(the exact command of each run is printed and kept in the JSON), reads lm-eval's results file
and stops the server with SIGTERM. `--lm_eval` is the lm_eval executable, which may live in
another environment than this interpreter (it needs torch, this one jax). The tasks are the
local ones of this directory (README.md here). Prints a Markdown table (`table()`) and writes
the scores, the commands and lm-eval's version as JSON with --out.

`custom_prefix_token_id` is the tokenizer's EOS id, from the server's /tokenizer_info
(`eos_token_id`): lm-eval's remote tokenizer finds the EOS id by tokenizing the EOS text, and
the bytes tokenizer's EOS has no text, so without it rolling loglikelihood would have no
first-token context.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _REPO)

from looped.server import client  # noqa: E402

LAYOUTS = {"unshared": False, "shared": True}
TASKS = ("looped_stdlib_mc", "looped_stdlib_gen", "looped_stdlib_ppl")
# (task, metric, label, digits) rows of the table, in order.
ROWS = (
  ("looped_stdlib_mc", "acc", "next line, 4 choices: acc", 2),
  ("looped_stdlib_mc", "acc_norm", "next line, 4 choices: acc_norm", 2),
  ("looped_stdlib_gen", "exact_match", "rest of line, greedy: exact match", 2),
  ("looped_stdlib_ppl", "byte_perplexity", "128-char snippets: byte perplexity", 3),
)


def start_server(checkpoint: str, share_kv: bool, workdir: str, overrides) -> tuple:
  command = [
    sys.executable,
    "-m",
    "looped.main",
    "--config=configs/serve.py",
    f"--workdir={workdir}",
    f"--config.serve.checkpoint={checkpoint}",
    f"--config.serve.share_kv={share_kv}",
    *overrides,
  ]
  log = open(os.path.join(workdir, "server.log"), "w")
  proc = subprocess.Popen(command, cwd=_REPO, stdout=log, stderr=subprocess.STDOUT)
  path = os.path.join(workdir, "server.json")
  deadline = time.monotonic() + 600
  while not os.path.exists(path):
    if proc.poll() is not None or time.monotonic() > deadline:
      proc.kill()
      raise RuntimeError(f"the server did not start; see {log.name}")
    time.sleep(0.2)
  with open(path) as f:
    return proc, json.load(f)


def lm_eval_command(args, name: str, url: str, eos_id: int, output: str) -> list[str]:
  model_args = {
    "model": name,
    "base_url": f"{url}/v1/completions",
    "tokenizer_backend": "remote",
    "tokenized_requests": True,
    "num_concurrent": args.num_concurrent,
    "max_retries": 1,
    "max_length": args.max_length,
    "custom_prefix_token_id": eos_id,
  }
  command = [
    args.lm_eval,
    "--model",
    "local-completions",
    "--model_args",
    ",".join(f"{k}={v}" for k, v in model_args.items()),
    "--include_path",
    _HERE,
    "--tasks",
    ",".join(args.tasks),
    "--output_path",
    output,
    "--seed",
    "0",
  ]
  if args.limit:
    command += ["--limit", str(args.limit)]
  return command


def read_results(output: str) -> dict:
  paths = sorted(glob.glob(os.path.join(output, "**", "results_*.json"), recursive=True))
  if not paths:
    raise RuntimeError(f"lm_eval wrote no results under {output}")
  with open(paths[-1]) as f:
    return json.load(f)


def scores(results: dict) -> dict:
  """task -> metric -> {value, stderr, n} from an lm-eval results file (filter 'none')."""
  out = {}
  for task, metrics in results["results"].items():
    row = {}
    for key, value in metrics.items():
      metric, _, filt = key.partition(",")
      if filt != "none" or metric.endswith("_stderr") or not isinstance(value, (int, float)):
        continue
      stderr = metrics.get(f"{metric}_stderr,{filt}")
      row[metric] = {
        "value": value,
        "stderr": stderr if isinstance(stderr, (int, float)) else None,
        "n": results.get("n-samples", {}).get(task, {}).get("effective"),
      }
    out[task] = row
  return out


def evaluate(args, name: str, checkpoint: str, layout: str) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    proc, info = start_server(checkpoint, LAYOUTS[layout], workdir, args.serve)
    try:
      status, tok = client.request(info["url"] + "/tokenizer_info")
      if status != 200:
        raise RuntimeError(f"/tokenizer_info answered {status}")
      output = os.path.join(workdir, "lm_eval")
      command = lm_eval_command(args, name, info["url"], tok["eos_token_id"], output)
      print("$ " + shlex.join(command), flush=True)
      started = time.monotonic()
      subprocess.run(command, check=True, cwd=workdir)
      wall = time.monotonic() - started
      results = read_results(output)
    finally:
      proc.send_signal(signal.SIGTERM)
      proc.wait(600)
    with open(os.path.join(workdir, "server_stats.json")) as f:
      stats = json.load(f)
  return {
    "scores": scores(results),
    "command": shlex.join(command),
    "lm_eval_wall_s": wall,
    "lm_eval_version": results.get("lm_eval_version"),
    "date": results.get("date"),
    "server_stats": stats,
  }


def _cell(score: dict | None, digits: int) -> str:
  if score is None or score["value"] is None:
    return "-"
  text = f"{score['value']:.{digits}f}"
  stderr = score.get("stderr")
  if stderr is not None and math.isfinite(stderr):
    text += f" ± {stderr:.{digits}f}"
  return text


def table(report: dict) -> str:
  """Markdown: a row per (task, metric), a column per (model, layout); ± is lm-eval's stderr."""
  runs = report["runs"]
  columns = [(m, layout) for m in runs for layout in LAYOUTS if layout in runs[m]]
  lines = [
    "| task: metric | " + " | ".join(f"{m} {layout}" for m, layout in columns) + " |",
    "|---|" + "---:|" * len(columns),
  ]
  for task, metric, label, digits in ROWS:
    cells = [runs[m][lay]["scores"].get(task, {}).get(metric) for m, lay in columns]
    if all(c is None for c in cells):
      continue
    lines.append(f"| {label} | " + " | ".join(_cell(c, digits) for c in cells) + " |")
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--checkpoint",
    action="append",
    required=True,
    help="NAME=DIR: a trainer workdir or pipeline stage dir to serve (repeatable).",
  )
  parser.add_argument("--lm_eval", default="lm_eval", help="The lm_eval executable.")
  parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
  parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS))
  parser.add_argument(
    "--num_concurrent", type=int, default=16, help="lm-eval's requests in flight."
  )
  parser.add_argument("--max_length", type=int, default=512, help="lm-eval's max_length.")
  parser.add_argument("--limit", type=int, default=0, help="lm-eval's --limit (0: every item).")
  parser.add_argument(
    "--serve",
    nargs="*",
    # 16 requests at once (lm-eval's num_concurrent), few step shapes to compile: every task's
    # request fits 12 pages of 16 tokens; 32 pages are the model's whole context.
    default=[
      "--config.serve.max_num_seqs=16",
      "--config.serve.max_num_batched_tokens=128",
      "--config.serve.row_buckets=(16,)",
      "--config.serve.token_buckets=(8,128)",
      "--config.serve.column_buckets=(12,32)",
    ],
    help="Extra configs/serve.py flags.",
  )
  parser.add_argument("--out", default="", help="Write the scores as JSON here.")
  args = parser.parse_args()

  report = {"tasks": args.tasks, "serve": args.serve, "runs": {}}
  for spec in args.checkpoint:
    name, sep, checkpoint = spec.partition("=")
    if not sep:
      parser.error(f"--checkpoint={spec}: expected NAME=DIR")
    checkpoint = os.path.abspath(os.path.expanduser(checkpoint))
    for layout in args.layouts:
      run = evaluate(args, name, checkpoint, layout)
      report["runs"].setdefault(name, {})[layout] = run
      print(f"{name} {layout}: {json.dumps(run['scores'])}", flush=True)
  first = next(iter(next(iter(report["runs"].values())).values()))
  report["lm_eval_version"] = first["lm_eval_version"]
  text = table(report)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
