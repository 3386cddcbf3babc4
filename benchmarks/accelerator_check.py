r"""One accelerator, one run: are the Pallas kernels right, how fast are they, what MFU does a
training step reach at ~140M and ~350M parameters (with the flash kernel and each MFU lever),
how many tokens/s does the generation engine decode with a shared and an unshared KV cache, and
what does the BeNice! pilot (configs/benice.py:gpu_pilot) measure.

Why one script: device time is scarce and every figure is only meaningful against limits taken
in the same process on the same chip. So the run first measures its own ceilings (a warmed-up
bf16 n^3 matmul for FLOP/s, a device-to-device copy for bytes/s) and puts everything after it
against them.

  # One GPU (an H200 took 7 minutes, most of them compiling; docs/kernels.md has its table):
  PYTHONUNBUFFERED=1 python benchmarks/accelerator_check.py \
      --out=benchmarks/results/accelerator_check.json
  # The prepared device run (docs/kernels.md): a chosen set within 9 minutes, its table written
  # into docs/kernels.md between the markers.
  PYTHONUNBUFFERED=1 python benchmarks/accelerator_check.py --deadline_s=540 \
      --only=limits,pilot,paged_decode,train_350m,train_140m,engine,decode_model \
      --write_docs=docs/kernels.md
  # CPU (also what a CPU backend gets without --toy): tiny shapes, Pallas interpret mode, the
  # pilot at smoke size, about two minutes; tests/accelerator_check_test.py runs this with
  # XLA's CPU optimisation off (XLA_FLAGS=--xla_backend_optimization_level=0), which halves its
  # compile-bound CPU time.
  python benchmarks/accelerator_check.py --toy
  # A subset (names or prefixes of the checks below), or the table of an earlier JSON:
  python benchmarks/accelerator_check.py --only=limits,paged_decode
  python benchmarks/accelerator_check.py --table_from=benchmarks/results/accelerator_check.json

With --deadline_s a check starts only if its expected time (EXPECTED_S) fits in what is left;
the others get a 'skipped' row, and the pilot's process is stopped at the deadline.

Checks, each in its own try/except (a failure records an 'error' row with the exception's first
line and the others still run); the JSON is rewritten after every check, so a run cut short
keeps what it finished:
  limits                      bf16 matmul TFLOP/s, copy GB/s (read + written bytes).
  pilot                       `python -m looped.main --config=configs/benice.py:gpu_pilot` (toy:
                              smoke,fixed) in its own process: wall time, the pretraining's MFU,
                              each model's perplexities and exact shared gap, and the CPU recipe
                              study's targets (BeNice!'s gap <= 1/5 of zero-shot's, below the
                              finetune's, its ppl within 1% of the finetune's).
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
                              counts the packed K/V bytes of the pages read; targets: 80% of the
                              copy (bf16), 70% (fp8, mxfp8), nvfp4 at least bf16's tokens/s.
  block_prefill               the kernel's block form (blocks of T / 4) with two documents per
                              row (segment ids), float32 forward and gradients against the
                              reference; bf16 forward speed against the reference's XLA program.
  train_<size>[_<variant>]    the training step (language-modeling loss, AdamW, donated state)
                              in bf16 compute, model.attention_impl 'auto' (the flash kernel),
                              with the MFU levers (`_levers`: bf16 params and master copy, bf16
                              moments, chunked loss; `_remat`: and dots_saveable remat) or XLA's
                              attention (`_xla`); MFU = looped.model.flops per step / step time /
                              the measured matmul rate (also with causal attention counted once,
                              against the target: 45% at 350M, 40% at 140M), and / the 989
                              TFLOP/s datasheet; the 350M levers row adds the profile's top ops.
  engine_unshared, engine_shared  looped.engine.Engine, greedy, a fixed batch of requests:
                              decode tokens/s over the decode-only steps, and overall tokens/s;
                              attention 'auto' (the paged kernel), `_gather`: XLA's gather.
  decode_model_<layout>       the same requests on LoopedLM's own batched decode (a dense cache,
                              one jitted call per token for all rows).
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
import subprocess
import sys
import tempfile
import time
import traceback
import types

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)
# This process takes device memory as it needs it, not 75% of it at start-up: the pilot runs
# in a process of its own on the same device.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import pallas_kernels  # noqa: E402
from looped import kv_quant  # noqa: E402
from looped.engine.engine import Engine, EngineConfig  # noqa: E402
from looped.engine.requests import GenRequest  # noqa: E402
from looped.engine.sampling import SamplingParams  # noqa: E402
from looped.model import LoopedLM, ModelConfig, flops, init_cache, init_params  # noqa: E402
from looped.model.attention import attend  # noqa: E402
from looped.train import objectives, optim  # noqa: E402
from looped.train import profiler as profiler_lib  # noqa: E402
from pallas_kernels import kv_formats, reference  # noqa: E402

# Pass criterion: max |x - ref| / max |ref| per compute dtype.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
DATASHEET_BF16_TFLOPS = 989.0  # H200 SXM dense bf16.
DATASHEET_HBM_GBPS = 4800.0
DECODE_FORMATS = ("raw", "bf16", "fp8", "mxfp8", "mxfp8_rceil", "nvfp4")
PAST_FORMATS = ("fp8", "mxfp8", "nvfp4")

# Targets on one H200 (each against this run's measured limits): training MFU (model FLOPs
# with causal attention counted once, the conservative count; of the measured bf16 matmul) by
# model size, and paged decode's bytes/s (of the measured copy) by format; nvfp4 instead decodes
# at least as many tokens/s per request as bf16 (it reads 3.6x fewer bytes).
MFU_TARGETS = {"140m": 0.40, "350m": 0.45}
DECODE_TARGETS = {"bf16": 0.80, "fp8": 0.70, "mxfp8": 0.70, "mxfp8_rceil": 0.70}

# The training shapes: ~140M and benchmarks/train_step.py's 350m preset (vocabulary untied).
SHAPES = dict(
  size_140m=dict(
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
  size_350m=dict(
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
)
# The MFU levers (config fields; tests/train_levers_test.py: same losses on CPU): bf16 params
# with a float32 master copy, bf16 Adam moments, the loss in vocabulary chunks.
LEVERS = dict(
  param_dtype="bfloat16",
  master_weights=True,
  opt_state_dtype="bfloat16",
  loss_vocab_chunk=8192,
)
XLA = dict(attention_impl="xla")  # The earlier table's path (model.attention_impl='xla').


def _train_row(size: str, batch: int, seq: int, levers=None, profile=False) -> dict:
  return dict(size=size, batch=batch, seq=seq, levers=levers or {}, profile=profile)


# Shapes: the accelerator's, and --toy's (CPU, interpret mode, about two minutes). Training
# rows run model.attention_impl='auto' (the flash kernel on an accelerator) unless their levers
# say otherwise; the batch of a levers row uses the memory they free.
FULL = dict(
  matmul_n=8192,
  copy_elems=2**28,  # float32: 1 GiB read, 1 GiB written.
  attn_f32=dict(b=1, t=512, hq=4, hkv=2, d=64),
  attn=dict(b=4, t=4096, hq=16, hkv=4, d=128),
  decode=dict(b=32, t=4096, page=64, hq=16, hkv=4, d=128),
  shapes=SHAPES,
  train=dict(
    train_140m=_train_row("size_140m", 16, 512),
    train_350m=_train_row("size_350m", 8, 512),
    train_350m_levers=_train_row("size_350m", 16, 512, LEVERS, profile=True),
    train_140m_levers=_train_row("size_140m", 32, 512, LEVERS),
    train_350m_remat=_train_row("size_350m", 32, 512, {**LEVERS, "remat": "dots_saveable"}),
    # The earlier table's rows (XLA attention), rerun for a same-run comparison.
    train_140m_xla=_train_row("size_140m", 16, 512, XLA),
    train_350m_xla=_train_row("size_350m", 8, 512, XLA),
  ),
  train_steps=5,
  profile_steps=3,
  engine=dict(model="size_140m", requests=16, prompt=128, new_tokens=128, page=16, reps=3),
  # configs/benice.py:gpu_pilot, the whole pipeline (sized to 5 minutes on one H200).
  pilot=dict(config="gpu_pilot", overrides={}),
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


def _toy_train() -> dict:
  """FULL's training rows at the toy shape (the loss in chunks of 64 of its 257 ids). Rows of
  one program compile once where a persistent cache is on (tests): on CPU 'auto' is the XLA
  path, so only the levers rows compile anew."""
  rows = {}
  for name, row in FULL["train"].items():
    levers = dict(row["levers"])
    if "loss_vocab_chunk" in levers:
      levers["loss_vocab_chunk"] = 64
    rows[name] = dict(row, size="toy", batch=2, seq=16, levers=levers)
  return rows


TOY = dict(
  matmul_n=128,
  copy_elems=2**16,
  attn_f32=dict(b=1, t=16, hq=2, hkv=1, d=16),
  attn=dict(b=1, t=16, hq=4, hkv=2, d=32),
  decode=dict(b=2, t=32, page=16, hq=4, hkv=2, d=32),
  shapes=dict(toy=_TOY_SHAPE),
  train=_toy_train(),
  train_steps=2,
  profile_steps=1,
  engine=dict(model="toy", requests=2, prompt=8, new_tokens=4, page=8, reps=1),
  # The same pipeline at the smoke size: 20 + 6 + 6 steps and a small evaluation.
  pilot=dict(
    config="smoke,fixed",
    overrides={
      "eval.kv_formats": "('bf16',)",
      "eval.prefill_blocks": "()",
      "eval.jacobi_passes": "(1,)",
      "eval.samples": "0",
    },
  ),
  repeats=2,
  batch_s=0.0,
)
# Wall seconds each check is expected to take on one H200, compiling included; estimates, to be
# replaced by the next run's wall_s: the training rows from the 2026-12-04 run's compile times
# (31 s at 140M, 50 s at 350M) plus their steps, the other checks from that run's 415 s for 18
# checks, the pilot from its dry run's FLOPs (docs/kernels.md). `--deadline_s` starts a check
# only if it fits.
EXPECTED_S = {
  "limits": 10,
  "shared_attention": 15,
  "paged_decode": 8,
  "block_prefill": 15,
  "engine": 25,
  "decode_model": 15,
  "train_140m": 45,
  "train_350m": 65,
  "pilot": 240,  # Estimated: ~100 s of steps at the earlier run's MFU, the rest compiling.
}


def _expected_s(name: str) -> float:
  """The longest EXPECTED_S entry that prefixes `name` (0: unknown)."""
  keys = [k for k in EXPECTED_S if name.startswith(k)]
  return EXPECTED_S[max(keys, key=len)] if keys else 0.0


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
  if fmt in DECODE_TARGETS and "of_copy" in row:
    row["target_of_copy"] = DECODE_TARGETS[fmt]
    row["target_met"] = bool(row["of_copy"] >= row["target_of_copy"])
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
  opt_state_dtype="float32",
  master_weights=False,
)
# The levers that are model fields; the rest are train fields (TRAIN's).
_MODEL_LEVERS = ("attention_impl", "param_dtype", "remat")


def _model_cfg(shape: dict, seq: int, **overrides) -> ModelConfig:
  return dataclasses.replace(ModelConfig(), **shape, max_seq_len=seq, dtype="bfloat16", **overrides)


def _init(model, tokens_shape: tuple[int, ...]):
  """Fresh params, initialised in one compiled program (not op by op)."""
  tokens_BxT = jnp.zeros(tokens_shape, jnp.int32)
  return jax.jit(functools.partial(init_params, model))(jax.random.PRNGKey(1), tokens_BxT)


# Both engine layouts serve the same params (never donated there, unlike a training step's).
_engine_params = functools.lru_cache(maxsize=1)(_init)


def _train_setup(cfg, spec):
  """(model config, objective, optimizer) of a training row: its shape and levers."""
  levers = spec["levers"]
  model_levers = {k: v for k, v in levers.items() if k in _MODEL_LEVERS}
  mcfg = _model_cfg(cfg["shapes"][spec["size"]], spec["seq"], **model_levers)
  model = LoopedLM(mcfg)
  train = types.SimpleNamespace(**{**vars(TRAIN), **levers})
  objective = objectives.vocab_chunked(
    objectives.language_modeling(model, DEPTH), levers.get("loss_vocab_chunk", 0)
  )
  return mcfg, model, objective, optim.make_optimizer(train)


def _profile(cfg, compiled, params, opt_state, batch, key) -> list[dict]:
  """The top ops of profile_steps more steps, traced by the trainer's profiler."""
  with tempfile.TemporaryDirectory() as tmp:
    prof = profiler_lib.Profiler(tmp, first_step=1, skip=0, count=cfg["profile_steps"])
    for i in range(1, cfg["profile_steps"] + 1):
      with prof.step(i, (params, opt_state)):
        params, opt_state, loss = compiled(
          params, opt_state, batch, jax.random.fold_in(key, 1000 + i)
        )
      prof.after(i, loss)
    prof.close(loss)
    return profiler_lib.top_ops(tmp, n=12)


def check_train(cfg, limits, name):
  spec = cfg["train"][name]
  b, t = spec["batch"], spec["seq"]
  mcfg, model, objective, optimizer = _train_setup(cfg, spec)
  tokens = jax.random.randint(jax.random.PRNGKey(0), (b, t + 1), 0, mcfg.vocab_size)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = _init(model, (1, t))
  opt_state = jax.jit(optimizer.init)(params)
  num_params = int(sum(x.size for x in jax.tree.leaves(params)))
  _log(f"  {name}: {num_params:,} params, batch {b} x {t}, levers {spec['levers']}")

  def step(params, opt_state, batch, key):
    (loss, _), grads = jax.value_and_grad(objective.loss_fn, has_aux=True)(params, None, batch, key)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

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
  # Causal attention counted once: the scores' FLOPs at the mean key count (T + 1) / 2.
  causal_flops = flops.train_flops_per_token(mcfg, (t + 1) / 2) * b * t
  model_tflops = step_flops / step_s / 1e12
  row = {
    "params": num_params,
    "batch": b,
    "seq_len": t,
    "size": spec["size"],
    "levers": spec["levers"],
    "attention_impl": mcfg.attention_impl,
    "model": {k: getattr(mcfg, k) for k in cfg["shapes"][spec["size"]]},
    "dtype": mcfg.dtype,
    "param_dtype": mcfg.param_dtype,
    "compile_s": compile_s,
    "step_s": step_s,
    "step_s_all": times,
    "tokens_per_s": b * t / step_s,
    "step_flops": step_flops,
    "step_flops_causal": causal_flops,
    "model_tflops": model_tflops,
    "mfu_datasheet": model_tflops / DATASHEET_BF16_TFLOPS,
    "first_loss": first_loss,
    "final_loss": float(loss),
  }
  if limits.get("matmul_tflops"):
    row["mfu_measured"] = model_tflops / limits["matmul_tflops"]
    row["mfu_measured_causal"] = causal_flops / step_s / 1e12 / limits["matmul_tflops"]
    target = MFU_TARGETS.get(spec["size"].removeprefix("size_"))
    if target is not None:
      row["mfu_target"] = target
      row["target_met"] = bool(row["mfu_measured_causal"] >= target)
  if mem is not None:
    row["xla_memory_bytes"] = int(
      mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
    )
  if not np.isfinite(row["final_loss"]):
    raise FloatingPointError(f"non-finite loss {row['final_loss']}")
  if spec["profile"]:
    row["top_ops"] = _profile(cfg, compiled, params, opt_state, batch, key)
  return row


# ---------------------------------------------------------------------------------------------
# Generation engine.


def _requests(cfg, vocab_size: int) -> list[GenRequest]:
  e = cfg["engine"]
  rng = np.random.default_rng(4)  # Distinct random prompts: no prefix-cache hits.
  return [
    GenRequest(
      i,
      tuple(int(x) for x in rng.integers(0, vocab_size, e["prompt"])),
      SamplingParams(max_new_tokens=e["new_tokens"]),
    )
    for i in range(e["requests"])
  ]


def check_engine(cfg, limits, share_kv: bool, impl: str = "auto"):
  """The engine's decode; impl: EngineConfig.attention_impl ('auto': the paged kernel on an
  accelerator, XLA's gather on CPU; 'xla': the gather path)."""
  e = cfg["engine"]
  n, prompt, new, page = e["requests"], e["prompt"], e["new_tokens"], e["page"]
  length = prompt + new
  mcfg = _model_cfg(cfg["shapes"][e["model"]], length, param_dtype="bfloat16")
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
      attention_impl=impl,
    ),
  )
  requests = _requests(cfg, mcfg.vocab_size)
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
    "attention_impl": engine.executor.attention_impl,
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


def check_decode_model(cfg, limits, share_kv: bool):
  """The model's own batched decode (LoopedLM on a dense cache, no engine): the same params,
  prompts and greedy tokens as the engine rows, each prompt prefilled in one call, then one
  jitted call per token for every row at once; tokens/s over the decode calls."""
  e = cfg["engine"]
  n, prompt, new = e["requests"], e["prompt"], e["new_tokens"]
  length = prompt + new
  mcfg = _model_cfg(cfg["shapes"][e["model"]], length, param_dtype="bfloat16")
  model = LoopedLM(mcfg)
  params = _engine_params(model, (1, 8))
  tokens_BxP = jnp.asarray([r.prompt_tokens for r in _requests(cfg, mcfg.vocab_size)], jnp.int32)

  def call(params, tokens_BxT, cache):
    logits_BxTxV, aux = model.apply(params, tokens_BxT, cache=cache)
    return jnp.argmax(logits_BxTxV[:, -1], axis=-1).astype(jnp.int32)[:, None], aux["cache"]

  call = jax.jit(call, donate_argnums=(2,))
  fresh = lambda: init_cache(mcfg, n, length, share_kv, jnp.bfloat16)
  start = time.perf_counter()
  token_Bx1, cache = call(params, tokens_BxP, fresh())  # Compiles the prefill ...
  token_Bx1, cache = call(params, token_Bx1, cache)  # ... and the decode call.
  jax.block_until_ready(token_Bx1)
  compile_s = time.perf_counter() - start
  runs = []
  for _ in range(e["reps"]):
    token_Bx1, cache = call(params, tokens_BxP, fresh())
    jax.block_until_ready(token_Bx1)
    start = time.perf_counter()
    for _ in range(new - 1):
      token_Bx1, cache = call(params, token_Bx1, cache)
    jax.block_until_ready(token_Bx1)
    runs.append(time.perf_counter() - start)
  decode_s = statistics.median(runs)
  return {
    "layout": "shared" if share_kv else "unshared",
    "attention_impl": mcfg.attention_impl,
    "params": int(sum(x.size for x in jax.tree.leaves(params))),
    "requests": n,
    "prompt_tokens": prompt,
    "new_tokens": new,
    "dtype": mcfg.dtype,
    "compile_and_first_run_s": compile_s,
    "decode_tokens_per_s": n * (new - 1) / decode_s,
    "decode_step_s": decode_s / (new - 1),
    "decode_s_all": runs,
  }


# ---------------------------------------------------------------------------------------------
# The BeNice! pilot.


def check_pilot(cfg, limits, deadline_s: float | None = None):
  """configs/benice.py's pilot run as `python -m looped.main` (its own process, so a run cut
  at the deadline is a timeout, not a hang): wall time, the pretraining's last MFU and
  tokens/s, and each model's perplexities and exact shared gap, with the CPU recipe study's
  targets (docs/benice_recipe.md) beside them."""
  p = cfg["pilot"]
  with tempfile.TemporaryDirectory() as workdir:
    command = [
      sys.executable,
      "-m",
      "looped.main",
      f"--config={os.path.join(_REPO, 'configs', 'benice.py')}:{p['config']}",
      f"--workdir={workdir}",
      *(f"--config.{k}={v}" for k, v in p["overrides"].items()),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=deadline_s)
    wall_s = time.perf_counter() - start
    if done.returncode:
      raise RuntimeError(f"the pipeline exited {done.returncode}: {done.stderr[-2000:]}")
    with open(os.path.join(workdir, "report", "shareability.json")) as f:
      report = json.load(f)
    pretrain = _last_metrics(os.path.join(workdir, "pretrain", "metrics.jsonl"))
  keep = ("ppl_unshared_eval", "ppl_unshared_subset", "ppl_shared_exact_subset", "gap_exact")
  models = {
    name: {k: m[k] for k in (*keep, "gap_exact_ci95") if k in m}
    for name, m in report["models"].items()
  }
  row = {"config": p["config"], "wall_s": wall_s, "models": models}
  row["pretrain_last"] = {k: pretrain.get(k) for k in ("step", "loss", "tokens_per_s", "mfu")}
  zero, ft, bn = (models.get(k, {}) for k in ("zero_shot", "finetune", "benice"))
  if zero.get("gap_exact") and bn:
    # The recipe study's targets: BeNice!'s gap at most a fifth of zero-shot's, below the
    # finetune's, and its unshared ppl within 1% of the finetune's.
    row["gap_of_zero_shot"] = bn["gap_exact"] / zero["gap_exact"]
  if ft and bn:
    row["ppl_vs_finetune"] = bn["ppl_unshared_eval"] / ft["ppl_unshared_eval"] - 1.0
    row["gap_below_finetune"] = bool(bn["gap_exact"] < ft["gap_exact"])
  return row


def _last_metrics(path: str) -> dict:
  with open(path) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  return lines[-1] if lines else {}


# ---------------------------------------------------------------------------------------------
# Driver, table, JSON.


def _checks(cfg):
  """(name, kind, fn(cfg, limits) -> row) in run order: the limits first, then the pilot (its
  own process, while this one holds little device memory), then by priority for a run under
  --deadline_s: decode bandwidth, the kernels' correctness, the engine on the paged kernel, the
  training rows (FULL's order), the engine on XLA's gather and the model's own decode."""
  out = [("limits", "limits", check_limits)]
  out.append(("pilot", "pilot", lambda c, lim: check_pilot(c, lim, lim.get("time_left_s"))))
  for fmt in DECODE_FORMATS:
    out.append(
      (f"paged_decode_{fmt}", "kernel", lambda c, lim, f=fmt: check_paged_decode(c, lim, f))
    )
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
  out.append(("block_prefill", "kernel", check_block_prefill))
  engines = []
  for impl, suffix in (("auto", ""), ("xla", "_gather")):
    for share in (False, True):
      name = f"engine_{'shared' if share else 'unshared'}{suffix}"
      fn = lambda c, lim, s=share, i=impl: check_engine(c, lim, s, i)
      engines.append((name, "engine", fn))
  out += engines[:2]  # The paged kernel's path end to end, before the training rows.
  for name in cfg["train"]:
    out.append((name, "train", lambda c, lim, n=name: check_train(c, lim, n)))
  out += engines[2:]
  for share in (False, True):
    name = f"decode_model_{'shared' if share else 'unshared'}"
    out.append((name, "engine", lambda c, lim, s=share: check_decode_model(c, lim, s)))
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
      err = row.get("error") or row.get("reason", "")
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
        if "target_of_copy" in row:
          met = "met" if row["target_met"] else "not met"
          achieved += f"; target {row['target_of_copy']:.0%} of copy: {met}"
        if "speed_vs_bf16" in row:
          met = "met" if row["target_met"] else "not met"
          achieved += f"; {row['speed_vs_bf16']:.2f}x bf16's tokens/s (target 1x: {met})"
      lines.append(f"| {name} | ok | {err} | {kernel} | {xla} | {ratio} | {achieved} |")
    elif kind == "train":
      lines.append(_train_line(name, row))
    elif kind == "engine":
      with_prefill = (
        f"; {row['tokens_per_s']:.4g} tokens/s with prefill" if "tokens_per_s" in row else ""
      )
      lines.append(
        f"| {name} | ok | {row['params'] / 1e6:.1f}M params, {row['requests']} requests x "
        f"({row['prompt_tokens']} + {row['new_tokens']}) tokens, greedy, attention "
        f"{row.get('attention_impl', '')} | decode step {row['decode_step_s'] * 1e3:.3g} ms | | | "
        f"{row['decode_tokens_per_s']:.4g} decode tokens/s{with_prefill} |"
      )
    elif kind == "pilot":
      lines.append(_pilot_line(name, row))
  if lim:
    lines += [
      "",
      f"Limits measured in this run: {lim['matmul_tflops']:.4g} TFLOP/s bf16 matmul, "
      f"{lim['copy_gbps']:.4g} GB/s copy.",
    ]
  return "\n".join(lines)


def _train_line(name: str, row: dict) -> str:
  levers = ", ".join(f"{k} {v}" for k, v in row.get("levers", {}).items()) or "defaults"
  target = ""
  if "mfu_target" in row:
    met = "met" if row["target_met"] else "not met"
    target = f" (target {row['mfu_target']:.0%}: {met})"
  top = ""
  if row.get("top_ops"):
    top = "; top ops " + ", ".join(
      f"{op['name'][:40]} {op['share']:.0%}" for op in row["top_ops"][:5]
    )
  return (
    f"| {name} | ok | {row['params'] / 1e6:.1f}M params, batch {row['batch']} x "
    f"{row['seq_len']}, attention {row.get('attention_impl', '')}, {levers}, compile "
    f"{row['compile_s']:.0f} s | step {row['step_s'] * 1e3:.4g} ms | | | "
    f"{row['model_tflops']:.4g} TFLOP/s model FLOPs: MFU "
    f"{_fmt(row.get('mfu_measured'), '.1%')} of measured matmul (causal attention "
    f"{_fmt(row.get('mfu_measured_causal'), '.1%')}{target}), {row['mfu_datasheet']:.1%} of "
    f"{DATASHEET_BF16_TFLOPS:.0f}; {row['tokens_per_s']:.4g} tokens/s{top} |"
  )


def _pilot_line(name: str, row: dict) -> str:
  models = "; ".join(
    f"{model}: ppl {m['ppl_unshared_eval']:.3f}, exact gap {m['gap_exact']:+.1%}"
    for model, m in row["models"].items()
  )
  vs = []
  if "gap_of_zero_shot" in row:
    vs.append(f"BeNice! gap {row['gap_of_zero_shot']:.2f} of zero-shot's (target <= 0.20)")
  if "ppl_vs_finetune" in row:
    vs.append(f"ppl {row['ppl_vs_finetune']:+.1%} vs finetune (target <= +1%)")
    vs.append(f"gap below finetune's: {row['gap_below_finetune']}")
  last = row.get("pretrain_last", {})
  mfu = f", pretraining MFU {last['mfu']:.1%} (the trainer's log)" if last.get("mfu") else ""
  return (
    f"| {name} | ok | configs/benice.py:{row['config']}, wall {row['wall_s']:.0f} s{mfu} | | | "
    f"| {models}; {'; '.join(vs)} |"
  )


DOCS_BEGIN = "<!-- accelerator_check table: begin -->"
DOCS_END = "<!-- accelerator_check table: end -->"


def write_docs(path: str, text: str) -> None:
  """Replaces what stands between DOCS_BEGIN and DOCS_END in `path` (docs/kernels.md) by
  `text`; ValueError if the markers are missing."""
  with open(path) as f:
    doc = f.read()
  if doc.count(DOCS_BEGIN) != 1 or doc.count(DOCS_END) != 1:
    raise ValueError(f"{path} needs one {DOCS_BEGIN!r} and one {DOCS_END!r} line.")
  head, rest = doc.split(DOCS_BEGIN)
  _, tail = rest.split(DOCS_END)
  with open(path, "w") as f:
    f.write(f"{head}{DOCS_BEGIN}\n{text}\n{DOCS_END}{tail}")


def _write(path: str, result: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f, indent=1, default=str)
  os.replace(tmp, path)


def _error_line(e: BaseException) -> str:
  lines = [x for x in str(e).splitlines() if x.strip()]
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _brief(row: dict) -> str:
  keys = ("rel_err", "pass", "kernel_s", "xla_s", "matmul_tflops", "copy_gbps", "step_s")
  keys += ("mfu_measured", "mfu_measured_causal", "decode_tokens_per_s", "params", "wall_s")
  return (
    row.get("error")
    or row.get("reason")
    or ", ".join(
      f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k in keys
    )
  )


def _run_check(cfg, limits, kind, fn) -> dict:
  """One check's row: its figures, or its error (first line and traceback)."""
  start, cpu_start = time.perf_counter(), time.process_time()
  try:
    row = {"kind": kind, "status": "ok", **fn(cfg, limits)}
  except Exception as e:  # noqa: BLE001 (recorded; the other checks still run)
    row = {"kind": kind, "status": "error", "error": _error_line(e)}
    row["traceback"] = traceback.format_exc()[-3000:]
    _log(traceback.format_exc())
  row["wall_s"] = time.perf_counter() - start
  row["cpu_s"] = time.process_time() - cpu_start
  return row


def run(toy: bool, out: str, only: tuple[str, ...] = (), deadline_s: float | None = None) -> dict:
  """Runs the checks `only` names (all: empty); with deadline_s, a check starts only if its
  EXPECTED_S fits in the time left (else a 'skipped' row says so), and the pilot's process
  is stopped at the deadline."""
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
      "only": list(only),
      "deadline_s": deadline_s,
    },
    "limits": {},
    "checks": {},
  }
  limits = result["limits"]
  begin = time.perf_counter()
  for name, kind, fn in _checks(cfg):
    if only and not any(name.startswith(o) for o in only):
      continue
    elapsed = time.perf_counter() - begin
    left = None if deadline_s is None else deadline_s - elapsed
    if left is not None and _expected_s(name) > left:
      reason = f"not started: expected {_expected_s(name):.0f} s, {max(left, 0.0):.0f} s left"
      result["checks"][name] = {"kind": kind, "status": "skipped", "reason": reason}
      _log(f"[{elapsed:6.1f} s] {name}: skipped ({reason})")
      continue
    _log(f"[{elapsed:6.1f} s] {name} ...")
    if left is not None:
      limits["time_left_s"] = left  # For a check that stops itself (the pilot).
    row = _run_check(cfg, limits, kind, fn)
    limits.pop("time_left_s", None)
    result["checks"][name] = row
    _log(f"[{time.perf_counter() - begin:6.1f} s] {name}: {row['status']} ({_brief(row)})")
    _write(out, result)
  _judge_nvfp4(result["checks"])
  result["wall_s"] = time.perf_counter() - begin
  _write(out, result)
  return result


def _judge_nvfp4(checks: dict) -> None:
  """nvfp4's target: paged decode at least as many tokens/s as bf16 on the same pages (the
  same token count in both rows, so the ratio of their times)."""
  nvfp4, bf16 = checks.get("paged_decode_nvfp4", {}), checks.get("paged_decode_bf16", {})
  if nvfp4.get("status") == "ok" and bf16.get("status") == "ok":
    nvfp4["speed_vs_bf16"] = bf16["kernel_s"] / nvfp4["kernel_s"]
    nvfp4["target_met"] = bool(nvfp4["speed_vs_bf16"] >= 1.0)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--toy", action="store_true", help="Tiny shapes (automatic on CPU).")
  parser.add_argument(
    "--out", default=os.path.join(_REPO, "benchmarks", "results", "accelerator_check.json")
  )
  parser.add_argument("--only", default="", help="Comma-separated check names or prefixes.")
  parser.add_argument(
    "--deadline_s",
    type=float,
    default=None,
    help="Start no check expected to end after this many seconds (EXPECTED_S); none: all run.",
  )
  parser.add_argument(
    "--write_docs",
    default="",
    help="Also write the table into this file between its accelerator_check markers "
    "(docs/kernels.md).",
  )
  parser.add_argument("--table_from", default="", help="Print the table of this JSON and exit.")
  args = parser.parse_args()
  if args.table_from:
    with open(args.table_from) as f:
      text = table(json.load(f))
    print(text)
    if args.write_docs:
      write_docs(args.write_docs, text)
    return
  toy = args.toy or jax.default_backend() == "cpu"
  _log(f"{jax.devices()[0]} ({jax.default_backend()}), jax {jax.__version__}, toy={toy}")
  only = tuple(o for o in args.only.split(",") if o)
  result = run(toy, args.out, only, args.deadline_s)
  text = table(result)
  print("\n" + text, flush=True)
  if args.write_docs:
    write_docs(args.write_docs, text)
  print(f"\nwrote {args.out} ({result['wall_s']:.0f} s)", flush=True)


if __name__ == "__main__":
  main()
