"""The MFU levers change speed and memory, not what is learned.

Each lever is a config field (model.remat, train.loss_vocab_chunk, train.grad_accum_steps,
train.opt_state_dtype, model.param_dtype with train.master_weights). Twenty steps of the
trainer's own jitted step (the optimizer, objective and state the fields build, on the same 20
batches) give the float32 default's loss curve within a stated tolerance:
- remat, the chunked cross-entropy and gradient accumulation compute the same math in another
  order: relative 1e-5 at every step (float32 summation order);
- bfloat16 moments round what Adam stores (8 significant bits) but compute in float32: 1e-4;
- bfloat16 params round every weight to 8 significant bits (2^-9 relative each) and the model
  computes with them: 2%, while the loss itself falls by more than ten times that over the
  run (checked), so a lever that stopped learning would fail.
Each lever's lowering for CUDA and TPU, with the attention kernel, is
tests/train_attention_auto_test.py's.
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped import config_checks, losses, sharding
from looped import model as model_lib
from looped.model import LoopedLM, init_params
from looped.train import objectives, optim, trainer

STEPS = 20
FIXED = type("Depth", (), {"sampler": "fixed", "poisson_mean": 2.0, "survival": 0.7})
FIXED.backprop_recurrences = 0


@functools.cache
def _curve(overrides: tuple) -> np.ndarray:
  """Losses of STEPS steps of the smoke model on 20 fixed batches, built from the config as
  trainer.train builds them. Fixed depth and h_0 = 0: nothing random, so microbatches (which
  draw their own keys) see what one pass sees."""
  fixed = {"depth.sampler": "fixed", "model.state_init": "zeros"}
  config = testing.smoke_config({**fixed, **dict(overrides)})
  trainer.validate_training(config)
  model = LoopedLM(model_lib.from_config(config.model))
  objective = objectives.vocab_chunked(
    objectives.language_modeling(model, config.depth), config.train.loss_vocab_chunk
  )
  optimizer = optim.make_optimizer(config.train)
  schedule = optim.learning_rate_schedule(config.train)
  mesh = sharding.make_mesh(config)
  rules = sharding.rules(config, mesh)
  rng = np.random.default_rng(0)
  shape = (config.data.batch_size, config.data.seq_len + 1)
  losses_ = []
  with sharding.context(mesh, rules):
    state = trainer.init_state(config, model, optimizer, mesh, rules)
    step_fn = trainer.make_train_step(objective, optimizer, schedule, config.train)
    step = trainer.jit_train_step(step_fn, state)
    for _ in range(STEPS):
      tokens = rng.integers(0, 64, shape).astype(np.int32)  # 64 of 257 ids: learnable.
      batch = sharding.global_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
      state, metrics = step(state, None, batch)
      losses_.append(float(metrics["loss"]))
  return np.array(losses_)


class LossCurveTest(parameterized.TestCase):
  def _assert_curve(self, overrides: dict, rtol: float):
    base, got = _curve(()), _curve(tuple(overrides.items()))
    self.assertGreater(base[0] - base[-1], 10 * rtol * base[0])  # It learns, well past rtol.
    np.testing.assert_allclose(got, base, rtol=rtol, atol=0)

  @parameterized.parameters("full", "dots_saveable", "dots_with_no_batch_dims_saveable")
  def test_remat_policy(self, policy):
    self._assert_curve({"model.remat": policy}, 1e-5)

  def test_chunked_cross_entropy(self):
    # 257 ids in chunks of 64: four whole chunks and one padded.
    self._assert_curve({"train.loss_vocab_chunk": 64}, 1e-5)

  def test_gradient_accumulation(self):
    self._assert_curve({"train.grad_accum_steps": 2}, 1e-5)

  def test_bfloat16_moments(self):
    self._assert_curve({"train.opt_state_dtype": "bfloat16"}, 1e-4)

  def test_bfloat16_params_with_a_float32_master_copy(self):
    self._assert_curve({"model.param_dtype": "bfloat16", "train.master_weights": True}, 2e-2)


class OptimizerLeverTest(absltest.TestCase):
  def test_master_copy_keeps_updates_below_half_a_bfloat16_ulp(self):
    # Constant gradient 1, SGD lr 1e-4: a step moves 1.0 by less than half the bf16 spacing
    # below it (2^-9), so bf16 params alone never move; the master copy moves by 1e-4 a step
    # and the params are its rounding.
    params = {"w": jnp.ones((3,), jnp.bfloat16)}
    grads = {"w": jnp.ones((3,), jnp.bfloat16)}
    for master in (False, True):
      opt = optim.float32_master(optax.sgd(1e-4)) if master else optax.sgd(1e-4)
      p, state = params, opt.init(params)
      for _ in range(100):
        updates, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, updates)
      self.assertEqual(p["w"].dtype, jnp.bfloat16)
      want = np.float32(1.0) - 100 * np.float32(1e-4) if master else 1.0
      np.testing.assert_array_equal(p["w"], jnp.full((3,), want, jnp.float32).astype(jnp.bfloat16))
      if master:
        self.assertEqual(state.master["w"].dtype, jnp.float32)
        # 100 float32 additions near 1, each within half an ulp (2^-25): within 3e-6.
        np.testing.assert_allclose(state.master["w"], 1.0 - 100 * 1e-4, atol=3e-6, rtol=0)

  def test_moments_are_stored_in_bfloat16_as_float32_ones_rounded(self):
    params = {"w": jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)}
    grads = {"w": jnp.cos(jnp.arange(8.0)).reshape(2, 4)}
    exact = optax.adam(1e-3)
    stored = optim.stored_in(jnp.bfloat16, optax.adam(1e-3))
    _, exact_state = exact.update(grads, exact.init(params), params)
    _, stored_state = stored.update(grads, stored.init(params), params)
    leaves = jax.tree.leaves(stored_state)
    self.assertEqual({x.dtype for x in leaves}, {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int32)})
    rounded = jax.tree.map(
      lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, exact_state
    )
    chex.assert_trees_all_equal(stored_state, rounded)

  def test_master_weights_need_bfloat16_params(self):
    config = testing.smoke_config({"train.master_weights": True})
    with self.assertRaisesRegex(
      config_checks.ConfigError, r"config.train.master_weights = True is invalid: needs model"
    ):
      trainer.validate_training(config)


class ChunkedCrossEntropyTest(parameterized.TestCase):
  @parameterized.parameters(True, False)  # The tied embedding's transpose, or a head matrix.
  def test_loss_and_gradients_are_the_full_logits_ones(self, tie):
    cfg = dataclasses.replace(testing.TINY_MODEL, tie_embeddings=tie)
    model = LoopedLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, 13), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = init_params(model, jax.random.PRNGKey(0), batch["inputs"])
    grad = lambda c: jax.value_and_grad(
      objectives.language_modeling(model, FIXED, c).loss_fn, has_aux=True
    )
    # 61 ids: chunks of 16, the last padded.
    results = [jax.jit(grad(c))(params, None, batch, jax.random.PRNGKey(1)) for c in (0, 16)]
    (loss, metrics), grads = results[0]
    (loss_c, metrics_c), grads_c = results[1]
    np.testing.assert_allclose(loss_c, loss, rtol=1e-6)
    chex.assert_trees_all_close(metrics_c, metrics, rtol=1e-6)
    chex.assert_trees_all_close(grads_c, grads, rtol=1e-5, atol=1e-7)
    self.assertGreater(float(jnp.abs(grads["params"]["embed"]["embedding"]).max()), 1e-3)

  def test_no_residual_holds_every_logit(self):
    """The backward keeps no [tokens, vocab] array (nor the head's zeros): a chunk's logits are
    recomputed. The full-logits loss keeps one, so the check sees them. (The head matrix,
    d_model x vocab, is a params-sized residual: tokens > d_model here.)"""
    from jax._src.ad_checkpoint import saved_residuals

    cfg = dataclasses.replace(testing.TINY_MODEL, vocab_size=512)
    model = LoopedLM(cfg)
    tokens = jnp.zeros((4, 16), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    params = jax.eval_shape(lambda: init_params(model, jax.random.PRNGKey(0), tokens))
    logits = tokens.size * cfg.vocab_size
    self.assertGreater(tokens.size, cfg.d_model)

    def largest(chunk):
      loss_fn = objectives.language_modeling(model, FIXED, chunk).loss_fn
      loss = lambda p: loss_fn(p, None, batch, jax.random.PRNGKey(1))[0]
      return max(int(np.prod(aval.shape)) for aval, _ in saved_residuals(loss, params))

    self.assertGreaterEqual(largest(0), logits)
    self.assertLess(largest(64), logits)

  def test_an_objective_without_a_chunked_form_is_kept(self):
    objective = objectives.Objective(lambda *a: (0.0, {}))
    self.assertIs(objectives.vocab_chunked(objective, 0), objective)
    with self.assertLogs(level="WARNING") as logs:
      self.assertIs(objectives.vocab_chunked(objective, 64), objective)
    self.assertIn("train.loss_vocab_chunk = 64 unused", "\n".join(logs.output))

  def test_matches_softmax_cross_entropy_directly(self):
    rng = np.random.default_rng(0)
    x_NxD = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    head_DxV = jnp.asarray(rng.standard_normal((8, 37)), jnp.float32)
    targets_N = jnp.asarray(rng.integers(0, 37, 6), jnp.int32)
    want = losses.token_cross_entropy(x_NxD @ head_DxV, targets_N)
    for chunk in (1, 5, 37, 64):
      got = losses.chunked_cross_entropy(x_NxD, head_DxV, targets_N, chunk)
      np.testing.assert_allclose(got, want, rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
