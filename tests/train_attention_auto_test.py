"""model.attention_impl='auto' (the default): the flash kernel in the steps users run.

The trainer's jitted training step (LM loss, AdamW, gradients) and its evaluation step are
lowered for CUDA (Pallas Triton) and TPU (Mosaic, device kind mocked as a TPU v5p), as
tests/engine_kernel_test.py lowers the engine's step: with 'auto' they hold the shared-cache
attention's custom calls (forward, and the dq and dK/dV kernels of its VJP, per GQA layer), with
'xla' none, and on this CPU 'auto' is the XLA math. Numerics of the kernel path against the XLA
one are tests/model_attention_impl_test.py's (interpret mode).
"""

import dataclasses
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl.testing import absltest, parameterized
from jax._src.pallas.mosaic import tpu_info

import looped_testing as testing
from looped import model as model_lib
from looped.model import LoopedLM, pallas_attention
from looped.model.looped_lm import causal_mask
from looped.model.mixer_interface import MixerContext
from looped.train import objectives, optim, trainer
from looped.train.state import boxed_init_fn
from pallas_kernels import platform

S = jax.ShapeDtypeStruct
# The kernel's custom call in each target's lowered text.
_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
# Every lever of the MFU work at once (tests/train_levers_test.py checks each one's losses).
LEVERS = {
  "model.dtype": "bfloat16",
  "model.param_dtype": "bfloat16",
  "train.master_weights": True,
  "train.opt_state_dtype": "bfloat16",
  "model.remat": "dots_saveable",
  "train.loss_vocab_chunk": 64,
  "train.grad_accum_steps": 2,
}


def _config(overrides: dict):
  # The core's layers once in the scan body (scan_unroll 1), as the engine's lowering test.
  return testing.smoke_config({"model.scan_unroll": 1, **overrides})


def _mocked(device: str):
  """The platform seen at trace time, and the TPU the Mosaic lowering reads."""
  return (
    mock.patch.object(platform, "platform", lambda: device),
    mock.patch.object(tpu_info, "get_device_kind", lambda: "TPU v5p"),
    mock.patch.object(tpu_info, "get_num_device_cores", lambda: 1),
  )


def _lowered(overrides: dict, target: str, step: str = "train") -> str:
  """The trainer's training step (or evaluation step) on abstract inputs, lowered for
  `target` with the platform mocked to match."""
  config = _config(overrides)
  trainer.validate_training(config)
  model = LoopedLM(model_lib.from_config(config.model))
  objective = objectives.vocab_chunked(
    objectives.language_modeling(model, config.depth), config.train.loss_vocab_chunk
  )
  optimizer = optim.make_optimizer(config.train)
  state = jax.eval_shape(lambda: nn.unbox(boxed_init_fn(config, model, optimizer)()))
  rows = S((config.data.batch_size, config.data.seq_len), jnp.int32)
  batch = {"inputs": rows, "targets": rows, "segment_ids": rows}  # data.document_mask's ids.
  if step == "train":
    schedule = optim.learning_rate_schedule(config.train)
    fn, args = trainer.make_train_step(objective, optimizer, schedule, config.train), (state,)
    args += (None, batch)
  else:
    fn, args = trainer.make_eval_fn(model).__wrapped__, (state.params, batch)
  device = {"cuda": "gpu", "tpu": "tpu"}[target]
  a, b, c = _mocked(device)
  with a, b, c:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(target,)).as_text()


def _gqa_layers(overrides: dict = None) -> tuple[int, int]:
  """(GQA layers in the lowered text: prelude + core once + coda, core layers)."""
  m = _config(overrides or {}).model
  return m.num_prelude_layers + m.num_core_layers + m.num_coda_layers, m.num_core_layers


class AutoSelectionTest(parameterized.TestCase):
  def test_auto_is_the_default_and_the_xla_math_on_cpu(self):
    self.assertEqual(model_lib.ModelConfig().attention_impl, "auto")
    config = _config({})
    model = LoopedLM(model_lib.from_config(config.model))
    tokens = jnp.zeros((2, config.data.seq_len), jnp.int32)
    params = jax.eval_shape(lambda: model_lib.init_params(model, jax.random.PRNGKey(0), tokens))
    jaxpr = str(jax.make_jaxpr(lambda p: model.apply(p, tokens))(params))
    self.assertNotIn("pallas_call", jaxpr)
    with _mocked("gpu")[0]:  # The same forward traced as on a GPU.
      jaxpr = str(jax.make_jaxpr(lambda p: model.apply(p, tokens))(params))
    self.assertEqual(jaxpr.count("pallas_call"), _gqa_layers()[0])  # One per layer in the text.

  def test_where_auto_takes_the_kernel(self):
    t = 32
    causal = MixerContext(causal_mask(t, 1))
    shared = MixerContext(causal_mask(t, 1), lambda own: own, causal_mask(t, 1))
    quantized_block = dataclasses.replace(shared, read_past=lambda kv: kv, prefill_block=4)
    cache = (jnp.zeros((1, t, 1, 32)), jnp.zeros((1, t, 1, 32)))  # A dense cache's K/V.
    decode = MixerContext(causal_mask(1, 1), cache, jnp.ones((1, 1, t), bool))
    uses = pallas_attention.uses_kernel
    for ctx in (causal, shared, quantized_block, decode):
      self.assertFalse(uses("auto", ctx, 32, t))  # CPU here.
      self.assertFalse(uses("xla", ctx, 32, t))
    for device in ("gpu", "tpu"):
      with _mocked(device)[0]:
        self.assertTrue(uses("auto", causal, 128, t))
        self.assertTrue(uses("auto", shared, 128, t))
        self.assertFalse(uses("auto", decode, 128, t))  # Dense-cache decode keeps XLA.
        self.assertFalse(uses("auto", quantized_block, 128, t))  # Needs 'xla' (attend).
        # Triton's tiles: head_dim a power of two >= 16, blocks of >= 16 rows (T > 8).
        for head_dim, length in ((96, t), (8, t), (128, 8)):
          self.assertEqual(uses("auto", causal, head_dim, length), device == "tpu")
        mesh = jax.sharding.AbstractMesh((2,), ("data",))
        with jax.sharding.use_abstract_mesh(mesh):  # A pallas_call is not partitioned.
          self.assertFalse(uses("auto", causal, 128, t))
          self.assertTrue(uses("pallas", causal, 128, t))


class TrainingStepLoweringTest(parameterized.TestCase):
  """Per GQA layer in the text (the core's once, in the scan body): the forward kernel and the
  VJP's dq and dK/dV kernels; remat recomputes the core's forward in the backward."""

  @parameterized.parameters("cuda", "tpu")
  def test_training_step_lowers_with_the_kernel(self, target):
    layers, _ = _gqa_layers()
    self.assertEqual(_lowered({}, target).count(_CALL[target]), 3 * layers)

  @parameterized.parameters("cuda", "tpu")
  def test_every_lever_lowers_with_the_kernel(self, target):
    layers, core = _gqa_layers(LEVERS)
    self.assertEqual(_lowered(LEVERS, target).count(_CALL[target]), 3 * layers + core)

  @parameterized.parameters("cuda", "tpu")
  def test_evaluation_step_lowers_with_the_kernel(self, target):
    layers, _ = _gqa_layers()
    self.assertEqual(_lowered({}, target, step="eval").count(_CALL[target]), layers)

  @parameterized.parameters("cuda", "tpu")
  def test_xla_step_has_no_kernel(self, target):
    self.assertEqual(_lowered({"model.attention_impl": "xla"}, target).count(_CALL[target]), 0)


if __name__ == "__main__":
  absltest.main()
