"""Prices the step looped/engine's executor actually computes, not the scheduler's batch.

The executor runs a batch as at most two padded calls (padding.py: the one-token rows, and the
rows with longer chunks), each of b rows of t tokens attending over S = columns * page_size
dense slots. Every padded row, token and slot is computed (masked, not skipped), and the LM head
runs on every position. With per-token multiply-adds over the layer executions W (weights), Z
(KDA state) and K (per position read) as in cost_model, A attention heads executed per token,
vocabulary V, width d, summed over the step's calls:

  FLOPs = b * t * (2 * (W + Z) + 2 * V * d + 2 * K * (S + t))
  bytes = w * (W + V * d)                       weights, read by every call
          + b * (S + t) * kv_raw                K/V at compute precision, every execution
          + b * S * (kv_page + kv_raw) [fmt]    packed past read, dequantized copy written
          + 2 * 4 * A * b * t * (S + t)         float32 attention scores, written and read
          + 2 * kv_stored * b * S               gather: pages read, dense cache written
          + b * (state_read + state_write)      KDA states of the rows (cost_model)
  values = b * S * kv_raw / w  [fmt]            K/V values the format's reads dequantize
  time  = step_overhead + calls * call_overhead + combine(FLOPs / peak, bytes / bandwidth)
          + values * dequant_s_per_value[fmt]

w is the compute/weight bytes per value, kv_raw one token's cache entries over all L layer
executions at w bytes (the unshared layout's bytes, ModelShape.kv_bytes_per_token), kv_page the
same as stored (kv_raw for raw pages, else the format's packed bytes and scales), kv_stored the
stored bytes of the cached layers (the layout's, shared or not). Every layer execution reads
(and so dequantizes) its layer's past, in either layout. Nothing here depends on the batch beyond
its padded shape.

The dequantizing term exists because the bytes do not price it: on XLA:CPU an nvfp4 read is a
chain of unpacking ops, several times the cost of the bytes it saves (docs/server.md, "Multi-turn
sessions at a 1024-token context"). The built-in 'cpu_2core' profile was fitted on an earlier
executor and leaves it unpriced; `benchmarks/engine.py --hardware_out` fits it per format.
"""

from __future__ import annotations

import dataclasses

from looped.engine.padding import Padding
from looped.model.cache_layout import KVLayout
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
    layout: KVLayout,
    *,
    weight_format: str = "fp32",
  ):
    """layout: the pages' layout; its format None for raw pages (compute precision), else a
    looped.kv_quant format."""
    self.shape = shape
    self.hardware = hardware
    self.padding = padding
    self.layout = layout
    self.share_kv = layout.share_kv
    self.kv_format = layout.format
    w = cost_model.WEIGHT_BYTES[weight_format]
    self._w = w
    unshared = KVLayout(False, layout.format)
    self._kv_raw = shape.kv_bytes_per_token(KVLayout(False), raw_itemsize=w)
    formatted = layout.format is not None
    self._kv_page = shape.kv_bytes_per_token(unshared) if formatted else self._kv_raw
    self._kv_stored = shape.kv_bytes_per_token(layout, raw_itemsize=w)
    self._formatted = formatted
    self._state_per_row = shape.kv_bytes_per_sequence(unshared) + shape.kv_bytes_per_sequence(
      layout
    )

  def padded_terms(self, rows: int, tokens: int, slots: int) -> tuple[float, float]:
    """FLOPs and bytes of one padded call: rows x tokens new tokens over `slots` dense slots."""
    s = self.shape
    b, S, t = rows, slots, tokens
    head = s.vocab_size * s.d_model
    per_position = 2 * (s.weight_macs_per_token + s.state_macs_per_token) + 2 * head
    flops = b * t * (per_position + 2 * s.macs_per_key * (S + t))
    moved = (
      self._w * (s.weight_macs_per_token + head)
      + b * (S + t) * self._kv_raw
      + (b * S * (self._kv_page + self._kv_raw) if self._formatted else 0)
      + 2 * 4 * s.attention_heads_executed * b * t * (S + t)
      + 2 * self._kv_stored * b * S
      + b * self._state_per_row
    )
    return float(flops), float(moved)

  def terms(self, batch: scheduler_lib.StepBatch) -> tuple[float, float, int]:
    """The batch's padded FLOPs, bytes and model calls."""
    flops = moved = 0.0
    calls = self._calls(batch)
    for rows, tokens, slots in calls:
      f, m = self.padded_terms(rows, tokens, slots)
      flops, moved = flops + f, moved + m
    return flops, moved, len(calls)

  def dequantized_values(self, batch: scheduler_lib.StepBatch) -> float:
    """K/V values the batch's padded calls dequantize (0 for raw pages)."""
    if not self._formatted:
      return 0.0
    per_slot = self._kv_raw / self._w
    return float(sum(rows * slots * per_slot for rows, _, slots in self._calls(batch)))

  def _calls(self, batch: scheduler_lib.StepBatch) -> list[tuple[int, int, int]]:
    """(rows, tokens, dense slots) of each padded call."""
    p = self.padding.shape(batch.num_new_tokens, batch.num_context_tokens)
    return [(c.rows, c.tokens, c.columns * self.padding.page_size) for c in p.calls]

  def execute(self, batch: scheduler_lib.StepBatch) -> float:
    flops, moved, calls = self.terms(batch)
    hw = self.hardware
    compute, memory = flops / hw.peak_flops, moved / hw.mem_bandwidth
    combined = compute + memory if hw.combine == "sum" else max(compute, memory)
    dequant = 0.0
    if self._formatted:
      dequant = self.dequantized_values(batch) * hw.dequant_s_per_value.get(self.kv_format, 0.0)
    return hw.step_overhead_s + calls * hw.call_overhead_s + combined + dequant


def executor_for(
  shape: shape_lib.ModelShape,
  hw: hardware_lib.Hardware,
  config: scheduler_lib.SchedulerConfig,
  layout: KVLayout,
  *,
  weight_format: str,
):
  """The simulator's executor for a profile: the batch roofline, or (pricing 'engine') the
  engine's padded calls with its default buckets. There, 'bf16' stands for the engine's raw
  pages (stored at the weights' precision); other formats are stored packed."""
  if hw.pricing == "batch":
    return cost_model.CostModelExecutor(shape, hw, layout, weight_format=weight_format)
  if layout.format == "bf16":
    layout = dataclasses.replace(layout, format=None)
  padding = Padding.engine_default(config)
  return EngineCostExecutor(shape, hw, padding, layout, weight_format=weight_format)
