"""Model shape, KV bytes per format and layout, roofline step times, hardware profiles, and the
engine-aware pricing (padded calls: one-token rows, multi-token rows) of the CPU profile."""

import dataclasses
import json
import os
import tempfile

from absl.testing import absltest

from configs import serve_sim
from looped.engine import padding
from looped.model.cache_layout import KVLayout
from looped.scheduler import scheduler
from looped.sim import cost_model, engine_cost, hardware, shape


def _paper_shape():
  return shape.ModelShape.from_config(serve_sim.get_config().model)


# Matrix values of one paper-size layer: q, o 1536*1536 each; k, v 1536*512 each; SwiGLU
# 3*1536*4096 (also its multiply-adds per token).
_PAPER_LAYER = 2 * 1536 * 1536 + 2 * 1536 * 512 + 3 * 1536 * 4096


class ShapeTest(absltest.TestCase):
  def test_paper_size_model(self):
    s = _paper_shape()
    self.assertEqual(s.layer_executions, 8 + 8 * 8 + 8)
    self.assertEqual(s.weight_macs_per_token, 80 * _PAPER_LAYER)
    self.assertEqual(s.macs_per_key, 80 * 2 * 12 * 128)
    self.assertEqual((s.state_macs_per_token, s.attention_heads_executed), (0, 80 * 12))
    self.assertEqual((s.kv_layers(KVLayout(True)), s.kv_layers(KVLayout(False))), (24, 80))
    per_layer = 4 * 128 * 2 * 2  # KV heads * head_dim * (K and V) * bf16.
    self.assertEqual(s.kv_bytes_per_token(KVLayout(True, "bf16")), 24 * per_layer)  # 48 KiB.
    self.assertEqual(s.kv_bytes_per_token(KVLayout(False, "bf16")), 80 * per_layer)  # 160 KiB.
    self.assertEqual(
      s.kv_bytes_per_token(KVLayout(True, "nvfp4")), 24 * 4 * 128 * 2 * (0.5 + 1 / 16)
    )
    # Layers add their q/k norms (2 x 128) and 2 norms of 1536; then the tied embedding,
    # prelude and final norms and the diagonal injection (B, A_log, dt).
    layer = _PAPER_LAYER + 2 * 128 + 2 * 1536
    extra = 2 * 1536 + 1536 * 1536 + 2 * 1536
    self.assertEqual(s.num_params, 24 * layer + 32768 * 1536 + extra)

  def test_relu2_has_two_matrices(self):
    cfg = serve_sim.get_config().model
    cfg.mlp_type = "relu2"
    s = shape.ModelShape.from_config(cfg)
    layer = 2 * 1536 * 1536 + 2 * 1536 * 512 + 2 * 1536 * 4096
    self.assertEqual(s.weight_macs_per_token, 80 * layer)


class CostModelTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.hw = hardware.Hardware("t", 1e15, 1e12, 1e9, 0.002, "test")
    self.shape = _paper_shape()

  def test_decode_step_is_memory_bound_and_reads_context_per_execution(self):
    ex = cost_model.CostModelExecutor(self.shape, self.hw, KVLayout(True, "bf16"))
    ctx = 10_000
    weights = 2 * (80 * _PAPER_LAYER + 32768 * 1536)
    moved = weights + 80 * 2048 * ctx + 24 * 2048 * 1  # Read by all 80 executions, 24 written.
    self.assertAlmostEqual(ex.decode_step_time(1, ctx), moved / 1e12 + 0.002, places=12)

  def test_sharing_changes_only_the_written_bytes(self):
    shared = cost_model.CostModelExecutor(self.shape, self.hw, KVLayout(True, "bf16"))
    unshared = cost_model.CostModelExecutor(self.shape, self.hw, KVLayout(False, "bf16"))
    diff = unshared.decode_step_time(4, 40_000) - shared.decode_step_time(4, 40_000)
    self.assertAlmostEqual(diff, 4 * (80 - 24) * 2048 / 1e12, places=15)

  def test_prefill_is_compute_bound_with_causal_attention(self):
    ex = cost_model.CostModelExecutor(self.shape, self.hw, KVLayout(False, "fp8"))
    q, c = 4096, 1000
    flops = 2 * 80 * _PAPER_LAYER * q
    flops += 4 * 12 * 128 * 80 * (q * c + q * (q + 1) // 2)
    flops += 2 * 32768 * 1536
    batch = scheduler.StepBatch([None], [q], [c], num_sampled=1)
    self.assertAlmostEqual(ex.execute(batch), flops / 1e15 + 0.002, places=12)

  def test_execute_agrees_with_decode_step_time(self):
    ex = cost_model.CostModelExecutor(self.shape, self.hw, KVLayout(True, "nvfp4"))
    batch = scheduler.StepBatch([None] * 3, [1, 1, 1], [10, 2000, 70_000], num_sampled=3)
    self.assertEqual(ex.execute(batch), ex.decode_step_time(3, 72_010))


# Step prices of the accelerator profiles before the engine pricing existed (commit e8febb4):
# (profile, share_kv, kv_format, weight_format) -> three mixed batches, then a decode run.
_BATCHES = (
  ([1, 1, 1], [10, 2000, 70000], 3),
  ([4096, 1], [1000, 5000], 1),
  ([512] * 3 + [1] * 5, [0, 16, 4096, 100, 200, 300, 400, 131000], 6),
)
_LEGACY = {
  ("h200", True, "bf16", "bf16"): (
    0.004703595579534883,
    0.02965405172204557,
    0.010492205495412656,
    0.006663853544186046,
  ),
  ("h200", False, "nvfp4", "fp8"): (
    0.0022516178158139533,
    0.02965405172204557,
    0.010492205495412656,
    0.002802970373953488,
  ),
  ("h200_spec", True, "bf16", "bf16"): (
    0.004317804373333333,
    0.023888474075243683,
    0.008582247059025279,
    0.0060738688,
  ),
  ("h100", False, "nvfp4", "fp8"): (
    0.0027933628405692468,
    0.02965405172204557,
    0.010492205495412656,
    0.003583360535813953,
  ),
  ("h100_spec", True, "bf16", "bf16"): (
    0.00575386895283582,
    0.023888474075243683,
    0.00891150102925373,
    0.008270020967164178,
  ),
}


class LegacyPricingTest(absltest.TestCase):
  def test_accelerator_profiles_price_exactly_as_before(self):
    config = scheduler.SchedulerConfig(16, 8192, 256, 131072)
    for (name, share, fmt, wf), expected in _LEGACY.items():
      hw = hardware.load(name)
      self.assertEqual((hw.combine, hw.pricing, hw.call_overhead_s), ("max", "batch", 0.0))
      ex = engine_cost.executor_for(
        _paper_shape(), hw, config, KVLayout(share, fmt), weight_format=wf
      )
      self.assertIsInstance(ex, cost_model.CostModelExecutor)
      got = [ex.execute(scheduler.StepBatch([None] * len(q), q, c, n)) for q, c, n in _BATCHES]
      self.assertEqual((*got, ex.decode_step_time(7, 123456)), expected, name)

  def test_sum_adds_compute_and_memory(self):
    hw = hardware.Hardware("t", 1e15, 1e12, 1e9, 0.002, "test", combine="sum")
    ex = cost_model.CostModelExecutor(_paper_shape(), hw, KVLayout(True, "bf16"))
    flops = 2 * 80 * _PAPER_LAYER + 4 * 12 * 128 * 80 * 1 + 2 * 32768 * 1536
    weights = 2 * (80 * _PAPER_LAYER + 32768 * 1536)
    moved = weights + 24 * 2048
    self.assertAlmostEqual(ex.decode_step_time(1, 0), flops / 1e15 + moved / 1e12 + 0.002)


def _tiny_shape():
  # d 4, 2 query heads and 1 KV head of 4, SwiGLU 8, vocabulary 10, P/B/C 1/1/1, R 2.
  # Per layer: q, o 4*8 each, k, v 4*4 each, MLP 3*4*8: 64 + 32 + 96 = 192 parameters.
  # Layer executions L = 1 + 2 + 1 = 4; cached layers 4 unshared, 3 shared.
  return shape.ModelShape(
    vocab_size=10,
    d_model=4,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    mlp_dim=8,
    mlp_type="swiglu",
    num_prelude_layers=1,
    num_core_layers=1,
    num_coda_layers=1,
    num_recurrences=2,
    tie_embeddings=True,
  )


# Pages of 4 tokens, rows (1, 2, 4), chunk lengths (2, 4, 8), page-table widths (1, 2, 4)
# capped by ceil((max_model_len 16 + 8) / 4) = 6 columns.
def _padding():
  return padding.Padding.create(4, (1, 2, 4), (2, 4, 8), (1, 2, 4), max_model_len=16)


class PaddingTest(absltest.TestCase):
  def test_buckets_by_hand(self):
    self.assertEqual(_padding().column_buckets, (1, 2, 4, 6))
    # Rows 1 and 2 (one token each): 2 rows, reach 9 + 1 = 10 slots -> 3 pages -> 4 columns.
    # Row 0 (3 tokens): 1 row of 4 tokens, reach 5 + 4 = 9 slots -> 3 pages -> 4 columns.
    p = _padding().shape([3, 1, 1], [5, 0, 9])
    C = padding.CallShape
    self.assertEqual(p.calls, (C(2, 1, 4), C(1, 4, 4)))
    self.assertEqual(p.groups, ((1, 2), (0,)))
    self.assertEqual(p.computed, 2 + 4)
    # 8 tokens after 14: 22 slots -> 6 pages, the cap.
    self.assertEqual(_padding().shape([8], [14]).calls, (C(1, 8, 6),))

  def test_geometric_buckets(self):
    self.assertEqual(padding.geometric(8), (1, 2, 3, 4, 6, 8))
    self.assertEqual(padding.geometric(20), (1, 2, 3, 4, 6, 8, 12, 16, 20))
    for limit in range(1, 200):  # Each bucket within 1.5x (or one more) of the one before.
      b = padding.geometric(limit)
      self.assertEqual(b[-1], limit)
      self.assertTrue(all(y <= max(1.5 * x, x + 1) for x, y in zip(b, b[1:])), b)

  def test_engine_default_needs_max_model_len(self):
    config = scheduler.SchedulerConfig(16, 64, 8, 256, prefill_block=32)
    p = padding.Padding.engine_default(config)
    # Powers of two (padding.default_buckets): chunks from 4 tokens, page tables from 4 pages.
    self.assertEqual(p.row_buckets, (1, 2, 4, 8))
    self.assertEqual(p.token_buckets, (4, 8, 16, 32))  # Up to the block.
    self.assertEqual(p.column_buckets, (4, 8, 16, 18))  # ceil((256 + 32) / 16) = 18.
    with self.assertRaisesRegex(ValueError, "max_model_len"):
      padding.Padding.engine_default(scheduler.SchedulerConfig(16, 64, 8))


class EngineCostTest(absltest.TestCase):
  """FLOPs and bytes of the padded calls, derived by hand for the tiny shape (fp32)."""

  hw = hardware.Hardware(
    "t", 1e6, 1e5, 1.0, 0.5, "test", combine="sum", pricing="engine", call_overhead_s=0.25
  )
  batch = scheduler.StepBatch([None] * 3, [3, 1, 1], [5, 0, 9], num_sampled=2)

  def test_unshared_raw(self):
    ex = engine_cost.EngineCostExecutor(_tiny_shape(), self.hw, _padding(), KVLayout(False, None))
    # Two calls over 16 slots: 2 rows x 1 token, 1 row x 4 tokens. Per position: linear
    # 2*4*192 = 1536, LM head 2*10*4 = 80, attention 4*2*4*4*(16 + t) = 128*(16 + t).
    flops = 2 * (1536 + 80 + 128 * 17) + 4 * (1536 + 80 + 128 * 20)
    # Per call: weights 4*(4*192 + 40) = 3232; K/V read, 4 layers * 32 B = 128 B per token
    # and slot: 128 * rows * (16 + t); float32 scores 2*4 B * 4 layers * 2 heads * rows * t *
    # (16 + t); gather of 4 cached layers * 32 B, read and written: 2 * 128 * rows * 16.
    call_1 = 3232 + 128 * 2 * 17 + 8 * 4 * 2 * 2 * 1 * 17 + 2 * 128 * 2 * 16
    call_4 = 3232 + 128 * 1 * 20 + 8 * 4 * 2 * 1 * 4 * 20 + 2 * 128 * 1 * 16
    self.assertEqual(ex.terms(self.batch), (flops, call_1 + call_4, 2))
    moved = call_1 + call_4
    self.assertAlmostEqual(ex.execute(self.batch), 0.5 + 2 * 0.25 + flops / 1e6 + moved / 1e5)
    self.assertEqual(ex.dequantized_values(self.batch), 0.0)  # Raw pages: nothing to unpack.
    ex.hardware = dataclasses.replace(self.hw, dequant_s_per_value={"fp8": 1.0})
    self.assertAlmostEqual(ex.execute(self.batch), 0.5 + 2 * 0.25 + flops / 1e6 + moved / 1e5)

  def test_shared_fp8(self):
    ex = engine_cost.EngineCostExecutor(_tiny_shape(), self.hw, _padding(), KVLayout(True, "fp8"))
    flops = 2 * (1536 + 80 + 128 * 17) + 4 * (1536 + 80 + 128 * 20)
    # fp8 page: 4 values of K and V at 1 B plus a 4 B scale each: 16 B per token and layer, so
    # the packed past read plus its dequantized copy is rows * 16 * (4 * 16 + 128); the gather
    # moves 3 cached layers (shared) * 16 B.
    call_1 = 3232 + 128 * 2 * 17 + 2 * 16 * 192 + 8 * 4 * 2 * 2 * 1 * 17 + 2 * 48 * 2 * 16
    call_4 = 3232 + 128 * 1 * 20 + 1 * 16 * 192 + 8 * 4 * 2 * 1 * 4 * 20 + 2 * 48 * 1 * 16
    moved = call_1 + call_4
    self.assertEqual(ex.terms(self.batch), (flops, moved, 2))
    self.assertAlmostEqual(ex.execute(self.batch), 0.5 + 2 * 0.25 + flops / 1e6 + moved / 1e5)
    ex.hardware = dataclasses.replace(self.hw, combine="max")
    self.assertAlmostEqual(ex.execute(self.batch), 0.5 + 2 * 0.25 + max(flops / 1e6, moved / 1e5))
    # Dequantized on every read: all 4 layer executions (not the 3 cached layers) x 8 values (K
    # and V of one head of 4) per slot, over 2 x 16 + 1 x 16 padded slots.
    self.assertEqual(ex.dequantized_values(self.batch), 4 * 8 * 48)
    ex.hardware = dataclasses.replace(self.hw, dequant_s_per_value={"fp8": 1e-3, "nvfp4": 1.0})
    self.assertAlmostEqual(
      ex.execute(self.batch), 0.5 + 2 * 0.25 + flops / 1e6 + moved / 1e5 + 1e-3 * 4 * 8 * 48
    )

  def test_simulator_maps_formats_to_the_engine(self):
    config = scheduler.SchedulerConfig(4, 8, 4, 16)
    make = lambda share, fmt: engine_cost.executor_for(
      _tiny_shape(), self.hw, config, KVLayout(share, fmt), weight_format="fp32"
    )
    raw = make(False, "bf16")  # Raw pages at the weights' precision.
    self.assertIsNone(raw.kv_format)
    self.assertEqual(make(False, "fp8").kv_format, "fp8")  # Packed pages, as in the engine.
    self.assertEqual(raw.padding, padding.Padding.engine_default(config))
    self.assertFalse(hasattr(raw, "decode_step_time"))  # Prices depend on the widest row.


class HardwareTest(absltest.TestCase):
  def test_profiles(self):
    h200 = hardware.load("h200")
    self.assertEqual((h200.peak_flops, h200.mem_bandwidth), (790e12, 4.3e12))
    self.assertEqual(hardware.load("h100_spec").mem_bandwidth, 3.35e12)
    with self.assertRaisesRegex(ValueError, "allowed: h200"):
      hardware.load("tpu")

  def test_json_override(self):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "hw.json")
    with open(path, "w") as f:
      json.dump({"mem_bandwidth": 4.1e12, "step_overhead_s": 5e-4}, f)
    hw = hardware.load("h200", path)
    self.assertEqual((hw.mem_bandwidth, hw.step_overhead_s, hw.peak_flops), (4.1e12, 5e-4, 790e12))
    with open(path, "w") as f:
      json.dump({"bandwidth": 1}, f)
    with self.assertRaisesRegex(ValueError, "unknown keys \\['bandwidth'\\]"):
      hardware.load("h200", path)
    with open(path, "w") as f:
      json.dump({"call_overhead_s": 0, "step_overhead_s": 1e-3}, f)
    hw = hardware.load("cpu_2core", path)
    self.assertEqual(
      (hw.call_overhead_s, hw.pricing), (0.0, hardware.PROFILES["cpu_2core"].pricing)
    )

  def test_dequant_costs_from_json(self):
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    path = os.path.join(tmp.name, "hw.json")
    with open(path, "w") as f:
      json.dump({"dequant_s_per_value": {"nvfp4": 2e-9, "fp8": 0}}, f)
    hw = hardware.load("cpu_2core", path)
    self.assertEqual(dict(hw.dequant_s_per_value), {"nvfp4": 2e-9, "fp8": 0.0})
    self.assertEqual(hw.peak_flops, hardware.PROFILES["cpu_2core"].peak_flops)
    self.assertEqual(dict(hardware.PROFILES["cpu_2core"].dequant_s_per_value), {})
    for bad, message in (
      ({"int4": 1e-9}, "names 'int4'; allowed: \\('bf16'"),
      ({"nvfp4": -1e-9}, "\\['nvfp4'\\] = -1e-09 must be finite and >= 0"),
      ({"nvfp4": True}, "must be finite"),
      ([1e-9], "must map KV formats"),
    ):
      with self.subTest(bad=bad):
        with open(path, "w") as f:
          json.dump({"dequant_s_per_value": bad}, f)
        with self.assertRaisesRegex(ValueError, message):
          hardware.load("cpu_2core", path)

  def test_combine_and_pricing_are_checked(self):
    with self.assertRaisesRegex(ValueError, "combine = 'add'"):
      hardware.Hardware("x", 1.0, 1.0, 1.0, 0.0, "", combine="add")


if __name__ == "__main__":
  absltest.main()
