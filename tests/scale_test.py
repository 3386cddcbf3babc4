"""Scale tooling: MFU against a hand FLOP count, the profiler's trace, the dry run's per-device
table against a hand count of the 140M model's parameters, and 3 steps of that model on CPU."""

import contextlib
import glob
import gzip
import io
import json
import os
import tempfile

from absl.testing import absltest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

import looped_testing as testing
from configs import benice as benice_configs
from configs import pretrain
from looped import model as model_lib
from looped.benice import objectives as benice_objectives
from looped.model.looped_lm import LoopedLM
from looped.train import mfu, trainer
from looped.train.metrics_writer import read_metrics

PEAK_TFLOPS = 1e-3  # train.peak_tflops: a made-up peak, so MFU is the hand count's alone.
# Multiply-adds per token of one forward of the smoke model (P/B/C = 1/2/1, R = 4) at T = 32:
# a layer's Q and O 64 x 64 each, K and V 64 x 32 each = 12288; SwiGLU 3 x 64 x 128 = 24576;
# 1 + 2 x 4 + 1 = 10 layers run. Diagonal injection e B^T: 64 x 64 per recurrence, 4 of them.
# Tied LM head 64 x 257. Scores Q K^T and P V: 2 x 2 heads x 32 wide x 32 keys per layer run.
SMOKE_MACS_T32 = 10 * (12288 + 24576) + 4 * 64 * 64 + 64 * 257 + 10 * 2 * 2 * 32 * 32


def _xspace_class():
  """A message class of the profiler's XSpace with its first fields (planes: id and name), so
  that the xplane.pb is parsed as the protobuf it claims to be, without TensorFlow's protos."""
  f = descriptor_pb2.FileDescriptorProto(name="xplane_min.proto", package="t", syntax="proto3")
  plane = f.message_type.add(name="XPlane")
  plane.field.add(name="id", number=1, type=3, label=1)  # int64
  plane.field.add(name="name", number=2, type=9, label=1)  # string
  space = f.message_type.add(name="XSpace")
  space.field.add(name="planes", number=1, type=11, label=3, type_name=".t.XPlane")
  space.field.add(name="hostnames", number=4, type=9, label=3)
  pool = descriptor_pool.DescriptorPool()
  pool.Add(f)
  return message_factory.GetMessageClass(pool.FindMessageTypeByName("t.XSpace"))


class TinyRunTest(testing.TempDirTestCase):
  """One 3-step run of the smoke model: MFU on every line after the compiling step, and a
  trace of steps 2 and 3 (profile_skip_steps = 1, profile_steps = 2)."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls._dir = tempfile.TemporaryDirectory()
    cls.addClassCleanup(cls._dir.cleanup)
    cls.workdir = os.path.join(cls._dir.name, "run")
    config = testing.smoke_config(
      {
        "train.num_steps": 3,
        "train.log_every": 1,
        "train.eval_every": 3,
        "train.checkpoint_every": 3,
        "train.peak_tflops": PEAK_TFLOPS,
        "train.profile_steps": 2,
        "train.profile_skip_steps": 1,
        "depth.sampler": "fixed",
      }
    )
    cls.config = config
    trainer.run(config, cls.workdir)
    cls.records = read_metrics(cls.workdir)

  def test_mfu_is_hand_counted_flops_over_step_time_over_peak(self):
    m, d = self.config.model, self.config.data
    self.assertEqual((m.d_model, m.num_heads, m.num_kv_heads, m.head_dim), (64, 2, 1, 32))
    self.assertEqual((m.mlp_dim, m.mlp_type, m.injection), (128, "swiglu", "diagonal"))
    self.assertEqual((m.vocab_size, d.seq_len, m.num_recurrences), (257, 32, 4))
    self.assertEqual(SMOKE_MACS_T32, 442432)
    step_flops = 3 * 2 * SMOKE_MACS_T32 * d.batch_size * d.seq_len  # Backward: 2 forwards.
    timed = [r for r in self.records if r["tokens_per_s"] > 0]
    self.assertEqual([r["step"] for r in timed], [2, 3])
    self.assertNotIn("mfu", self.records[0])  # Step 1 compiles: nothing timed yet.
    for r in timed:  # The record's own time: tokens / (tokens / s).
      seconds = d.batch_size * d.seq_len / r["tokens_per_s"]
      self.assertAlmostEqual(r["mfu"], step_flops / seconds / (PEAK_TFLOPS * 1e12), delta=1e-9)

  def test_trace_of_the_chosen_steps(self):
    runs = glob.glob(os.path.join(self.workdir, "profile", "plugins", "profile", "*"))
    self.assertLen(runs, 1)
    with gzip.open(glob.glob(os.path.join(runs[0], "*.trace.json.gz"))[0]) as f:
      events = json.load(f)["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    self.assertEqual(steps, [2, 3])  # Step 1 skipped; each traced step annotated once.
    space = _xspace_class()()
    with open(glob.glob(os.path.join(runs[0], "*.xplane.pb"))[0], "rb") as f:
      space.ParseFromString(f.read())
    self.assertTrue(any(p.name.startswith("/host:") for p in space.planes))


class CountsTest(absltest.TestCase):
  """No compilation: the BeNice! step's FLOP count and the peak table's lookups."""

  def test_peak_table_matches_device_kinds(self):
    self.assertEqual(mfu.known_peak_tflops("TPU v5 lite"), 197.0)  # v5e, not v5p's 459.
    self.assertEqual(mfu.known_peak_tflops("TPU v5"), 459.0)
    self.assertEqual(mfu.known_peak_tflops("NVIDIA H100 80GB HBM3"), 989.0)
    self.assertEqual(mfu.known_peak_tflops("NVIDIA H100 PCIe"), 756.0)
    self.assertIsNone(mfu.known_peak_tflops("cpu"))

  def test_a_benice_step_counts_each_pass(self):
    config = benice_configs.get_config("smoke")
    config.benice.kv_passes = 2  # Gradient-free K/V passes, ramped in over 4 steps:
    config.benice.kv_passes_ramp_steps = 4  # step * 3 // 4 of them, at most 2.
    config.benice.kl_weight = 0.5  # A frozen teacher's forward.
    model = LoopedLM(model_lib.from_config(config.model))
    objective = benice_objectives.benice(model, config.post.depth, config.benice, frozen_params={})
    forward = 2 * SMOKE_MACS_T32
    for step, kv_passes in ((0, 0), (1, 0), (2, 1), (3, 2), (9, 2)):
      # Unshared and shared pass trained (3 forwards each), the K/V passes, the teacher.
      expected = (3 + 3 + kv_passes + 1) * forward
      self.assertEqual(objective.flops_per_token(32, step), expected, f"step {step}")


class Parcae140mTest(testing.TempDirTestCase):
  def _config(self, devices: int):
    config = pretrain.get_config("parcae_140m")
    for key, value in {
      "train.dry_run": True,
      "mesh.dry_run_devices": devices,
      "mesh.data": 1,
      "mesh.fsdp": -1,
    }.items():
      testing.set_field(config, key, value)
    trainer.validate(config)
    return config

  def test_dry_run_table_is_the_hand_count_per_device(self):
    # Parcae-small: d 768, 6 heads of 128 (no GQA), ReLU^2 MLP 3072, 2 + 2 + 2 layers, vocab
    # 32768 tied, diagonal injection. Matrices (sharded over fsdp on their d_model axis): per
    # layer Q, K, V, O 768 x 768 each and the MLP 2 x 768 x 3072; the embedding; the injection's
    # B 768 x 768. Vectors (replicated): per layer two d norms and two 128-wide QK norms; the
    # prelude and final norms, the injection's A_log and dt.
    matrices = 6 * (4 * 768 * 768 + 2 * 768 * 3072) + 32768 * 768 + 768 * 768
    vectors = 6 * (2 * 768 + 2 * 128) + 4 * 768
    for devices in (1, 8, 64):
      with self.subTest(devices=devices):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
          m = trainer.run(self._config(devices), self.tmp)
        params = 4 * (matrices // devices + vectors)  # float32.
        self.assertEqual(m["num_params"], matrices + vectors)
        self.assertEqual(m["params_bytes"], params)
        self.assertEqual(m["grads_bytes"], params)
        self.assertEqual(m["opt_state_bytes"], 2 * params + 2 * 4)  # mu, nu; 2 int32 counts.
        self.assertEqual(m["rows_per_device"], 256 // devices)
        self.assertGreater(m["activation_bytes"], 0)
        table = out.getvalue()
        self.assertIn(f"on {devices} devices (data=1 x fsdp={devices} x tensor=1)", table)
        self.assertIn(f"| params | {params:,} |", table)
        self.assertIn(f"| optimizer state (AdamW moments + count) | {2 * params + 8:,} |", table)

  def test_three_steps_on_cpu(self):
    # The 140M shape at batch 1 x 32 tokens, on the bundled stdlib corpus and byte tokenizer.
    config = pretrain.get_config("parcae_140m")
    for key, value in {
      **testing.TINY_RUN_OVERRIDES,
      "data.source": "stdlib",
      "data.tokenizer": "bytes",
      "data.segment_bytes": 4096,
      "data.batch_size": 1,
      "data.eval_batch_size": 1,
      "train.num_steps": 3,
      "train.log_every": 1,
      "train.eval_every": 3,
      "train.checkpoint_every": 3,
    }.items():
      testing.set_field(config, key, value)
    config.model.max_seq_len = 2048  # The model keeps its shape; only the rows are short.
    trainer.validate(config)
    result = trainer.run(config, self.tmp)
    records = read_metrics(self.tmp)
    self.assertEqual([r["step"] for r in records], [1, 2, 3])
    self.assertEqual(int(result.state.step), 3)
    self.assertTrue(all(r["mfu"] > 0 for r in records[1:]))


if __name__ == "__main__":
  absltest.main()
