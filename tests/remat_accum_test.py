"""Memory knobs: per-recurrence remat policies and gradient accumulation change what is
stored or how the batch is walked, never the gradients."""

from __future__ import annotations

import dataclasses
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.model import LoopedLM, init_params
from looped.model.config import REMAT_POLICIES
from looped.train import objectives, trainer
from looped.train.metrics_writer import read_metrics

FIXED = type("Depth", (), {"sampler": "fixed", "poisson_mean": 2.0, "survival": 0.7})
FIXED.backprop_recurrences = 0


def _batch(rows: int = 8, t: int = 12):
  tokens = jax.random.randint(
    jax.random.PRNGKey(3), (rows, t + 1), 0, testing.TINY_MODEL.vocab_size
  )
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _remat_grads(name: str, batch):
  model = LoopedLM(dataclasses.replace(testing.TINY_MODEL, remat=name))
  params = init_params(model, jax.random.PRNGKey(0), batch["inputs"])
  loss_fn = objectives.language_modeling(model, FIXED).loss_fn
  return jax.jit(jax.grad(lambda p: loss_fn(p, None, batch, jax.random.PRNGKey(1))[0]))(params)


class RematTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.batch = _batch()
    cls.reference = _remat_grads("none", cls.batch)  # One no-remat reference for every policy.

  @parameterized.parameters(p for p in REMAT_POLICIES if p != "none")
  def test_policy_gives_the_gradients_of_no_remat(self, policy):
    grads = _remat_grads(policy, self.batch)
    chex.assert_trees_all_close(grads, self.reference, rtol=1e-5, atol=1e-7)
    self.assertGreater(float(jnp.abs(self.reference["params"]["embed"]["embedding"]).max()), 0)


class GradAccumulationTest(testing.TempDirTestCase, parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # h_0 = zeros and fixed depth: nothing random, so the mean over equal microbatches is the
    # one-pass mean exactly (up to float summation order).
    model = LoopedLM(dataclasses.replace(testing.TINY_MODEL, state_init="zeros"))
    cls.batch = _batch()
    cls.params = init_params(model, jax.random.PRNGKey(0), cls.batch["inputs"])
    grad_fn = jax.value_and_grad(objectives.language_modeling(model, FIXED).loss_fn, has_aux=True)
    cls.grad_fn = staticmethod(grad_fn)  # A plain function, not a method of the test.
    cls.key = jax.random.PRNGKey(1)
    # The one-pass reference, computed once for every microbatch count.
    cls.one_pass = jax.jit(grad_fn)(cls.params, None, cls.batch, cls.key)

  @parameterized.parameters(2, 4)
  def test_microbatches_give_the_one_pass_loss_and_gradients(self, steps):
    (loss, metrics), grads = self.one_pass
    accumulated = jax.jit(trainer._accumulated(self.grad_fn, steps))
    (loss_k, metrics_k), grads_k = accumulated(self.params, None, self.batch, self.key)
    np.testing.assert_allclose(loss_k, loss, rtol=1e-6)
    np.testing.assert_allclose(metrics_k["mean_depth"], metrics["mean_depth"])
    chex.assert_trees_all_close(grads_k, grads, rtol=1e-5, atol=1e-6)  # |g| <= 0.2

  def test_trainer_with_accumulation_gives_the_same_losses(self):
    losses = {}
    for steps in (1, 2):
      config = testing.smoke_config(
        {
          "train.num_steps": 3,
          "train.log_every": 1,
          "train.grad_accum_steps": steps,
          "depth.sampler": "fixed",
          "model.state_init": "zeros",
        }
      )
      workdir = os.path.join(self.tmp, f"accum{steps}")
      model = LoopedLM(trainer.model_lib.from_config(config.model))
      trainer.validate(config)
      trainer.train(config, workdir, model, objectives.language_modeling(model, config.depth))
      losses[steps] = [r["loss"] for r in read_metrics(workdir)]
    self.assertLen(losses[1], 3)
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-5)


if __name__ == "__main__":
  absltest.main()
