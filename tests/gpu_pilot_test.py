"""configs/benice.py:gpu_pilot: the `fixed` regime at 65M parameters, and its dry run.

The pilot runs on an accelerator (benchmarks/accelerator_check.py --only=pilot); here its config
is checked and the BeNice! program's dry run (train.dry_run: per-device memory and the model
FLOPs of a pretraining step, no data read, nothing allocated) is compared with hand counts.
"""

import contextlib
import io

from absl.testing import absltest

import looped_testing as testing
from configs import benice as benice_configs
from looped import config_checks as cc
from looped import programs

D, HEADS, KV_HEADS, HEAD, MLP, LAYERS, R, VOCAB = 1024, 8, 4, 128, 4096, 4, 4, 257
T, BATCH = 256, 32


def _hand_counts():
  """(params, pretraining step FLOPs) of the pilot: a `fixed` model (core layers only, linear
  injection [h; e] W, tied embedding, QK-norm) with SwiGLU MLPs, every recurrence run."""
  attn = D * HEADS * HEAD * 2 + D * KV_HEADS * HEAD * 2  # Q, O; K, V.
  mlp = 3 * D * MLP
  per_layer = attn + mlp + 2 * D + 2 * HEAD  # Attention and MLP norms, QK norms.
  params = LAYERS * per_layer + 2 * D * D + VOCAB * D + 2 * D  # Injection, embedding, norms.
  scores = 2 * HEADS * HEAD * T  # QK^T and PV over the full T x T scores, per token.
  macs = R * (LAYERS * (attn + mlp + scores) + 2 * D * D) + D * VOCAB
  return params, 3 * 2 * macs * BATCH * T  # Forward and backward (two forwards).


class GpuPilotTest(testing.TempDirTestCase):
  def _dry_run(self, **overrides):
    config = benice_configs.get_config("gpu_pilot")
    for key, value in {"train.dry_run": True, **overrides}.items():
      testing.set_field(config, key, value)
    module = programs.validate(config, self.tmp)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      m = module.run(config, self.tmp)
    return config, m, out.getvalue()

  def test_config_is_the_fixed_regime_at_scale(self):
    config = benice_configs.get_config("gpu_pilot")
    fixed = benice_configs.get_config("fixed")
    for path in ("depth.sampler", "model.injection", "model.num_prelude_layers", "benice"):
      self.assertEqual(cc.get(config, path), cc.get(fixed, path), path)
    self.assertEqual(config.train.num_steps, fixed.train.num_steps)
    self.assertEqual(config.post.train.num_steps, fixed.post.train.num_steps)
    self.assertEqual(config.data.source, fixed.data.source)  # The default corpus.
    self.assertEqual(config.model.attention_impl, "auto")  # The flash kernel on the device.
    with self.assertRaisesRegex(ValueError, "gpu_pilot sets its own size"):
      benice_configs.get_config("gpu_pilot,smoke")

  def test_dry_run_is_the_hand_count(self):
    params, step_flops = _hand_counts()
    _, m, table = self._dry_run()
    self.assertEqual(m["num_params"], params)
    self.assertEqual(m["step_flops"], step_flops)
    self.assertEqual(m["params_bytes"], 4 * params)  # float32, one device.
    self.assertEqual(m["opt_state_bytes"], 2 * 4 * params + 2 * 4)  # mu, nu; two int32 counts.
    self.assertEqual(m["rows_per_device"], BATCH)
    self.assertGreater(m["activation_bytes"], 0)
    self.assertIn(f"| params | {4 * params:,} |", table)
    self.assertIn(f"Model FLOPs per optimizer step ({BATCH} x {T} tokens", table)
    self.assertIn(f"{step_flops:.4g}", table)

  def test_dry_run_counts_the_memory_levers(self):
    # bf16 moments halve the optimizer state; a chunked loss drops the float32 logits'
    # residual (tests/train_levers_test.py checks that none of [tokens, vocab] is kept).
    params, _ = _hand_counts()
    _, base, _ = self._dry_run()
    levers = {"train.opt_state_dtype": "bfloat16", "train.loss_vocab_chunk": 64}
    _, m, _ = self._dry_run(**levers)
    self.assertEqual(m["opt_state_bytes"], 2 * 2 * params + 2 * 4)
    self.assertLess(m["activation_bytes"], base["activation_bytes"])


if __name__ == "__main__":
  absltest.main()
