"""Prices the step looped/engine's executor actually computes, not the scheduler's batch.

The executor pads a batch to a bucket (padding.py): b rows of q tokens attending over
S = columns * page_size dense slots, in n model calls of t tokens per row (n = 1, t = q for a
parallel chunk; n = the longest chunk, t = 1 token by token). Every padded row, token and slot is
computed (masked, not skipped), and the LM head runs on every position. With L layer executions
of N matrix parameters, H query heads of width hd, vocabulary V, width d:

  FLOPs = n * b * t * (2 * L * N + 2 * V * d + 4 * H * hd * L * (S + t))
  bytes = n * (w * (L * N + V * d)                   weights, read by every call
               + b * (S + t) * kv_raw                K/V at compute precision, every execution
               + b * S * (kv_page + kv_raw) [fmt]    packed past read, dequantized copy written
               + 2 * 4 * L * H * b * t * (S + t))   float32 attention scores, written and read
        + 2 * kv_stored * b * S                      gather: pages read, dense cache written
  time  = step_overhead + n * call_overhead + combine(FLOPs / peak, bytes / bandwidth)

w is the compute/weight bytes per value, kv_raw one token's cache entries over all L layer
executions at w bytes (the unshared layout's bytes, ModelShape.kv_bytes_per_token), kv_page the
same as stored (kv_raw for raw pages, else the format's packed bytes and scales), kv_stored the
stored bytes of the cached layers (the layout's, shared or not). Nothing here depends on the
batch beyond its padded shape.

Fitted to this machine's CPU (hardware 'cpu_2core', benchmarks/engine.py) it predicts held-out
step shapes with ~19-21% median error, up to ~70-85%: it under-prices context in the token-by-token
path and does not price a format's dequantization arithmetic (docs/results.md, "Cost-model
calibration").
"""

from __future__ import annotations

from looped.engine.padding import Padding
from looped.scheduler import scheduler as scheduler_lib
from looped.sim import cost_model
from looped.sim import hardware as hardware_lib
from looped.sim import shape as shape_lib


class EngineCostExecutor:
  """Executor whose steps take the modelled time of the engine's padded step (docstring)."""

  def __init__(
    self,
    shape: shape_lib.ModelShape,
    hardware: hardware_lib.Hardware,
    padding: Padding,
    *,
    share_kv: bool,
    kv_format: str | None,
    weight_format: str = "fp32",
  ):
    """kv_format: None for raw pages (compute precision), else a looped.kv_quant format."""
    self.shape = shape
    self.hardware = hardware
    self.padding = padding
    self.share_kv = share_kv
    self.kv_format = kv_format
    w = cost_model.WEIGHT_BYTES[weight_format]
    self._w = w
    self._kv_raw = shape.kv_bytes_per_token(False, None, raw_itemsize=w)
    formatted = kv_format is not None
    self._kv_page = shape.kv_bytes_per_token(False, kv_format) if formatted else self._kv_raw
    self._kv_stored = shape.kv_bytes_per_token(share_kv, kv_format, raw_itemsize=w)
    self._formatted = formatted

  def padded_terms(self, rows: int, tokens: int, slots: int, calls: int) -> tuple[float, float]:
    """FLOPs and bytes of a padded step: rows x tokens new tokens over `slots` dense past slots
    in `calls` model calls (one token per row per call when the padding is sequential)."""
    s = self.shape
    b, S, n = rows, slots, calls
    t = 1 if self.padding.sequential else tokens
    layers, heads = s.layer_executions, s.num_heads
    head = s.vocab_size * s.d_model
    per_position = 2 * layers * s.params_per_layer + 2 * head
    flops = n * b * t * (per_position + 4 * heads * s.head_dim * layers * (S + t))
    per_call = (
      self._w * (layers * s.params_per_layer + head)
      + b * (S + t) * self._kv_raw
      + (b * S * (self._kv_page + self._kv_raw) if self._formatted else 0)
      + 2 * 4 * layers * heads * b * t * (S + t)
    )
    moved = n * per_call + 2 * self._kv_stored * b * S
    return float(flops), float(moved)

  def terms(self, batch: scheduler_lib.StepBatch) -> tuple[float, float, int]:
    """The batch's padded FLOPs, bytes and model calls."""
    p = self.padding.shape(batch.num_new_tokens, batch.num_context_tokens)
    flops, moved = self.padded_terms(p.rows, p.tokens, p.columns * self.padding.page_size, p.calls)
    return flops, moved, p.calls

  def execute(self, batch: scheduler_lib.StepBatch) -> float:
    flops, moved, calls = self.terms(batch)
    hw = self.hardware
    compute, memory = flops / hw.peak_flops, moved / hw.mem_bandwidth
    combined = compute + memory if hw.combine == "sum" else max(compute, memory)
    return hw.step_overhead_s + calls * hw.call_overhead_s + combined


def executor_for(
  shape: shape_lib.ModelShape,
  hw: hardware_lib.Hardware,
  config: scheduler_lib.SchedulerConfig,
  *,
  share_kv: bool,
  kv_format: str,
  weight_format: str,
):
  """The simulator's executor for a profile: the batch roofline, or (pricing 'engine') the
  engine's padded step with its default buckets. There, 'bf16' stands for the engine's raw pages
  (stored at the weights' precision, parallel chunks unless shared); other formats are stored
  packed and run token by token, as in the engine."""
  if hw.pricing == "batch":
    return cost_model.CostModelExecutor(
      shape, hw, share_kv=share_kv, kv_format=kv_format, weight_format=weight_format
    )
  fmt = None if kv_format == "bf16" else kv_format
  padding = Padding.engine_default(config, sequential=share_kv or fmt is not None)
  return EngineCostExecutor(
    shape, hw, padding, share_kv=share_kv, kv_format=fmt, weight_format=weight_format
  )
