"""Writes tests/testdata/kv_quant_vectors.npz: torchao reference round trips for looped.kv_quant.

  /tmp/venv/bin/pip install torch==2.13.0 torchao==0.18.0   # CPU wheels; not project deps
  python tests/make_kv_quant_vectors.py

CI installs no torch: tests/kv_quant_test.py compares against the committed file, and also runs
the functions below live when torchao is importable.

References:
  mxfp8 / mxfp8_rceil  torchao.prototype.mx_formats.mx_tensor.to_mx(x, float8_e4m3fn, 32,
                       ScaleCalculationMode.FLOOR / RCEIL) and its dequantizer to_dtype (what
                       MXTensor.dequantize calls).
  nvfp4                NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale) (nvfp4_quantize) and
                       NVFP4Tensor.dequantize, per_tensor_scale from per_tensor_amax_to_scale.
  fp8                  hand-written torch: clamp(x * (1 / scale), +-448).to(float8_e4m3fn)
                       * scale with scale = max(amax / 448, 2^-100).
"""

from __future__ import annotations

import os

import numpy as np

ROWS, HEAD_DIM = 16, 64  # Every case is one [ROWS, HEAD_DIM] array (so tests compile once).
NUM_RANDOM = 12
CALIBRATED_TENSOR_SCALES = (1e-3, 0.25)  # Fixed nvfp4 tensor scales (0.25 saturates scales).
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "kv_quant_vectors.npz")

_F32 = np.float32


def _next_up(v, n=1):
  v = _F32(v)
  for _ in range(n):
    v = np.nextafter(v, _F32(np.inf), dtype=np.float32)
  return v


def _fill(rows: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
  """Stacks 64-wide rows and pads to ROWS with unit-normal rows."""
  out = rng.standard_normal((ROWS, HEAD_DIM)).astype(np.float32)
  for i, r in enumerate(rows):
    out[i] = np.asarray(r, np.float32)
  return out


def random_cases(seed: int) -> dict[str, np.ndarray]:
  """Random data over a wide exponent range, heavy tails, and bf16-valued rows."""
  rng = np.random.default_rng(seed)
  cases = {}
  for i in range(NUM_RANDOM):
    kind = i % 4
    x = rng.standard_normal((ROWS, HEAD_DIM))
    if kind == 1:  # Magnitudes from 1e-4 to 1e4 per row.
      x *= 10.0 ** rng.uniform(-4, 4, (ROWS, 1))
    elif kind == 2:  # Heavy tails (outliers inside blocks).
      x = rng.standard_t(1.5, (ROWS, HEAD_DIM))
    elif kind == 3:  # Per-element exponents spread over float32's normal range.
      x *= 2.0 ** rng.integers(-120, 120, (ROWS, HEAD_DIM))
    x = x.astype(np.float32)
    if i % 2:  # Values a bf16 KV cache would hold.
      x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    cases[f"random{i}"] = x
  return cases


def edge_cases(seed: int = 1) -> dict[str, np.ndarray]:
  """Hand-built rows; each block of 32 (mx) / 16 (nvfp4) targets one corner."""
  rng = np.random.default_rng(seed)
  u = lambda n=HEAD_DIM: rng.standard_normal(n).astype(np.float32)
  cases = {}

  z = np.zeros(HEAD_DIM, np.float32)
  half_zero = u()
  half_zero[:32] = 0.0
  signed = np.where(np.arange(HEAD_DIM) % 2, 0.0, -0.0).astype(np.float32)
  one_value = np.full(HEAD_DIM, -0.0, np.float32)
  one_value[5] = 3.0
  cases["zeros"] = _fill([z, -z, half_zero, signed, one_value, u() * 1e-30], rng)

  rows = []
  for big in (1e30, 3.0e38, -np.finfo(np.float32).max, 448.0 * 2.0**100, 65504.0):
    r = u()
    r[3] = big
    r[40] = -big / 3
    rows.append(r)
  cases["huge"] = _fill(rows, rng)

  at_max = np.array(
    [448, 449, 464, 465, 479, 480, 500, 1e4, -448, -464, -480, 0.5, 1, 2, 3, 6]
    + [6.5, 7, -6, -7, 5, -5, 1e-3, 0] * 6,
    np.float32,
  )
  rows = [at_max, at_max * 2.0**-8, at_max * 2.0**20, at_max * 2.0**-60]
  for k in (-20, -3, 0, 7, 60):  # amax exactly 448 * 2^k and 6 * 2^k.
    r = u() * 2.0**k
    r[0] = 448.0 * 2.0**k
    r[33] = 6.0 * 2.0**k
    rows.append(r)
  cases["format_max"] = _fill(rows, rng)

  # e4m3 subnormal range after the block scale: amax 1 -> scale 2^-8, e4m3 subnormals 2^-9..
  sub = 2.0 ** -np.arange(10, 26, dtype=np.float64)
  r = np.concatenate(
    [
      [1.0],
      sub * 2.0**-8,
      1.5 * sub * 2.0**-8,
      [3 * 2.0**-18, 2.0**-18],
      -sub[:12] * 2.0**-8,
      [2.0**-17 * 1.5, 2.0**-17 * 2.5, 7 * 2.0**-19],
    ]
  )
  r = np.concatenate([r, np.zeros(HEAD_DIM - len(r))])
  rows = [r[:64], -r[:64], r[:64] * 2.0**-100]
  cases["e4m3_subnormal"] = _fill(rows, rng)

  ties = np.array(
    [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.1, 0.26, 0.74, 2.49, 2.51, 4.9, 5.1, -0.25],
    np.float32,
  )
  rows = [
    np.tile(ties, 4),
    np.tile(-ties, 4),
    np.tile(ties, 4) * 2.0**-10,
    np.tile(ties, 4) * 0.5,
    np.tile(ties, 4) * 3.0,
  ]
  cases["e2m1_ties"] = _fill(rows, rng)

  # float32 subnormals: whole blocks of them, and in blocks whose amax sits at the mx minimum.
  tiny = np.finfo(np.float32).smallest_subnormal
  sub_row = (rng.integers(1, 2**23, HEAD_DIM) * np.where(rng.random(HEAD_DIM) < 0.5, -1, 1)).astype(
    np.float32
  ) * tiny
  rows = [
    sub_row,
    sub_row * 2.0**-10,
    np.full(HEAD_DIM, tiny, np.float32),
    np.full(HEAD_DIM, -(2.0**-130), np.float32),
  ]
  for amax in (2.0**-119, 2.0**-118, 1.5 * 2.0**-118, 2.0**-117, 2.0**-110, 2.0**-100):
    r = sub_row.copy()
    r[0] = amax
    r[32] = -amax
    r[1:8] = amax * np.array([0.5, 0.25, 2**-3, 2**-7, 2**-8, 3 * 2**-10, 2**-12])
    rows.append(r)
  cases["f32_subnormal"] = _fill(rows, rng)

  # mxfp8_rceil thresholds: amax / 448 around 2^-127 (subnormal quotient) and 2^-126.
  t_bits = 0x04600002
  rows = []
  for bits_delta in (-2, -1, 0, 1, 2):
    r = u() * 2.0**-125
    r[0] = np.array(t_bits + bits_delta, np.uint32).view(np.float32)
    r[1:32] *= 2.0**-10
    r[32] = _F32(448.0 * 2.0**-126) * _F32(1 + bits_delta * 2.0**-23)
    r[33:] *= 2.0**-8
    rows.append(r)
  r = u() * 2.0**-130
  r[0] = 448.0 * 2.0**-127
  r[32] = 448.0 * 2.0**-127 * 1.5
  rows.append(r)
  cases["rceil_boundary"] = _fill(rows, rng)

  # amax / 448 a few ulps above a power of two: torchao's float log2 rounds these down.
  rows = []
  for k in (-100, -20, 0, 30, 100):
    for ulps in (1, 3):
      r = u() * 2.0**k
      r[0] = _F32(448.0) * _next_up(2.0**k, ulps)
      r[32] = -_F32(448.0) * _F32(2.0**k)
      rows.append(r)
  cases["rceil_log2"] = _fill(rows, rng)

  rows = []
  for specials in ([np.nan], [np.inf], [-np.inf], [np.inf, -np.inf], [np.nan, np.inf]):
    r = u()
    r[7 : 7 + len(specials)] = specials
    r[40] = -5.0
    rows.append(r)
  r = u()
  r[50] = np.inf
  rows.append(r)
  for where in ((0,), (31,), (32,), (63,), (0, 63)):  # NaN at the ends of blocks and rows.
    r = u()
    r[list(where)] = np.nan
    rows.append(r)
  cases["nan_inf"] = _fill(rows, rng)
  cases["inf_only"] = _fill([np.where(np.arange(HEAD_DIM) == 9, np.inf, 1.0)], rng)

  cases["zero_tensor"] = np.zeros((ROWS, HEAD_DIM), np.float32)
  neg = np.full((ROWS, HEAD_DIM), -0.0, np.float32)
  neg[0, 0] = 1e-32  # Tensor amax below the nvfp4 tensor-scale floor's reach.
  cases["tiny_tensor"] = neg
  return cases


def torch_fp8(x: np.ndarray) -> dict[str, np.ndarray]:
  """Hand-written per-vector fp8 reference with torch's float8_e4m3fn cast."""
  import torch

  t = torch.from_numpy(x)
  amax = torch.amax(torch.abs(t), dim=-1, keepdim=True)
  scale = torch.clamp(amax / 448.0, min=2.0**-100)
  q = torch.clamp(t * (1.0 / scale), -448.0, 448.0).to(torch.float8_e4m3fn)
  dq = q.to(torch.float32) * scale
  return {
    "codes": q.view(torch.uint8).numpy(),
    "scale": scale[..., 0].numpy(),
    "dequant": dq.numpy(),
  }


def torchao_mx(x: np.ndarray, rceil: bool) -> dict[str, np.ndarray]:
  """torchao to_mx + to_dtype round trip (e4m3 elements, block 32)."""
  import torch
  from torchao.prototype.mx_formats.config import ScaleCalculationMode
  from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

  mode = ScaleCalculationMode.RCEIL if rceil else ScaleCalculationMode.FLOOR
  scale, data = to_mx(torch.from_numpy(x), torch.float8_e4m3fn, 32, scaling_mode=mode)
  dq = to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.float32)
  return {
    "codes": data.view(torch.uint8).numpy(),
    "scale": scale.view(torch.uint8).numpy(),
    "dequant": dq.numpy(),
  }


def torchao_nvfp4(x: np.ndarray, tensor_scale: float | None) -> dict[str, np.ndarray]:
  """torchao NVFP4Tensor round trip with a per-tensor scale (computed or calibrated)."""
  import torch
  from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

  t = torch.from_numpy(x)
  if tensor_scale is None:
    ts = per_tensor_amax_to_scale(torch.max(torch.abs(t)))
  else:
    ts = torch.tensor(tensor_scale, dtype=torch.float32)
  q = NVFP4Tensor.to_nvfp4(t, block_size=16, per_tensor_scale=ts)
  return {
    "codes": q.qdata.view(torch.uint8).numpy(),
    "scale": q.scale.view(torch.uint8).numpy(),
    "tensor_scale": np.asarray(ts.numpy(), np.float32),
    "dequant": q.dequantize(torch.float32).numpy(),
  }


def reference(cases: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """All references for all cases, as flat 'case/fmt/field' arrays (plus 'case/x')."""
  out = {}
  for name, x in cases.items():
    out[f"{name}/x"] = x
    for field, v in torch_fp8(x).items():
      out[f"{name}/fp8/{field}"] = v
    for fmt, rceil in (("mxfp8", False), ("mxfp8_rceil", True)):
      for field, v in torchao_mx(x, rceil).items():
        out[f"{name}/{fmt}/{field}"] = v
    for ts in (None, *CALIBRATED_TENSOR_SCALES):
      fmt = "nvfp4" if ts is None else f"nvfp4@{ts}"
      for field, v in torchao_nvfp4(x, ts).items():
        out[f"{name}/{fmt}/{field}"] = v
  return out


def main():
  import torch
  import torchao

  cases = {**random_cases(seed=0), **edge_cases()}
  out = reference(cases)
  out["versions"] = np.array(f"torch {torch.__version__}, torchao {torchao.__version__}")
  os.makedirs(os.path.dirname(OUT), exist_ok=True)
  np.savez_compressed(OUT, **out)
  print(f"wrote {len(cases)} cases ({len(out)} arrays) to {OUT}")


if __name__ == "__main__":
  main()
