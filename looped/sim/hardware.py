"""Accelerator profiles for the roofline cost model, overridable from a JSON of measured values.

The simulator prices a step at the *attainable* ceilings, so the default H200 profile uses values
measured on an H200 (large bf16 matmul ~790 TFLOP/s, device-to-device copy ~4.3 TB/s) rather than
the spec sheet (989 TFLOP/s dense bf16, 4.8 TB/s): real kernels approach the measured ceilings,
never the spec ones. The H100 SXM spec is 989 TFLOP/s and 3.35 TB/s; with no H100 measurement at
hand its default profile derates the spec by the H200's measured/spec ratios (0.80, 0.90), which
is an estimate. The *_spec profiles keep the datasheet numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping

from looped import kv_quant

_H200_FLOPS_RATIO = 790e12 / 989e12
_H200_BW_RATIO = 4.3e12 / 4.8e12
COMBINE = ("max", "sum")
PRICING = ("batch", "engine")


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_flops: float  # Attainable dense bf16 FLOP/s (matmuls and attention).
  mem_bandwidth: float  # Attainable HBM bandwidth, bytes/s.
  memory_bytes: float  # HBM capacity (the largest sensible KV budget plus weights).
  step_overhead_s: float  # Fixed cost per engine step (scheduling, launches), seconds.
  source: str  # Where the numbers come from.
  # How compute and memory time combine: 'max' (roofline: they overlap, as on an accelerator) or
  # 'sum' (they add: a CPU core runs XLA's ops one after another).
  combine: str = "max"
  # What is priced: 'batch' (the scheduler's batch, as an ideal engine computes it) or 'engine'
  # (what looped/engine's executor computes: padded buckets, dense slots, token-by-token calls;
  # looped/sim/engine_cost.py).
  pricing: str = "batch"
  call_overhead_s: float = 0.0  # 'engine' pricing: fixed cost per model call (micro-step).
  # 'engine' pricing: seconds per K/V value a KV format's read dequantizes, by format (added to
  # the step; a format not named costs only its bytes). A CPU runs the unpacking as separate ops
  # (nvfp4: nibbles, the e2m1 table, two scales; bf16 pages: a widening convert); a fused GPU
  # kernel hides it in the load.
  dequant_s_per_value: Mapping[str, float] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.combine not in COMBINE or self.pricing not in PRICING:
      raise ValueError(
        f"{self.name}: combine = {self.combine!r} (allowed {COMBINE}), pricing = "
        f"{self.pricing!r} (allowed {PRICING})."
      )
    _check_dequant(self.name, self.dequant_s_per_value)


def _check_dequant(where: str, values) -> None:
  if not isinstance(values, Mapping):
    raise ValueError(f"{where}: dequant_s_per_value must map KV formats to seconds per value.")
  for fmt, s in values.items():
    if fmt not in kv_quant.FORMATS:
      raise ValueError(f"{where}: dequant_s_per_value names {fmt!r}; allowed: {kv_quant.FORMATS}.")
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s >= 0):
      raise ValueError(f"{where}: dequant_s_per_value[{fmt!r}] = {s!r} must be finite and >= 0.")


_OVERHEAD_S = 1e-3  # An engine step with CUDA graphs: host scheduling + launch, ~1 ms.

PROFILES = {
  "h200": Hardware(
    "h200", 790e12, 4.3e12, 141e9, _OVERHEAD_S, "measured bf16 matmul and copy bandwidth"
  ),
  "h200_spec": Hardware("h200_spec", 989e12, 4.8e12, 141e9, _OVERHEAD_S, "datasheet"),
  "h100": Hardware(
    "h100",
    989e12 * _H200_FLOPS_RATIO,
    3.35e12 * _H200_BW_RATIO,
    80e9,
    _OVERHEAD_S,
    "H100 SXM datasheet derated by the H200 measured/spec ratios (estimate)",
  ),
  "h100_spec": Hardware("h100_spec", 989e12, 3.35e12, 80e9, _OVERHEAD_S, "datasheet (SXM)"),
  # looped/engine's CPU steps (fp32, raw pages, one XLA thread pinned to one core of this 2-core
  # machine), priced as the engine pads them, terms added. Fitted by benchmarks/engine.py on 64
  # of 96 step shapes (unshared and shared); 18.9% median error on the 32 held out (docs/results.md,
  # "Cost-model calibration"). Formats' dequantization is not priced.
  "cpu_2core": Hardware(
    "cpu_2core",
    4.21e10,
    9.50e9,
    128e9,
    1.39e-3,
    "fitted by benchmarks/engine.py on 2026-12-02 (one pinned core, loaded machine)",
    combine="sum",
    pricing="engine",
    call_overhead_s=0.0,
  ),
}

_OVERRIDABLE = (
  "peak_flops",
  "mem_bandwidth",
  "memory_bytes",
  "step_overhead_s",
  "call_overhead_s",
  "dequant_s_per_value",
)


def load(name: str, override_json: str = "") -> Hardware:
  """Returns a named profile, with fields replaced by those in a JSON file if one is given.

  The JSON is an object with any of peak_flops, mem_bandwidth, memory_bytes, step_overhead_s
  (positive numbers), call_overhead_s (>= 0) and dequant_s_per_value (an object of KV formats
  to seconds >= 0), e.g. {"peak_flops": 7.5e14, "mem_bandwidth": 4.1e12}. The profile's combine
  and pricing are kept.
  """
  if name not in PROFILES:
    raise ValueError(f"Unknown hardware {name!r}; allowed: {', '.join(PROFILES)}.")
  hw = PROFILES[name]
  if not override_json:
    return hw
  with open(override_json) as f:
    values = json.load(f)
  if not isinstance(values, dict):
    raise ValueError(f"{override_json}: expected a JSON object of {list(_OVERRIDABLE)}.")
  unknown = sorted(set(values) - set(_OVERRIDABLE))
  if unknown:
    raise ValueError(f"{override_json}: unknown keys {unknown}; allowed: {list(_OVERRIDABLE)}.")
  for key, value in values.items():
    if key == "dequant_s_per_value":
      _check_dequant(override_json, value)
      continue
    zero_ok = key == "call_overhead_s"  # A profile may have no per-call cost.
    if (
      isinstance(value, bool)
      or not isinstance(value, (int, float))
      or not math.isfinite(value)
      or not (value >= 0 if zero_ok else value > 0)
    ):
      kind = "non-negative" if zero_ok else "positive"
      raise ValueError(f"{override_json}: {key} = {value!r} must be a {kind} finite number.")
  fields = {k: v if isinstance(v, dict) else float(v) for k, v in values.items()}
  if "dequant_s_per_value" in fields:
    fields["dequant_s_per_value"] = {k: float(v) for k, v in fields["dequant_s_per_value"].items()}
  return dataclasses.replace(hw, **fields, source=f"{hw.source}; {override_json}")
