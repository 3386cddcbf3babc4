r"""One accelerator, one run: are the Pallas kernels right, how fast are they, what MFU does a
training step reach at ~140M and ~350M parameters, and how many tokens/s does the generation
engine decode with a shared and an unshared KV cache.

Why one script: device time is scarce and every figure is only meaningful against limits taken
in the same process on the same chip. So the run first measures its own ceilings (a warmed-up
bf16 n^3 matmul for FLOP/s, a device-to-device copy for bytes/s) and puts everything after it
against them.

  # One GPU (an H200 took 7 minutes, most of them compiling; docs/kernels.md has its table):
  PYTHONUNBUFFERED=1 python benchmarks/accelerator_check.py \
      --out=benchmarks/results/accelerator_check.json
  # CPU (also what a CPU backend gets without --toy): tiny shapes, Pallas interpret mode, about
  # a minute; tests/accelerator_check_test.py runs this with XLA's CPU optimisation off
  # (XLA_FLAGS=--xla_backend_optimization_level=0), which halves its compile-bound CPU time.
  python benchmarks/accelerator_check.py --toy
  # A subset (names or prefixes of the checks below), or the table of an earlier JSON:
  python benchmarks/accelerator_check.py --only=limits,paged_decode
  python benchmarks/accelerator_check.py --table_from=benchmarks/results/accelerator_check.json

Checks, each in its own try/except (a failure records an 'error' row with the exception's first
line and the others still run); the JSON is rewritten after every check, so a run cut short
keeps what it finished:
  limits                      bf16 matmul TFLOP/s, copy GB/s (read + written bytes).
  shared_attention_f32        `pallas_kernels.shared_attention` forward and all five gradients,
                              float32, against the float32 reference at HIGHEST matmul precision.
  shared_attention_bf16_fwd   bf16, the same reference on the upcast inputs; speed against the
  shared_attention_bf16_bwd   model's XLA attention (`looped.model.attention.attend` with a
                              Jacobi pass's masks); forward, and forward + backward (gradients).
  shared_attention_past_<f>   forward with the past packed in format f (in-kernel dequantization)
                              against the reference on the dequantized past; XLA dequantizes a
                              copy first.
  paged_decode_<f>            `pallas_kernels.paged_decode` for every KV format (raw in float32,
                              the rest with bf16 compute) on ragged lengths with NaN in every
                              unused slot, against `pallas_kernels.reference.paged_decode`; GB/s
                              counts the packed K/V bytes of the pages read.
  block_prefill               the kernel's block form (blocks of T / 4) with two documents per
                              row (segment ids), float32 forward and gradients against the
                              reference; bf16 forward speed against the reference's XLA program.
  train_140m, train_350m      the training step (language-modeling loss, AdamW, donated state)
                              in bf16 compute; MFU = looped.model.flops per step / step time /
                              the measured matmul rate, and / the 989 TFLOP/s datasheet.
  engine_unshared, engine_shared  looped.engine.Engine, greedy, a fixed batch of requests:
                              decode tokens/s over the decode-only steps, and overall tokens/s.
Errors are max |x - ref| and that over max |ref| (the pass criterion, per compute dtype:
float32 1e-4, bfloat16 2e-2); the reference reads a packed past or page as a cache read returns
it (dequantized, rounded to the compute dtype), so only the kernel's arithmetic is compared.
Timings: compile and warm up, then the median of 10 (toy: 2) timed batches of back-to-back
calls (about 50 ms each), each batch ended by block_until_ready.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback
import types

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels  # noqa: E402
from looped import kv_quant  # noqa: E402
from looped.engine.engine import Engine, EngineConfig  # noqa: E402
from looped.engine.requests import GenRequest  # noqa: E402
from looped.engine.sampling import SamplingParams  # noqa: E402
from looped.model import LoopedLM, ModelConfig, flops, init_params  # noqa: E402
from looped.model.attention import attend  # noqa: E402
from looped.train import objectives, optim  # noqa: E402
from pallas_kernels import kv_formats, reference  # noqa: E402

# Pass criterion: max |x - ref| / max |ref| per compute dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
DATASHEET_BF16_TFLOPS = 989.0  # H200 SXM dense bf16.
DATASHEET_HBM_GBPS = 4800.0
DECODE_FORMATS = ("raw", "bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4")
PAST_FORMATS = ("fp8", "mxfp8", "nvfp4")

# Shapes: the accelerator's, and --toy's (CPU, interpret mode, well under a minute).
FULL = dict(
  matmul_n=8192,
  copy_elems=2**28,  # float32: 1 GiB read, 1 GiB written.
  attn_f32=dict(b=1, t=512, hq=4, hkv=2, d=64),
  attn=dict(b=4, t=4096, hq=16, hkv=4, d=128),
  decode=dict(b=32, t=4096, page=64, hq=16, hkv=4, d=128),
  train=dict(
    train_140m=dict(
      shape=dict(
        d_model=768,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        mlp_dim=3072,
        num_prelude_layers=2,
        num_core_layers=6,
        num_coda_layers=2,
        num_recurrences=4,
        vocab_size=32768,
        tie_embeddings=False,
      ),
      batch=16,
      seq=512,
    ),
    # benchmarks/train_step.py's 350m preset: its shape, batch and length smaller (the XLA
    # attention keeps float32 T x T scores per layer application for the backward).
    train_350m=dict(
      shape=dict(
        d_model=1024,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        mlp_dim=4096,
        num_prelude_layers=4,
        num_core_layers=10,
        num_coda_layers=4,
        num_recurrences=4,
        vocab_size=32768,
        tie_embeddings=False,
      ),
      batch=8,
      seq=512,
    ),
  ),
  train_steps=5,
  engine=dict(model="train_140m", requests=16, prompt=128, new_tokens=128, page=16, reps=3),
  repeats=10,
  batch_s=0.05,
)
_TOY_SHAPE = dict(
  d_model=64,
  num_heads=2,
  num_kv_heads=1,
  head_dim=32,
  mlp_dim=128,
  num_prelude_layers=0,  # A shorter program to compile (CPU time); the loop still runs twice.
  num_core_layers=1,
  num_coda_layers=0,
  num_recurrences=2,
  vocab_size=257,
  tie_embeddings=False,
)
TOY = dict(
  matmul_n=128,
  copy_elems=2**16,
  attn_f32=dict(b=1, t=16, hq=2, hkv=1, d=16),
  attn=dict(b=1, t=16, hq=4, hkv=2, d=32),
  decode=dict(b=2, t=32, page=16, hq=4, hkv=2, d=32),
  train=dict(
    train_140m=dict(shape=_TOY_SHAPE, batch=2, seq=16),
    # The same program as the first: one compilation where a persistent cache is on (tests).
    train_350m=dict(shape=_TOY_SHAPE, batch=2, seq=16),
  ),
  train_steps=2,
  engine=dict(model="train_140m", requests=2, prompt=8, new_tokens=4, page=8, reps=1),
  repeats=2,
  batch_s=0.0,
)


def _log(msg: str) -> None:
  print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Timing and error helpers.


def _timed(fn, *args, repeats: int, batch_s: float):
  """(median seconds per call, first call's seconds incl. compile, first output).

  Each timed batch runs back-to-back calls (enough for about batch_s, at least one) and ends on
  block_until_ready, so dispatch overlaps the device work as it does in a real loop.
  """
  start = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first_s = time.perf_counter() - start
  start = time.perf_counter()
  jax.block_until_ready(fn(*args))  # Warm.
  one = max(time.perf_counter() - start, 1e-7)
  calls = max(1, min(200, int(batch_s / one)))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      res = fn(*args)
    jax.block_until_ready(res)
    times.append((time.perf_counter() - start) / calls)
  return statistics.median(times), first_s, out


def _errors(got, ref) -> dict:
  """max |got - ref| and that over max |ref| (float32), over matching leaves."""
  abs_err, ref_max = 0.0, 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    abs_err = max(abs_err, float(np.max(np.abs(a32 - b32))))
    ref_max = max(ref_max, float(np.max(np.abs(b32))))
  return {"max_abs_err": abs_err, "rel_err": abs_err / max(ref_max, 1e-30), "ref_max": ref_max}


def _judge(row: dict, kernel_err: dict, dtype: str, xla_err: dict | None = None) -> None:
  row["dtype"] = dtype
  row["tolerance"] = TOLERANCE[dtype]
  row.update(kernel_err)
  row["pass"] = bool(np.isfinite(kernel_err["rel_err"]) and row["rel_err"] <= row["tolerance"])
  if xla_err is not None:
    row["xla_max_abs_err"] = xla_err["max_abs_err"]
    row["xla_rel_err"] = xla_err["rel_err"]


def _speed(row: dict, kernel_s: float, xla_s: float | None, limits: dict, *, tflop=None, gb=None):
  """Seconds, rates against the measured limits and the XLA ratio into row."""
  row["kernel_s"] = kernel_s
  if xla_s is not None:
    row["xla_s"] = xla_s
    row["xla_over_kernel"] = xla_s / kernel_s
  if tflop is not None:
    row["flops"] = tflop
    row["kernel_tflops"] = tflop / kernel_s / 1e12
    if xla_s is not None:
      row["xla_tflops"] = tflop / xla_s / 1e12
    if limits.get("matmul_tflops"):
      row["of_matmul"] = row["kernel_tflops"] / limits["matmul_tflops"]
  if gb is not None:
    row["bytes"] = gb
    row["kernel_gbps"] = gb / kernel_s / 1e9
    if xla_s is not None:
      row["xla_gbps"] = gb / xla_s / 1e9
    if limits.get("copy_gbps"):
      row["of_copy"] = row["kernel_gbps"] / limits["copy_gbps"]


def _highest(fn):
  """fn jitted at HIGHEST matmul precision (float32 references, no TF32 / bf16 passes)."""
  jitted = jax.jit(fn)

  def call(*args):
    with jax.default_matmul_precision("highest"):
      return jitted(*args)

  return call


def _upcast(tree):
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


# ---------------------------------------------------------------------------------------------
# Limits.


def check_limits(cfg, limits):
  n = cfg["matmul_n"]
  key_a, key_b = jax.random.split(jax.random.PRNGKey(0))
  a_NxN = jax.random.normal(key_a, (n, n), jnp.bfloat16)
  b_NxN = jax.random.normal(key_b, (n, n), jnp.bfloat16)
  matmul_s, _, _ = _timed(
    jax.jit(lambda a, b: a @ b), a_NxN, b_NxN, repeats=cfg["repeats"], batch_s=cfg["batch_s"]
  )
  x = jnp.ones((cfg["copy_elems"],), jnp.float32)
  copy_s, _, _ = _timed(
    jax.jit(lambda x: x + 1.0), x, repeats=cfg["repeats"], batch_s=cfg["batch_s"]
  )
  limits["matmul_tflops"] = 2 * n**3 / matmul_s / 1e12
  limits["copy_gbps"] = 2 * x.nbytes / copy_s / 1e9
  return {
    "matmul_n": n,
    "matmul_s": matmul_s,
    "matmul_tflops": limits["matmul_tflops"],
    "of_datasheet_tflops": limits["matmul_tflops"] / DATASHEET_BF16_TFLOPS,
    "copy_bytes_moved": 2 * x.nbytes,
    "copy_s": copy_s,
    "copy_gbps": limits["copy_gbps"],
    "of_datasheet_gbps": limits["copy_gbps"] / DATASHEET_HBM_GBPS,
  }


# ---------------------------------------------------------------------------------------------
# Shared-cache attention.


def _attn_inputs(s, dtype, seed=0):
  rng = np.random.default_rng(seed)
  arr = lambda heads: jnp.asarray(
    rng.standard_normal((s["b"], s["t"], heads, s["d"]), np.float32), dtype
  )
  return arr(s["hq"]), arr(s["hkv"]), arr(s["hkv"]), arr(s["hkv"]), arr(s["hkv"]), arr(s["hq"])


def _model_xla_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, kp_BxSxKxH, vp_BxSxKxH):
  """The model's XLA path for a Jacobi pass: own K/V on the diagonal, the past before it."""
  b, t = q_BxTxNxH.shape[:2]
  eye_BxTxT = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
  strict_BxTxS = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool), -1), (b, t, t))
  return attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, eye_BxTxT, kp_BxSxKxH, vp_BxSxKxH, strict_BxTxS)


def _grad_fn(fn):
  """(q, k, v, kp, vp, do) -> the gradients of sum(fn(q, k, v, kp, vp) * do) with respect to
  the first five (do is an argument, not a constant folded into the program)."""
  loss = lambda *a: jnp.sum(fn(*a[:5]).astype(jnp.float32) * a[5].astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def _attn_flops(s):
  """Causal half of the score and value products: 4 B N H T^2 / 2."""
  return 4 * s["b"] * s["hq"] * s["d"] * s["t"] ** 2 / 2


def check_shared_attention_f32(cfg, limits):
  s = cfg["attn_f32"]
  q, k, v, kp, vp, do = _attn_inputs(s, jnp.float32, seed=1)
  args = (q, k, v, kp, vp)
  out = jax.jit(pallas_kernels.shared_attention)(*args)
  grads = jax.jit(_grad_fn(pallas_kernels.shared_attention))(*args, do)
  ref_out = _highest(reference.shared_attention)(*args)
  ref_grads = _highest(_grad_fn(reference.shared_attention))(*args, do)
  row = {"shape": s}
  fwd, bwd = _errors(out, ref_out), _errors(grads, ref_grads)
  worst = max(fwd, bwd, key=lambda e: e["rel_err"])
  _judge(row, worst, "float32")
  row["fwd_rel_err"], row["grad_rel_err"] = fwd["rel_err"], bwd["rel_err"]
  row["grad_rel_err_each"] = {
    name: _errors(g, r)["rel_err"]
    for name, g, r in zip(("q", "k", "v", "k_past", "v_past"), grads, ref_grads)
  }
  return row


def check_shared_attention_bf16(cfg, limits, backward: bool):
  s = cfg["attn"]
  q, k, v, kp, vp, do = _attn_inputs(s, jnp.bfloat16)
  args = (q, k, v, kp, vp)
  if backward:
    args += (do,)
    kernel = jax.jit(_grad_fn(pallas_kernels.shared_attention))
    xla = jax.jit(_grad_fn(_model_xla_attention))
    gold = _highest(_grad_fn(reference.shared_attention))
    work = 3.5 * _attn_flops(s)  # Backward: 2.5 forwards.
  else:
    kernel = jax.jit(pallas_kernels.shared_attention)
    xla = jax.jit(_model_xla_attention)
    gold = _highest(reference.shared_attention)
    work = _attn_flops(s)
  row = {"shape": s}
  reps = dict(repeats=cfg["repeats"], batch_s=cfg["batch_s"])
  kernel_s, row["kernel_first_call_s"], got = _timed(kernel, *args, **reps)
  xla_s, _, xla_out = _timed(xla, *args, **reps)
  ref = gold(*_upcast(args))
  _judge(row, _errors(got, ref), "bfloat16", _errors(xla_out, ref))
  if backward:
    row["grad_rel_err_each"] = {
      name: _errors(g, r)["rel_err"]
      for name, g, r in zip(("q", "k", "v", "k_past", "v_past"), got, ref)
    }
  _speed(row, kernel_s, xla_s, limits, tflop=work)
  return row


def check_block_prefill(cfg, limits):
  """The kernel's block form (docs/design.md §3, block prefill; blocks of T / 4 tokens) with
  document masking (two documents per row): float32 forward and all five gradients against the
  reference at HIGHEST precision, then bf16 forward speed against the reference's XLA program."""
  s32 = cfg["attn_f32"]
  block = max(s32["t"] // 4, 1)
  seg_BxT = jnp.broadcast_to(jnp.arange(s32["t"]) >= s32["t"] // 2, (s32["b"], s32["t"]))
  seg_BxT = seg_BxT.astype(jnp.int32)
  opts = dict(prefill_block=block, segment_ids_BxT=seg_BxT)
  kernel = functools.partial(pallas_kernels.shared_attention, **opts)
  ref = functools.partial(reference.shared_attention, **opts)
  q, k, v, kp, vp, do = _attn_inputs(s32, jnp.float32, seed=2)
  args = (q, k, v, kp, vp)
  fwd = _errors(jax.jit(kernel)(*args), _highest(ref)(*args))
  bwd = _errors(jax.jit(_grad_fn(kernel))(*args, do), _highest(_grad_fn(ref))(*args, do))
  row = {"shape": s32, "prefill_block": block}
  _judge(row, max(fwd, bwd, key=lambda e: e["rel_err"]), "float32")
  row["fwd_rel_err"], row["grad_rel_err"] = fwd["rel_err"], bwd["rel_err"]
  s = cfg["attn"]
  block = max(s["t"] // 4, 1)
  fast = functools.partial(pallas_kernels.shared_attention, prefill_block=block)
  xla = functools.partial(reference.shared_attention, prefill_block=block)
  args = _attn_inputs(s, jnp.bfloat16)[:5]
  reps = dict(repeats=cfg["repeats"], batch_s=cfg["batch_s"])
  kernel_s, row["kernel_first_call_s"], _ = _timed(jax.jit(fast), *args, **reps)
  xla_s, _, _ = _timed(jax.jit(xla), *args, **reps)
  row["speed_shape"], row["speed_prefill_block"] = s, block
  _speed(row, kernel_s, xla_s, limits, tflop=_attn_flops(s))
  return row


def _pack_per_token(x_BxTxKxH, fmt):
  """The past packed per token as looped's caches store it (nvfp4 tensor scale [B, T])."""
  per_token = jax.jit(jax.vmap(jax.vmap(lambda tok: kv_quant.quantize(tok, fmt))))
  q = per_token(x_BxTxKxH)
  read = jax.jit(jax.vmap(jax.vmap(kv_quant.dequantize)))(q)
  return pallas_kernels.PackedKV(q.data, q.scale, q.tensor_scale, fmt), read


def check_shared_attention_past(cfg, limits, fmt):
  s = cfg["attn"]
  q, k, v, kp, vp, _ = _attn_inputs(s, jnp.bfloat16, seed=2)
  (kp_packed, kp_read), (vp_packed, vp_read) = _pack_per_token(kp, fmt), _pack_per_token(vp, fmt)

  def xla(q, k, v, kp, vp):  # Dequantized copies first, as the model's XLA path reads them.
    dq = lambda p: kv_formats.dequantize(p).astype(q.dtype)
    return _model_xla_attention(q, k, v, dq(kp), dq(vp))

  args = (q, k, v, kp_packed, vp_packed)
  row = {"shape": s, "format": fmt}
  reps = dict(repeats=cfg["repeats"], batch_s=cfg["batch_s"])
  kernel_s, row["kernel_first_call_s"], got = _timed(
    jax.jit(pallas_kernels.shared_attention), *args, **reps
  )
  xla_s, _, xla_out = _timed(jax.jit(xla), *args, **reps)
  # The reference reads the past as a cache read returns it: dequantized, rounded to bf16.
  read = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  ref = _highest(reference.shared_attention)(*_upcast((q, k, v)), read(kp_read), read(vp_read))
  _judge(row, _errors(got, ref), "bfloat16", _errors(xla_out, ref))
  _speed(row, kernel_s, xla_s, limits, tflop=_attn_flops(s))
  return row


# ---------------------------------------------------------------------------------------------
# Paged decode.


def _pack_pages(x_SxKxH, fmt, pages, page):
  """[pages * page, K, H] float32 -> PackedKV leaves [pages, page, K, ...], per token."""
  if fmt == "raw":
    return pallas_kernels.PackedKV(x_SxKxH.reshape(pages, page, *x_SxKxH.shape[1:]))
  q = jax.jit(jax.vmap(lambda tok: kv_quant.quantize(tok, fmt)))(x_SxKxH)
  leaves = [
    None if a is None else a.reshape(pages, page, *a.shape[1:])
    for a in (q.data, q.scale, q.tensor_scale)
  ]
  return pallas_kernels.PackedKV(*leaves, fmt=fmt)


def _poison(packed, used):
  """NaN (0xFF for bytes) in every slot no sequence reads (used: bool [pages, page])."""

  def leaf(a):
    used_a = used.reshape(used.shape + (1,) * (a.ndim - used.ndim))
    fill = 255 if a.dtype == jnp.uint8 else jnp.nan
    return jnp.where(used_a, a, jnp.full(a.shape, fill, a.dtype))

  return jax.tree.map(leaf, packed)


def _nbytes(packed) -> int:
  return sum(a.nbytes for a in jax.tree.leaves(packed))


def check_paged_decode(cfg, limits, fmt):
  s = cfg["decode"]
  b, t, page, hq, hkv, d = s["b"], s["t"], s["page"], s["hq"], s["hkv"], s["d"]
  dtype = jnp.float32 if fmt == "raw" else jnp.bfloat16
  rng = np.random.default_rng(3)
  pages_per_seq = -(-t // page)
  num_pages = b * pages_per_seq
  table_BxP = rng.permutation(num_pages).reshape(b, pages_per_seq).astype(np.int32)
  # Ragged: row i stops i mod page slots short of t (a partial last page), so every row reads
  # ceil(length / page) pages.
  lengths_B = (t - np.arange(b) % page).astype(np.int32)
  used = np.zeros((num_pages, page), bool)
  for row_i, n in enumerate(lengths_B):
    slots = np.arange(n)
    used[table_BxP[row_i, slots // page], slots % page] = True
  # Per-token magnitudes over a wide range, so per-token and per-block scales matter.
  out = []
  for _ in "kv":
    mag = np.exp2(rng.integers(-4, 3, (num_pages * page, hkv, 1)))
    x = jnp.asarray(rng.standard_normal((num_pages * page, hkv, d)) * mag, jnp.float32)
    if fmt == "bf16":
      x = x.astype(jnp.bfloat16)
    packed = _pack_pages(x, fmt, num_pages, page)
    out.append(_poison(packed, jnp.asarray(used)))
  k_pages, v_pages = out
  q = jnp.asarray(rng.standard_normal((b, 1, hq, d)), dtype)
  k_new, v_new = (jnp.asarray(rng.standard_normal((b, 1, hkv, d)), dtype) for _ in "kv")
  table, lengths = jnp.asarray(table_BxP), jnp.asarray(lengths_B)
  args = (q, k_new, v_new, k_pages, v_pages, table, lengths)
  read_pages = int(np.sum(-(-lengths_B // page)))
  nbytes = 2 * _nbytes(k_pages) * read_pages // num_pages  # K and V pages read.
  row = {"shape": s, "format": fmt, "pages_read": read_pages}
  reps = dict(repeats=cfg["repeats"], batch_s=cfg["batch_s"])
  kernel_s, row["kernel_first_call_s"], got = _timed(
    jax.jit(pallas_kernels.paged_decode), *args, **reps
  )
  xla_s, _, xla_out = _timed(jax.jit(reference.paged_decode), *args, **reps)
  # The reference reads the pages as a cache read returns them (dequantized, rounded to the
  # compute dtype; unused slots stay NaN) and computes in float32.
  as_read = lambda p: pallas_kernels.PackedKV(kv_formats.dequantize(p).astype(dtype))
  ref = _highest(reference.paged_decode)(
    *_upcast((q, k_new, v_new)), as_read(k_pages), as_read(v_pages), table, lengths
  )
  if not np.isfinite(np.asarray(got, np.float32)).all():
    row["nan_in_output"] = True
  _judge(row, _errors(got, ref), jnp.dtype(dtype).name, _errors(xla_out, ref))
  _speed(row, kernel_s, xla_s, limits, gb=nbytes)
  return row


# ---------------------------------------------------------------------------------------------
# Training step.

# configs/pretrain.py's depth and optimizer settings, with every recurrence run (fixed depth:
# the same FLOPs every step).
DEPTH = types.SimpleNamespace(
  sampler="fixed", poisson_mean=2.0, survival=0.7, backprop_recurrences=0
)
TRAIN = types.SimpleNamespace(
  learning_rate=3e-3,
  warmup_steps=100,
  num_steps=1500,
  min_lr_ratio=0.1,
  weight_decay=0.1,
  b1=0.9,
  b2=0.95,
  grad_clip=1.0,
)


def _model_cfg(shape: dict, seq: int, **overrides) -> ModelConfig:
  return dataclasses.replace(ModelConfig(), **shape, max_seq_len=seq, dtype="bfloat16", **overrides)


def _init(model, tokens_shape: tuple[int, ...]):
  """Fresh params, initialised in one compiled program (not op by op)."""
  tokens_BxT = jnp.zeros(tokens_shape, jnp.int32)
  return jax.jit(functools.partial(init_params, model))(jax.random.PRNGKey(1), tokens_BxT)


# Both engine layouts serve the same params (never donated there, unlike a training step's).
_engine_params = functools.lru_cache(maxsize=1)(_init)


def check_train(cfg, limits, name):
  spec = cfg["train"][name]
  b, t = spec["batch"], spec["seq"]
  mcfg = _model_cfg(spec["shape"], t)
  model = LoopedLM(mcfg)
  objective = objectives.language_modeling(model, DEPTH)
  optimizer = optim.make_optimizer(TRAIN)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, mcfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = _init(model, (1, t))
  opt_state = jax.jit(optimizer.init)(params)
  num_params = int(sum(x.size for x in jax.tree.leaves(params)))
  _log(f"  {name}: {num_params:,} params, batch {b} x {t}")

  def step(params, opt_state, batch, key):
    (loss, _), grads = jax.value_and_grad(objective.loss_fn, has_aux=True)(params, None, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss

  key = jax.random.PRNGKey(2)
  start = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, batch, key).compile()
  compile_s = time.perf_counter() - start
  mem = compiled.memory_analysis()
  params, opt_state, loss = compiled(params, opt_state, batch, key)  # Warm-up.
  first_loss = float(loss)
  times = []
  for i in range(cfg["train_steps"]):
    start = time.perf_counter()
    params, opt_state, loss = compiled(params, opt_state, batch, jax.random.fold_in(key, i))
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  step_flops = flops.train_flops_per_token(mcfg, t) * b * t
  model_tflops = step_flops / step_s / 1e12
  row = {
    "params": num_params,
    "batch": b,
    "seq_len": t,
    "model": {k: getattr(mcfg, k) for k in spec["shape"]},
    "dtype": mcfg.dtype,
    "param_dtype": mcfg.param_dtype,
    "compile_s": compile_s,
    "step_s": step_s,
    "step_s_all": times,
    "tokens_per_s": b * t / step_s,
    "step_flops": step_flops,
    "model_tflops": model_tflops,
    "mfu_datasheet": model_tflops / DATASHEET_BF16_TFLOPS,
    "first_loss": first_loss,
    "final_loss": float(loss),
  }
  if limits.get("matmul_tflops"):
    row["mfu_measured"] = model_tflops / limits["matmul_tflops"]
  if mem is not None:
    row["xla_memory_bytes"] = int(
      mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
    )
  if not np.isfinite(row["final_loss"]):
    raise FloatingPointError(f"non-finite loss {row['final_loss']}")
  return row


# ---------------------------------------------------------------------------------------------
# Generation engine.


def check_engine(cfg, limits, share_kv: bool):
  e = cfg["engine"]
  n, prompt, new, page = e["requests"], e["prompt"], e["new_tokens"], e["page"]
  spec = cfg["train"][e["model"]]
  length = prompt + new
  mcfg = _model_cfg(spec["shape"], length, param_dtype="bfloat16")
  model = LoopedLM(mcfg)
  params = _engine_params(model, (1, 8))
  pages = -(-length // page)
  # Every prompt prefills in one call (one block: shared, it reads its own recurrences as an
  # unshared prefill does) and every call pads to all rows and the whole page table: two call
  # shapes to compile (prefill, decode).
  engine = Engine(
    model,
    params,
    EngineConfig(
      share_kv=share_kv,
      num_pages=n * pages,
      page_size=page,
      max_num_seqs=n,
      max_num_batched_tokens=n * prompt,
      prefill_block=prompt,
      max_model_len=length,
      row_buckets=(n,),
      token_buckets=(1, prompt, n * prompt),
      column_buckets=(pages,),
    ),
  )
  rng = np.random.default_rng(4)  # Distinct random prompts: no prefix-cache hits.
  requests = [
    GenRequest(
      i,
      tuple(int(x) for x in rng.integers(0, mcfg.vocab_size, prompt)),
      SamplingParams(max_new_tokens=new),
    )
    for i in range(n)
  ]
  start = time.perf_counter()
  engine.generate(requests)  # Compiles both shapes.
  compile_s = time.perf_counter() - start
  runs = []
  for _ in range(e["reps"]):
    engine.executor.step_log.clear()
    gens = engine.generate(requests)
    summary = engine.summary(gens)
    log = engine.executor.step_log
    decode = [x for x in log if x["tokens"] == x["rows"]]
    runs.append(
      {
        "tokens_per_s": summary["tokens_per_s"],
        "busy_s": summary["busy_s"],
        "steps": summary["num_steps"],
        "decode_steps": len(decode),
        "decode_tokens": sum(x["tokens"] for x in decode),
        "decode_s": sum(x["s"] for x in decode),
        "decode_step_s_median": statistics.median(x["s"] for x in decode),
        "prefill_s": sum(x["s"] for x in log if x["tokens"] != x["rows"]),
        "generated": sum(len(g.tokens) for g in gens),
      }
    )
  if any(len(g.tokens) != new for g in gens):
    raise RuntimeError(f"a request generated {[len(g.tokens) for g in gens]} tokens, not {new}")
  mid = sorted(runs, key=lambda r: r["busy_s"])[len(runs) // 2]  # The median run.
  row = {
    "layout": "shared" if share_kv else "unshared",
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "requests": n,
    "prompt_tokens": prompt,
    "new_tokens": new,
    "page_size": page,
    "dtype": mcfg.dtype,
    "compile_and_first_run_s": compile_s,
    "decode_tokens_per_s": mid["decode_tokens"] / mid["decode_s"],
    "decode_step_s": mid["decode_step_s_median"],
    "tokens_per_s": mid["tokens_per_s"],
    "prefill_s": mid["prefill_s"],
    "runs": runs,
  }
  return row


# ---------------------------------------------------------------------------------------------
# Driver, table, JSON.


def _checks(cfg):
  """(name, kind, fn(cfg, limits) -> row) in run order: cheapest and most basic first."""
  out = [("limits", "limits", check_limits)]
  out.append(("shared_attention_f32", "kernel", check_shared_attention_f32))
  for backward in (False, True):
    name = f"shared_attention_bf16_{'bwd' if backward else 'fwd'}"
    out.append(
      (name, "kernel", lambda c, lim, bw=backward: check_shared_attention_bf16(c, lim, bw))
    )
  for fmt in PAST_FORMATS:
    out.append(
      (
        f"shared_attention_past_{fmt}",
        "kernel",
        lambda c, lim, f=fmt: check_shared_attention_past(c, lim, f),
      )
    )
  for fmt in DECODE_FORMATS:
    out.append(
      (f"paged_decode_{fmt}", "kernel", lambda c, lim, f=fmt: check_paged_decode(c, lim, f))
    )
  out.append(("block_prefill", "kernel", check_block_prefill))
  for share in (False, True):
    name = f"engine_{'shared' if share else 'unshared'}"
    out.append((name, "engine", lambda c, lim, s=share: check_engine(c, lim, s)))
  for name in cfg["train"]:
    out.append((name, "train", lambda c, lim, n=name: check_train(c, lim, n)))
  return out


def _fmt(x, spec=".3g"):
  return "" if x is None else format(x, spec)


def table(result: dict) -> str:
  """The Markdown table of a result JSON."""
  lim = result.get("limits", {})
  lines = [
    f"{result['setup']['device']} ({result['setup']['backend']}, jax {result['setup']['jax']}"
    f"{', toy shapes' if result['setup']['toy'] else ''})",
    "",
    "| check | status | kernels: error vs f32 reference, max abs / rel (tol); else setup "
    "| kernel | XLA | "
    "XLA / kernel | achieved (of measured limit) |",
    "| --- | --- | --- | ---: | ---: | ---: | --- |",
  ]
  for name, row in result["checks"].items():
    status = row["status"]
    if status != "ok":
      err = row.get("error", "")
      lines.append(f"| {name} | {status} | {err} | | | | |")
      continue
    kind = row["kind"]
    if kind == "limits":
      lines.append(
        f"| {name} | ok | | | | | bf16 matmul {row['matmul_n']}^3: "
        f"{row['matmul_tflops']:.4g} TFLOP/s ({row['of_datasheet_tflops']:.0%} of "
        f"{DATASHEET_BF16_TFLOPS:.0f} datasheet); copy {row['copy_gbps']:.4g} GB/s "
        f"({row['of_datasheet_gbps']:.0%} of {DATASHEET_HBM_GBPS:.0f}) |"
      )
    elif kind == "kernel":
      verdict = "pass" if row["pass"] else "FAIL"
      err = (
        f"{row['max_abs_err']:.2g} / {row['rel_err']:.2g} ({row['tolerance']:g}, "
        f"{row['dtype']}) {verdict}"
      )
      if "xla_rel_err" in row:
        err += f"; XLA {row['xla_max_abs_err']:.2g} / {row['xla_rel_err']:.2g}"
      kernel = f"{row['kernel_s'] * 1e3:.3g} ms" if "kernel_s" in row else ""
      xla = f"{row['xla_s'] * 1e3:.3g} ms" if "xla_s" in row else ""
      ratio = f"{row['xla_over_kernel']:.2f}x" if "xla_over_kernel" in row else ""
      achieved = ""
      if "kernel_tflops" in row:
        achieved = f"{row['kernel_tflops']:.3g} TFLOP/s ({_fmt(row.get('of_matmul'), '.1%')})"
        achieved += f"; XLA {row['xla_tflops']:.3g}"
      if "kernel_gbps" in row:
        achieved = f"{row['kernel_gbps']:.4g} GB/s ({_fmt(row.get('of_copy'), '.1%')})"
        achieved += f"; XLA {row['xla_gbps']:.4g}"
      lines.append(f"| {name} | ok | {err} | {kernel} | {xla} | {ratio} | {achieved} |")
    elif kind == "train":
      lines.append(
        f"| {name} | ok | {row['params'] / 1e6:.1f}M params, batch {row['batch']} x "
        f"{row['seq_len']}, compile {row['compile_s']:.0f} s | step {row['step_s'] * 1e3:.4g} ms"
        f" | | | {row['model_tflops']:.4g} TFLOP/s model FLOPs: MFU "
        f"{_fmt(row.get('mfu_measured'), '.1%')} of measured matmul, "
        f"{row['mfu_datasheet']:.1%} of {DATASHEET_BF16_TFLOPS:.0f}; "
        f"{row['tokens_per_s']:.4g} tokens/s |"
      )
    elif kind == "engine":
      lines.append(
        f"| {name} | ok | {row['params'] / 1e6:.1f}M params, {row['requests']} requests x "
        f"({row['prompt_tokens']} + {row['new_tokens']}) tokens, greedy | decode step "
        f"{row['decode_step_s'] * 1e3:.3g} ms | | | {row['decode_tokens_per_s']:.4g} decode "
        f"tokens/s; {row['tokens_per_s']:.4g} tokens/s with prefill |"
      )
  if lim:
    lines += [
      "",
      f"Limits measured in this run: {lim['matmul_tflops']:.4g} TFLOP/s bf16 matmul, "
      f"{lim['copy_gbps']:.4g} GB/s copy.",
    ]
  return "\n".join(lines)


def _write(path: str, result: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f, indent=1, default=str)
  os.replace(tmp, path)


def _error_line(e: BaseException) -> str:
  lines = [x for x in str(e).splitlines() if x.strip()]
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def run(toy: bool, out: str, only: tuple[str, ...] = ()) -> dict:
  cfg = TOY if toy else FULL
  device = jax.devices()[0]
  result = {
    "setup": {
      "device": str(getattr(device, "device_kind", device)),
      "backend": jax.default_backend(),
      "jax": jax.__version__,
      "python": platform.python_version(),
      "toy": toy,
      "date": time.strftime("%Y-%m-%d"),
      "tolerance": TOLERANCE,
      "shapes": {k: v for k, v in cfg.items() if k not in ("repeats", "batch_s")},
      "repeats": cfg["repeats"],
    },
    "limits": {},
    "checks": {},
  }
  limits = result["limits"]
  begin = time.perf_counter()
  for name, kind, fn in _checks(cfg):
    if only and not any(name.startswith(o) for o in only):
      continue
    _log(f"[{time.perf_counter() - begin:6.1f} s] {name} ...")
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
      row = {"kind": kind, "status": "ok", **fn(cfg, limits)}
    except Exception as e:  # noqa: BLE001 (recorded; the other checks still run)
      row = {"kind": kind, "status": "error", "error": _error_line(e)}
      row["traceback"] = traceback.format_exc()[-3000:]
      _log(traceback.format_exc())
    row["wall_s"] = time.perf_counter() - start
    row["cpu_s"] = time.process_time() - cpu_start
    result["checks"][name] = row
    brief = row.get("error") or ", ".join(
      f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
      for k, v in row.items()
      if k in ("rel_err", "pass", "kernel_s", "xla_s", "matmul_tflops", "copy_gbps", "step_s")
      or k in ("mfu_measured", "decode_tokens_per_s", "params")
    )
    _log(f"[{time.perf_counter() - begin:6.1f} s] {name}: {row['status']} ({brief})")
    _write(out, result)
  result["wall_s"] = time.perf_counter() - begin
  _write(out, result)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--toy", action="store_true", help="Tiny shapes (automatic on CPU).")
  parser.add_argument(
    "--out", default=os.path.join(_REPO, "benchmarks", "results", "accelerator_check.json")
  )
  parser.add_argument("--only", default="", help="Comma-separated check names or prefixes.")
  parser.add_argument("--table_from", default="", help="Print the table of this JSON and exit.")
  args = parser.parse_args()
  if args.table_from:
    with open(args.table_from) as f:
      print(table(json.load(f)))
    return
  toy = args.toy or jax.default_backend() == "cpu"
  _log(f"{jax.devices()[0]} ({jax.default_backend()}), jax {jax.__version__}, toy={toy}")
  only = tuple(o for o in args.only.split(",") if o)
  result = run(toy, args.out, only)
  print("\n" + table(result), flush=True)
  print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
