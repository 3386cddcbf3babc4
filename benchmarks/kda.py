r"""KDA's delta rule: the chunkwise (WY) form at several chunk sizes against the recurrent form.

  python benchmarks/kda.py                                  # default model's shapes, CPU
  python benchmarks/kda.py --chunk_sizes=16,64 --seq_len=2048 --out=/tmp/kda.json

One row per form: median seconds of the forward and of forward + backward (gradients w.r.t. q,
k, v, g, beta) over --repeats calls after a warm-up, time relative to the recurrent form, and the
max abs difference of the outputs from the recurrent form's (the forms are the same math). The
default shapes are one KDA layer of configs/benice.py:kda (B 16, T 128, 4 heads of width 32);
a training step applies it 10 times (prelude 1, core 2 x R 4, coda 1). Prints a Markdown table
and writes JSON to --out.
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

from looped.model import kda  # noqa: E402


def _seconds(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # Compile and warm up.
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _inputs(b, t, h, k, v):
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  q_BxTxNxH = jax.random.normal(keys[0], (b, t, h, k))
  k_BxTxNxH = kda.l2_normalize(jax.random.normal(keys[1], (b, t, h, k)))
  v_BxTxNxE = jax.random.normal(keys[2], (b, t, h, v))
  g_BxTxNxH = -0.1 * jnp.exp(jax.random.normal(keys[3], (b, t, h, k)))
  beta_BxTxN = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
  return q_BxTxNxH, k_BxTxNxH, v_BxTxNxE, g_BxTxNxH, beta_BxTxN


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq_len", type=int, default=128)
  p.add_argument("--num_heads", type=int, default=4)
  p.add_argument("--head_dim", type=int, default=32)
  p.add_argument("--chunk_sizes", default="8,16,32,64", help="Comma-separated chunk sizes.")
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--out", default="benchmarks/results/kda.json")
  a = p.parse_args()
  chunks = [int(c) for c in a.chunk_sizes.split(",") if c]
  if not chunks or min(chunks) < 1:
    p.error(f"--chunk_sizes={a.chunk_sizes!r}: expected positive integers")
  args = _inputs(a.batch, a.seq_len, a.num_heads, a.head_dim, a.head_dim)

  forms = {"recurrent": lambda *x: kda.kda_recurrent(*x)[0]}
  for c in chunks:
    forms[f"chunkwise {c}"] = lambda *x, c=c: kda.kda_chunkwise(*x, chunk_size=c)[0]
  reference = jax.jit(forms["recurrent"])(*args)
  rows = []
  for name, form in forms.items():
    fwd = jax.jit(form)
    grad = jax.jit(jax.grad(lambda *x, f=form: jnp.sum(jnp.square(f(*x))), argnums=range(5)))
    rows.append(
      {
        "form": name,
        "fwd_s": _seconds(fwd, args, a.repeats),
        "fwd_bwd_s": _seconds(grad, args, a.repeats),
        "max_abs_diff": float(jnp.max(jnp.abs(fwd(*args) - reference))),
      }
    )
  base = rows[0]
  print(
    f"B {a.batch}, T {a.seq_len}, H {a.num_heads}, K = V = {a.head_dim}, float32, "
    f"{jax.devices()[0].platform}, median of {a.repeats}"
  )
  print("| form | fwd ms | fwd+bwd ms | fwd+bwd vs recurrent | max abs diff vs recurrent |")
  print("|---|---:|---:|---:|---:|")
  for r in rows:
    r["fwd_bwd_vs_recurrent"] = r["fwd_bwd_s"] / base["fwd_bwd_s"]
    print(
      f"| {r['form']} | {1e3 * r['fwd_s']:.1f} | {1e3 * r['fwd_bwd_s']:.1f} | "
      f"{r['fwd_bwd_vs_recurrent']:.2f} | {r['max_abs_diff']:.1e} |"
    )
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump({"settings": vars(a), "platform": platform.platform(), "rows": rows}, f, indent=1)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
