"""Roofline executor: prices a step from the model's shape instead of running it.

For a batch of b requests where request i computes q_i new tokens after c_i cached ones, with
per-token multiply-adds summed over the layer executions (looped.model.flops, each layer by its
mixer; ModelShape): W of the layers' weights, Z of KDA's state update and read, and K per
position attended over (GQA 2 N H; MLA N (L + Y) + N L, absorbed; KDA none):

  FLOPs = 2 * (W + Z) * sum(q_i)                         layers (weights, KDA state)
        + 2 * K * sum(q_i*c_i + q_i*(q_i+1)/2)           scores and values, causal
        + 2 * V * d * (requests that emit a token)       LM head on sampled positions only
  bytes = w * (W + V * d)                                weights, read once per layer execution
        + kv_read * sum(c_i)                             context K/V read by every execution
        + kv_write * sum(q_i)                            new K/V written
        + b * (state_read + state_write)                 KDA states, read and written per row
  time  = max(FLOPs / peak, bytes / bandwidth) + overhead      (hardware.combine 'max')
        = FLOPs / peak + bytes / bandwidth + overhead           (hardware.combine 'sum')

kv_write is the bytes one token leaves in the cache (ModelShape.kv_bytes_per_token, from the
model's cache layout: for GQA, num_kv_heads * head_dim * 2 * bytes_per_value(format) per cached
layer, P + B + C layers shared, P + R*B + C unshared), and kv_read the same over every layer
execution, i.e. the unshared layout's bytes. Sharing changes what is *stored* (and so how many
requests and cached prefixes fit), not what is *read*: each of the R
recurrences still attends over the whole context, reading the one shared copy R times, since the
recurrences run one after another. KDA states follow the same rule (state_read: every
execution's, the unshared layout's bytes per sequence; state_write: the layout's). Activations,
norms, the injection and the embedding lookup are left out (each is under ~1% of a step's bytes
or FLOPs at the paper's size). MLA is priced in the absorbed form the engine's cached calls
run (scores and values over the cached latents; looped.model.flops.mixer_macs).

This prices the batch an ideal engine computes. `engine_cost.executor_for` picks its pricing
instead for a profile with pricing 'engine' (what looped/engine really computes on its hardware).
"""

from __future__ import annotations

from looped.model.cache_layout import KVLayout
from looped.scheduler import scheduler as scheduler_lib
from looped.sim import hardware as hardware_lib
from looped.sim import shape as shape_lib

WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "fp32": 4.0}


class CostModelExecutor:
  """Executor whose steps take the roofline time of the batch on the given hardware."""

  def __init__(
    self,
    shape: shape_lib.ModelShape,
    hardware: hardware_lib.Hardware,
    layout: KVLayout,
    *,
    weight_format: str = "bf16",
  ):
    """layout: the cache's layout and format (its page size is the scheduler's)."""
    self.shape = shape
    self.hardware = hardware
    head = shape.vocab_size * shape.d_model
    self._flops_per_token = 2.0 * (shape.weight_macs_per_token + shape.state_macs_per_token)
    self._flops_per_pair = 2.0 * shape.macs_per_key
    self._flops_per_sample = 2.0 * head
    self._weight_bytes = WEIGHT_BYTES[weight_format] * (shape.weight_macs_per_token + head)
    unshared = KVLayout(False, layout.format)  # What a step reads: every recurrence's entries.
    self._read_per_context_token = shape.kv_bytes_per_token(unshared)
    self._write_per_token = shape.kv_bytes_per_token(layout)
    self._state_per_row = shape.kv_bytes_per_sequence(unshared) + shape.kv_bytes_per_sequence(
      layout
    )
    self._inv_flops = 1.0 / hardware.peak_flops
    self._inv_bw = 1.0 / hardware.mem_bandwidth
    self._overhead = hardware.step_overhead_s
    self._add = hardware.combine == "sum"

  def step_terms(
    self, tokens: int, sampled: int, attention_pairs: int, context: int, rows: int = 0
  ) -> tuple[float, float]:
    """FLOPs and bytes of a step from its totals (see the module docstring); rows: requests in
    the step (their KDA states are read and written)."""
    flops = (
      self._flops_per_token * tokens
      + self._flops_per_pair * attention_pairs
      + self._flops_per_sample * sampled
    )
    moved = (
      self._weight_bytes + self._read_per_context_token * context + self._write_per_token * tokens
    )
    if self._state_per_row:
      moved += self._state_per_row * rows
    return flops, moved

  def step_time(
    self, tokens: int, sampled: int, attention_pairs: int, context: int, rows: int = 0
  ) -> float:
    """Time of a step from its totals (see the module docstring)."""
    flops, moved = self.step_terms(tokens, sampled, attention_pairs, context, rows)
    if self._add:
      return flops * self._inv_flops + moved * self._inv_bw + self._overhead
    return max(flops * self._inv_flops, moved * self._inv_bw) + self._overhead

  def terms(self, batch: scheduler_lib.StepBatch) -> tuple[float, float]:
    """The batch's FLOPs and bytes."""
    pairs = sum(
      q * c + q * (q + 1) // 2 for q, c in zip(batch.num_new_tokens, batch.num_context_tokens)
    )
    return self.step_terms(
      sum(batch.num_new_tokens),
      batch.num_sampled,
      pairs,
      sum(batch.num_context_tokens),
      len(batch.num_new_tokens),
    )

  def execute(self, batch: scheduler_lib.StepBatch) -> float:
    pairs = sum(
      q * c + q * (q + 1) // 2 for q, c in zip(batch.num_new_tokens, batch.num_context_tokens)
    )
    return self.step_time(
      sum(batch.num_new_tokens),
      batch.num_sampled,
      pairs,
      sum(batch.num_context_tokens),
      len(batch.num_new_tokens),
    )

  def decode_step_time(self, num_seqs: int, context: int) -> float:
    """A step where each of num_seqs requests decodes one token after `context` tokens in all."""
    return self.step_time(num_seqs, num_seqs, context + num_seqs, context, num_seqs)
