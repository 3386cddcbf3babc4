r"""Quantize / dequantize throughput of each KV format on this machine's default JAX device.

  python benchmarks/kv_quant.py
  python benchmarks/kv_quant.py --tokens=8192 --repeats=20 --out=/tmp/kv_quant.json

Times jitted `quantize` (bf16 input) and `dequantize` (to bf16) from looped.kv_quant on one
[tokens, heads, head_dim] array, beside a jitted plain copy of the same bf16 array, each the
median of --repeats timed calls after a warm-up (block_until_ready; the JSON also keeps the
minimum, steadier on a shared machine). Throughput is GB/s (1e9) of
bf16 data: the input of quantize, the output of dequantize. Prints a Markdown table and writes
JSON to --out.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from looped import kv_quant  # noqa: E402


def _seconds(fn, arg, repeats: int) -> tuple[float, float]:
  """(median, min) wall seconds of fn(arg) over `repeats` calls after a warm-up call."""
  jax.block_until_ready(fn(arg))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(arg))
    times.append(time.perf_counter() - start)
  return statistics.median(times), min(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096, help="Tokens (first axis).")
  parser.add_argument("--heads", type=int, default=8, help="KV heads.")
  parser.add_argument("--head_dim", type=int, default=128, help="Head dim (quantized axis).")
  parser.add_argument("--repeats", type=int, default=10, help="Timed calls per row (median).")
  parser.add_argument("--formats", default=",".join(kv_quant.FORMATS), help="Comma-separated.")
  parser.add_argument(
    "--out", default=os.path.join(_REPO, "benchmarks", "results", "kv_quant.json")
  )
  args = parser.parse_args()

  shape = (args.tokens, args.heads, args.head_dim)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
  gb = x.size * 2 / 1e9

  rows = []

  def add_row(fmt, op, fn, arg):
    t, t_min = _seconds(fn, arg, args.repeats)
    rows.append(
      {
        "format": fmt,
        "op": op,
        "seconds": t,
        "min_seconds": t_min,
        "gb_per_s": gb / t,
        "best_gb_per_s": gb / t_min,
        "bytes_per_value": 2.0 if fmt == "copy" else kv_quant.bytes_per_value(fmt, args.head_dim),
      }
    )

  add_row("copy", "copy", jax.jit(lambda a: a + jnp.zeros((), a.dtype)), x)
  for fmt in args.formats.split(","):
    quantize = jax.jit(lambda a, fmt=fmt: kv_quant.quantize(a, fmt))
    dequantize = jax.jit(lambda q: kv_quant.dequantize(q, jnp.bfloat16))
    add_row(fmt, "quantize", quantize, x)
    add_row(fmt, "dequantize", dequantize, quantize(x))

  print(f"shape {shape} bf16 ({gb * 1e3:.1f} MB), {jax.devices()[0]}, {args.repeats} repeats\n")
  print(
    "| format | bytes/value | quantize GB/s (median / best) | dequantize GB/s (median / best) |"
  )
  print("| --- | ---: | ---: | ---: |")
  for fmt in ["copy", *args.formats.split(",")]:
    by_op = {r["op"]: r for r in rows if r["format"] == fmt}
    q, d = by_op.get("quantize", by_op.get("copy")), by_op.get("dequantize", by_op.get("copy"))
    name = "plain copy (jit x + 0)" if fmt == "copy" else fmt
    print(
      f"| {name} | {q['bytes_per_value']:.4g} | {q['gb_per_s']:.2f} / {q['best_gb_per_s']:.2f} "
      f"| {d['gb_per_s']:.2f} / {d['best_gb_per_s']:.2f} |"
    )

  result = {
    "shape": shape,
    "input_dtype": "bfloat16",
    "repeats": args.repeats,
    "device": str(jax.devices()[0]),
    "jax": jax.__version__,
    "machine": platform.machine(),
    "cpus": os.cpu_count(),
    "rows": rows,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
