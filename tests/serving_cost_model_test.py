"""Model shape, KV bytes per format and layout, roofline step times, hardware profiles."""

import json
import os
import tempfile

from absl.testing import absltest

from configs import serve_sim
from looped.serving import cost_model, hardware, scheduler, shape


def _paper_shape():
  return shape.ModelShape.from_config(serve_sim.get_config().model)


class ShapeTest(absltest.TestCase):
  def test_paper_size_model(self):
    s = _paper_shape()
    # Per layer: q, o 1536*1536 each; k, v 1536*512 each; SwiGLU 3*1536*4096.
    self.assertEqual(s.params_per_layer, 2 * 1536 * 1536 + 2 * 1536 * 512 + 3 * 1536 * 4096)
    self.assertEqual(s.layer_executions, 8 + 8 * 8 + 8)
    self.assertEqual((s.kv_layers(True), s.kv_layers(False)), (24, 80))
    per_layer = 4 * 128 * 2 * 2  # KV heads * head_dim * (K and V) * bf16.
    self.assertEqual(s.kv_bytes_per_token(True, "bf16"), 24 * per_layer)  # 48 KiB.
    self.assertEqual(s.kv_bytes_per_token(False, "bf16"), 80 * per_layer)  # 160 KiB.
    self.assertEqual(s.kv_bytes_per_token(True, "nvfp4"), 24 * 4 * 128 * 2 * (0.5 + 1 / 16))
    self.assertEqual(s.num_params, 24 * s.params_per_layer + 32768 * 1536)

  def test_relu2_has_two_matrices(self):
    cfg = serve_sim.get_config().model
    cfg.mlp_type = "relu2"
    s = shape.ModelShape.from_config(cfg)
    self.assertEqual(s.params_per_layer, 2 * 1536 * 1536 + 2 * 1536 * 512 + 2 * 1536 * 4096)


class CostModelTest(absltest.TestCase):
  def setUp(self):
    super().setUp()
    self.hw = hardware.Hardware("t", 1e15, 1e12, 1e9, 0.002, "test")
    self.shape = _paper_shape()

  def test_decode_step_is_memory_bound_and_reads_context_per_execution(self):
    ex = cost_model.CostModelExecutor(self.shape, self.hw, share_kv=True, kv_format="bf16")
    ctx = 10_000
    weights = 2 * (80 * self.shape.params_per_layer + 32768 * 1536)
    moved = weights + 80 * 2048 * ctx + 24 * 2048 * 1  # Read by all 80 executions, 24 written.
    self.assertAlmostEqual(ex.decode_step_time(1, ctx), moved / 1e12 + 0.002, places=12)

  def test_sharing_changes_only_the_written_bytes(self):
    shared = cost_model.CostModelExecutor(self.shape, self.hw, share_kv=True, kv_format="bf16")
    unshared = cost_model.CostModelExecutor(self.shape, self.hw, share_kv=False, kv_format="bf16")
    diff = unshared.decode_step_time(4, 40_000) - shared.decode_step_time(4, 40_000)
    self.assertAlmostEqual(diff, 4 * (80 - 24) * 2048 / 1e12, places=15)

  def test_prefill_is_compute_bound_with_causal_attention(self):
    ex = cost_model.CostModelExecutor(self.shape, self.hw, share_kv=False, kv_format="fp8")
    q, c = 4096, 1000
    flops = 2 * 80 * self.shape.params_per_layer * q
    flops += 4 * 12 * 128 * 80 * (q * c + q * (q + 1) // 2)
    flops += 2 * 32768 * 1536
    batch = scheduler.StepBatch([None], [q], [c], num_sampled=1)
    self.assertAlmostEqual(ex.execute(batch), flops / 1e15 + 0.002, places=12)

  def test_execute_agrees_with_decode_step_time(self):
    ex = cost_model.CostModelExecutor(self.shape, self.hw, share_kv=True, kv_format="nvfp4")
    batch = scheduler.StepBatch([None] * 3, [1, 1, 1], [10, 2000, 70_000], num_sampled=3)
    self.assertEqual(ex.execute(batch), ex.decode_step_time(3, 72_010))


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


if __name__ == "__main__":
  absltest.main()
