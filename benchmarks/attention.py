r"""Pallas attention kernels against the XLA path: shared-cache flash attention and paged decode.

  # H200 (docs/results.md, "Pallas kernels"):
  python benchmarks/attention.py --out=benchmarks/results/attention_h200.json
  # CPU smoke run (interpret mode; timings say nothing about accelerators):
  python benchmarks/attention.py --seq_lens=256 --interpret --batch=1 --num_heads=4 \
    --num_kv_heads=2 --head_dim=64 --decode_batch=2 --repeats=2

Rows, per sequence length T:
  prefill fwd / fwd+bwd   `pallas_kernels.shared_attention` (past = a second K/V, as in a
                          Jacobi / BeNice! pass) against the XLA reference (dense [T, 2T] scores,
                          what attention_impl='xla' computes). TFLOP/s counts the causal half:
                          4 B Hq D T^2 / 2 forward, 2.5x that for the backward; % of --peak_tflops.
  prefill fwd, <f> past   the same with the past packed in format f (--past_formats), read
                          through in-kernel dequantization (XLA: dequantized copy first).
  decode <format>         `pallas_kernels.paged_decode`, one new token per sequence for
                          --decode_batch sequences holding T cached tokens each in --page_size
                          pages (shuffled page table), against the XLA reference (gathers and
                          dequantizes a dense copy). GB/s counts the packed K/V bytes read (elements
                          and scales); % of --copy_gbps; time relative to the bf16 kernel.
Each time is the median of --repeats calls after a warm-up (block_until_ready). Each kernel row
also records its max abs difference from the XLA row (outputs, or all five gradients): the
first check of a lowering that has never run. A row that fails (e.g. the XLA reference's
T x 2T scores out of memory) records its error. Prints a Markdown table and writes JSON to --out.
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

import pallas_kernels  # noqa: E402
from looped import kv_quant  # noqa: E402
from pallas_kernels import kv_formats, reference  # noqa: E402


def _seconds(fn, *args, repeats: int):
  """(median seconds, output of the warm-up call)."""
  out = jax.block_until_ready(fn(*args))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def _timed(rows, row, fn, *args, repeats):
  """Times fn into row (or records its error); returns its output (None on error)."""
  out = None
  try:
    row["seconds"], out = _seconds(fn, *args, repeats=repeats)
  except Exception as e:  # noqa: BLE001 (recorded: OOM of the dense reference, lowering errors)
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
  rows.append(row)
  return out


def _check(rows_by_impl, outs_by_impl):
  """The kernel's max abs difference from the XLA path (outputs, or every gradient)."""
  if all(o is not None for o in outs_by_impl.values()):
    pairs = zip(jax.tree.leaves(outs_by_impl["pallas"]), jax.tree.leaves(outs_by_impl["xla"]))
    err = max(
      float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in pairs
    )
    rows_by_impl["pallas"]["max_abs_err"] = err


def _pack(x, fmt):
  """[pages, page_size, K, D] -> PackedKV, per token as looped's caches store it."""
  if fmt == "raw":
    return pallas_kernels.PackedKV(x)
  flat = jax.vmap(lambda tok: kv_quant.quantize(tok, fmt))(x.reshape(-1, *x.shape[2:]))
  leaves = [
    None if a is None else a.reshape(*x.shape[:2], *a.shape[1:])
    for a in (flat.data, flat.scale, flat.tensor_scale)
  ]
  return pallas_kernels.PackedKV(*leaves, fmt=fmt)


def _read(packed, dtype):
  """A dequantized copy of a packed array (what the XLA path reads)."""
  return kv_formats.dequantize(packed).astype(dtype)


def _nbytes(packed):
  return sum(a.nbytes for a in (packed.data, packed.scale, packed.tensor_scale) if a is not None)


def prefill_rows(args, t, dtype, rows):
  b, hq, hkv, d = args.batch, args.num_heads, args.num_kv_heads, args.head_dim
  rng = np.random.default_rng(0)
  arr = lambda heads: jnp.asarray(rng.standard_normal((b, t, heads, d), np.float32), dtype)
  q, k, v, kp, vp, do = arr(hq), arr(hkv), arr(hkv), arr(hkv), arr(hkv), arr(hq)
  kw = dict(block_q=args.block_q, block_k=args.block_k, interpret=args.interpret or None)
  impls = {
    "pallas": lambda *a: pallas_kernels.shared_attention(*a, **kw),
    "xla": reference.shared_attention,
  }
  flops_fwd = 4 * b * hq * d * t * t / 2
  for op, flops, grad in (
    ("prefill fwd", flops_fwd, False),
    ("prefill fwd+bwd", 3.5 * flops_fwd, True),
  ):
    row_of, out_of = {}, {}
    for impl, fn in impls.items():
      f = jax.jit(fn)
      if grad:
        loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32) * do.astype(jnp.float32))
        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
      row_of[impl] = {"op": op, "impl": impl, "T": t, "flops": flops}
      out_of[impl] = _timed(rows, row_of[impl], f, q, k, v, kp, vp, repeats=args.repeats)
      if "seconds" in row_of[impl]:
        row_of[impl]["tflops"] = flops / row_of[impl]["seconds"] / 1e12
        row_of[impl]["pct_peak"] = 100 * row_of[impl]["tflops"] / args.peak_tflops
    _check(row_of, out_of)
  # A quantized Jacobi pass: the past packed per token, dequantized in the kernel (pallas) or
  # dequantized into a copy first (xla).
  for fmt in filter(None, args.past_formats.split(",")):
    kp_packed, vp_packed = _pack(kp, fmt), _pack(vp, fmt)
    packed_impls = {
      "pallas": impls["pallas"],
      "xla": lambda q, k, v, a, c: reference.shared_attention(
        q, k, v, _read(a, dtype), _read(c, dtype)
      ),
    }
    row_of, out_of = {}, {}
    for impl, fn in packed_impls.items():
      row = row_of[impl] = {"op": f"prefill fwd, {fmt} past", "impl": impl, "T": t}
      row["flops"] = flops_fwd
      call_args = (q, k, v, kp_packed, vp_packed)
      out_of[impl] = _timed(rows, row, jax.jit(fn), *call_args, repeats=args.repeats)
      if "seconds" in row:
        row["tflops"] = flops_fwd / row["seconds"] / 1e12
        row["pct_peak"] = 100 * row["tflops"] / args.peak_tflops
    _check(row_of, out_of)


def decode_rows(args, t, dtype, rows):
  b, hq, hkv, d, ps = (
    args.decode_batch,
    args.num_heads,
    args.num_kv_heads,
    args.head_dim,
    args.page_size,
  )
  rng = np.random.default_rng(1)
  pages_per_seq = -(-t // ps)
  num_pages = b * pages_per_seq
  table = jnp.asarray(rng.permutation(num_pages).reshape(b, pages_per_seq), jnp.int32)
  lengths = jnp.full((b,), t, jnp.int32)
  q = jnp.asarray(rng.standard_normal((b, 1, hq, d), np.float32), dtype)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, 1, hkv, d), np.float32), dtype) for _ in "kv")
  x_k, x_v = (
    jnp.asarray(rng.standard_normal((num_pages, ps, hkv, d), np.float32), dtype) for _ in "kv"
  )
  for fmt in args.formats.split(","):
    k_pages, v_pages = _pack(x_k, fmt), _pack(x_v, fmt)
    nbytes = 2 * _nbytes(k_pages)  # K and V.
    impls = {
      "pallas": lambda *a: pallas_kernels.paged_decode(*a, interpret=args.interpret or None),
      "xla": reference.paged_decode,
    }
    row_of, out_of = {}, {}
    for impl, fn in impls.items():
      row = row_of[impl] = {"op": f"decode {fmt}", "impl": impl, "T": t, "bytes": nbytes}
      call_args = (q, k_new, v_new, k_pages, v_pages, table, lengths)
      out_of[impl] = _timed(rows, row, jax.jit(fn), *call_args, repeats=args.repeats)
      if "seconds" in row:
        row["gb_per_s"] = nbytes / row["seconds"] / 1e9
        row["pct_copy"] = 100 * row["gb_per_s"] / args.copy_gbps
    _check(row_of, out_of)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq_lens", default="1024,4096,16384", help="Comma-separated T.")
  parser.add_argument("--batch", type=int, default=4, help="Prefill batch.")
  parser.add_argument("--num_heads", type=int, default=16, help="Query heads.")
  parser.add_argument("--num_kv_heads", type=int, default=4, help="K/V heads (GQA).")
  parser.add_argument("--head_dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16", help="q/k/v dtype.")
  parser.add_argument("--decode_batch", type=int, default=32, help="Sequences per decode step.")
  parser.add_argument("--page_size", type=int, default=64)
  parser.add_argument("--formats", default="bf16,fp8,mxfp8,nvfp4", help="Decode KV formats.")
  parser.add_argument(
    "--past_formats", default="fp8,nvfp4", help="Prefill rows with a packed past ('' = none)."
  )
  parser.add_argument("--block_q", type=int, default=None, help="Default: per platform.")
  parser.add_argument("--block_k", type=int, default=None, help="Default: per platform.")
  parser.add_argument("--interpret", action="store_true", help="Force Pallas interpret mode.")
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--peak_tflops", type=float, default=790.0, help="bf16 dense peak.")
  parser.add_argument("--copy_gbps", type=float, default=4300.0, help="HBM copy bandwidth.")
  parser.add_argument("--skip", default="", help="Comma-separated: 'prefill', 'decode'.")
  parser.add_argument(
    "--out", default=os.path.join(_REPO, "benchmarks", "results", "attention.json")
  )
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  rows = []
  for t in (int(s) for s in args.seq_lens.split(",")):
    if "prefill" not in args.skip:
      prefill_rows(args, t, dtype, rows)
    if "decode" not in args.skip:
      decode_rows(args, t, dtype, rows)

  bf16 = {
    r["T"]: r["seconds"]
    for r in rows
    if r["op"] == "decode bf16" and r["impl"] == "pallas" and "seconds" in r
  }
  xla = {(r["op"], r["T"]): r.get("seconds") for r in rows if r["impl"] == "xla"}
  print(
    f"{jax.devices()[0]}, {args.dtype}, Hq/Hkv {args.num_heads}/{args.num_kv_heads}, "
    f"D {args.head_dim}, "
    f"prefill batch {args.batch}, decode batch {args.decode_batch} x page {args.page_size}\n"
  )
  print(
    "| op | impl | T | ms | TFLOP/s (% peak) | GB/s (% copy) | vs XLA | vs bf16 decode "
    "| max abs err vs XLA |"
  )
  print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
  for r in rows:
    if "error" in r:
      print(f"| {r['op']} | {r['impl']} | {r['T']} | {r['error']} | | | | | |")
      continue
    tf = f"{r['tflops']:.3g} ({r['pct_peak']:.1f}%)" if "tflops" in r else ""
    gb = f"{r['gb_per_s']:.3g} ({r['pct_copy']:.1f}%)" if "gb_per_s" in r else ""
    ref = xla.get((r["op"], r["T"]))
    vs_xla = f"{ref / r['seconds']:.2f}x" if r["impl"] == "pallas" and ref else ""
    vs_bf16 = ""
    if r["op"].startswith("decode") and r["impl"] == "pallas" and r["T"] in bf16:
      vs_bf16 = f"{r['seconds'] / bf16[r['T']]:.2f}"
    ms = f"{1e3 * r['seconds']:.3g}"
    err = f"{r['max_abs_err']:.2g}" if "max_abs_err" in r else ""
    print(
      f"| {r['op']} | {r['impl']} | {r['T']} | {ms} | {tf} | {gb} | {vs_xla} | {vs_bf16} | {err} |"
    )

  result = {
    "args": vars(args),
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
