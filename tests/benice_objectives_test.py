"""BeNice! objective against independent references: finetuning, a two-copy gradient, hand math."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped.benice import objectives
from looped.model import LoopedLM, init_params
from looped.train import objectives as train_objectives

TINY = testing.TINY_MODEL
R = TINY.num_recurrences


def _depth(sampler="fixed"):
  return ml_collections.ConfigDict(
    {"sampler": sampler, "poisson_mean": 2.0, "survival": 0.7, "backprop_recurrences": 0}
  )


def _benice_cfg(**overrides):
  c = {
    "read_recurrences": "all",
    "shared_ce_weight": 1.0,
    "unshared_ce_weight": 1.0,
    "kl_weight": 0.0,
    "kl_pass": "shared",
    "residual_weight": 0.0,
    "kv_passes": 0,
  }
  c.update(overrides)
  return ml_collections.ConfigDict(c)


@functools.cache
def _setup(seed=0, batch=2, length=9, cfg=TINY):
  model = LoopedLM(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, length + 1), 0, 61)
  params = init_params(model, jax.random.PRNGKey(seed), tokens[:, :-1])
  return model, params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _ce(logits, batch):
  return jnp.mean(train_objectives.token_cross_entropy(logits, batch["targets"]))


class FinetuneEquivalenceTest(absltest.TestCase):
  def test_sharing_off_is_standard_finetuning(self):
    # Stochastic depth: the depth mask and the state noise must be drawn alike too.
    depth = _depth("bernoulli")
    model, params, batch = _setup()
    key = jax.random.PRNGKey(7)
    loss = lambda obj: jax.jit(obj.loss_fn)(params, None, batch, key)
    loss_ft, _ = loss(train_objectives.language_modeling(model, depth))
    # Extra weights at 0 and no recurrence reading the broadcast K/V: the same computation.
    cfg = _benice_cfg(shared_ce_weight=0.0, read_recurrences="none")
    loss_bn, metrics = loss(objectives.benice(model, depth, cfg))
    np.testing.assert_array_equal(loss_bn, loss_ft)  # Same ops on the same draws: bitwise.
    self.assertNotIn("ce_shared", metrics)  # No shared pass was run.
    # The shared pass with sharing off is the unshared forward: only its CE weighted, the loss
    # is still the finetuning loss (the attention is split into past + diagonal, hence ~).
    cfg = _benice_cfg(read_recurrences="none", unshared_ce_weight=0.0)
    loss_off, metrics = loss(objectives.benice(model, depth, cfg))
    np.testing.assert_allclose(loss_off, loss_ft, rtol=1e-5)
    np.testing.assert_allclose(metrics["ce_shared"], metrics["ce_unshared"], rtol=1e-5)


class StopGradientTest(absltest.TestCase):
  def test_gradient_does_not_flow_into_broadcast_pass(self):
    """Reference: pass 1 (and the residual target) computed from a separate params copy p1;
    BeNice!'s gradient must be d/dp2 alone, and d/dp1 must be nonzero (else the test is void).
    kv_passes = 0 (the default) exercises the stop-gradient on the unshared pass's K/V alone;
    one extra Jacobi pass exercises it together with the pass loop's.
    """
    for kv_passes in (0, 1):
      with self.subTest(kv_passes=kv_passes):
        self._check_two_copy_gradient(kv_passes)

  def test_only_unshared_ce_gives_the_finetuning_gradient(self):
    # The gradient, not only the loss: a stop-gradient on the unshared logits keeps the loss
    # and zeroes the gradient.
    depth = _depth("bernoulli")
    model, params, batch = _setup()
    key = jax.random.PRNGKey(3)
    grad = lambda obj: jax.jit(jax.grad(lambda p: obj.loss_fn(p, None, batch, key)[0]))(params)
    cfg = _benice_cfg(shared_ce_weight=0.0, read_recurrences="all")
    g_bn = grad(objectives.benice(model, depth, cfg))
    g_ft = grad(train_objectives.language_modeling(model, depth))
    chex.assert_trees_all_close(g_bn, g_ft, atol=1e-7, rtol=1e-6)
    self.assertGreater(float(optax_norm(g_ft)), 1e-3)

  def _check_two_copy_gradient(self, kv_passes):
    read = "all"
    # Zero initial state: no state noise, so the reference needs no RNG. One core layer and no
    # prelude/coda: the gradient paths under test are all in the core; compiles faster.
    cfg = dataclasses.replace(
      TINY, state_init="zeros", num_prelude_layers=0, num_core_layers=1, num_coda_layers=0
    )
    model, params, batch = _setup(cfg=cfg)
    read_R = objectives.read_mask_R(read, R)
    tokens = batch["inputs"]

    def two_copy_loss(p2, p1):
      logits_u1, aux_u1 = model.apply(p1, tokens, collect_states=True)
      kv = aux_u1["final_kv"]
      for _ in range(kv_passes):
        kv = model.apply(p1, tokens, shared_kv=kv, read_shared_R=read_R)[1]["final_kv"]
      logits_s, aux_s = model.apply(
        p2, tokens, shared_kv=kv, read_shared_R=read_R, collect_states=True
      )
      h_s, h_u = aux_s["states_RxBxTxD"], aux_u1["states_RxBxTxD"]
      residual = jnp.mean(
        jnp.sum((h_s - h_u) ** 2, axis=(1, 2, 3)) / jnp.sum(h_u**2, axis=(1, 2, 3))
      )
      return _ce(logits_s, batch) + 0.5 * residual

    cfg = _benice_cfg(
      read_recurrences=read, unshared_ce_weight=0.0, residual_weight=0.5, kv_passes=kv_passes
    )
    loss_fn = objectives.benice(model, _depth(), cfg).loss_fn
    key = jax.random.PRNGKey(0)
    (loss, _), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params, None, batch, key)
    ref_loss, (grads_p2, grads_p1) = jax.jit(jax.value_and_grad(two_copy_loss, argnums=(0, 1)))(
      params, params
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, grads_p2, atol=1e-6, rtol=1e-5)
    self.assertGreater(float(optax_norm(grads_p1)), 1e-3)


def optax_norm(tree):
  return jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(tree)))


class ReadModeTest(absltest.TestCase):
  """Broadcast the K/V of recurrence 1 (the final K/V of a depth-1 run): a recurrence that reads
  it sees what an unshared recurrence 1 saw, so recurrence 1 reading it is a no-op while any
  later recurrence reading it changes that recurrence's state."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    model, cls.params, batch = _setup()
    cls.tokens = batch["inputs"]
    b = cls.tokens.shape[0]

    @jax.jit
    def plain(params, tokens, depth_mask_BxR):
      _, aux = model.apply(params, tokens, depth_mask_BxR=depth_mask_BxR, collect_states=True)
      return aux["states_RxBxTxD"], aux["final_kv"]

    @jax.jit
    def shared(params, tokens, kv, read_R):
      _, aux = model.apply(params, tokens, shared_kv=kv, read_shared_R=read_R, collect_states=True)
      return aux["states_RxBxTxD"]

    cls.shared = staticmethod(shared)
    cls.unshared, cls.final_kv = plain(cls.params, cls.tokens, jnp.ones((b, R), bool))
    depth_1 = jnp.zeros((b, R), bool).at[:, 0].set(True)
    cls.kv_r1 = plain(cls.params, cls.tokens, depth_1)[1]

  def _states(self, read, kv):
    return self.shared(self.params, self.tokens, kv, objectives.read_mask_R(read, R))

  def test_masks(self):
    np.testing.assert_array_equal(objectives.read_mask_R("first", 3), [True, False, False])
    np.testing.assert_array_equal(objectives.read_mask_R("all", 3), [True, True, True])
    np.testing.assert_array_equal(objectives.read_mask_R("none", 3), [False, False, False])

  def test_first_reads_only_recurrence_one(self):
    # Only r = 1 reads, and it reads its own K/V: every state equals the unshared one.
    np.testing.assert_allclose(self._states("first", self.kv_r1), self.unshared, atol=2e-5)
    # It does read: the final recurrence's K/V change h_1 (tokens t >= 1 have a past).
    h = self._states("first", self.final_kv)
    self.assertGreater(float(jnp.abs(h[0, :, 1:] - self.unshared[0, :, 1:]).max()), 1e-3)

  def test_all_reads_every_recurrence(self):
    h = self._states("all", self.kv_r1)
    np.testing.assert_allclose(h[0], self.unshared[0], atol=2e-5)
    for r in range(1, R):
      self.assertGreater(float(jnp.abs(h[r, :, 1:] - self.unshared[r, :, 1:]).max()), 1e-3)
      np.testing.assert_allclose(h[r, :, 0], self.unshared[r, :, 0], atol=2e-5)  # No past.


class LossTermTest(absltest.TestCase):
  def test_kl_matches_numpy(self):
    p = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5))
    q = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 5))
    pn, qn = np.asarray(p, np.float64), np.asarray(q, np.float64)
    soft = lambda x: (
      np.exp(x - x.max(-1, keepdims=True))
      / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
    )
    expected = np.mean(np.sum(soft(pn) * (np.log(soft(pn)) - np.log(soft(qn))), -1))
    np.testing.assert_allclose(objectives.kl_divergence(p, q), expected, rtol=1e-5)
    self.assertEqual(float(objectives.kl_divergence(p, p)), 0.0)

  def test_residual_matching_is_relative_per_recurrence(self):
    target = jnp.ones((2, 1, 2, 4)).at[1].set(10.0)
    # Recurrence 1 off by 10% of its norm, recurrence 2 by 20%: (0.01 + 0.04) / 2.
    shared = target * jnp.array([1.1, 1.2])[:, None, None, None]
    np.testing.assert_allclose(objectives.residual_matching(shared, target), 0.025, rtol=1e-5)

  def test_kl_term_uses_frozen_params(self):
    model, params, batch = _setup()
    key = jax.random.PRNGKey(0)
    cfg = _benice_cfg(kl_weight=2.0, kl_pass="both", shared_ce_weight=0.0)
    objective = objectives.benice(model, _depth(), cfg, frozen_params=params)
    self.assertIs(objective.frozen, params)
    loss_fn = jax.jit(objective.loss_fn)
    _, metrics = loss_fn(params, params, batch, key)
    self.assertLess(float(metrics["kl_unshared"]), 1e-6)  # Student == teacher unshared.
    # Sharing moves this model's distribution, so the shared KL is the one that works.
    self.assertGreater(float(metrics["kl_shared"]), 1e-3)
    _, other = loss_fn(params, _setup(seed=5)[1], batch, key)
    self.assertGreater(float(other["kl_unshared"]), 1e-3)
    expected = metrics["ce_unshared"] + 2.0 * (metrics["kl_shared"] + metrics["kl_unshared"])
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-6)


class RecipeKnobTest(absltest.TestCase):
  """distill_weight, shared_ramp_steps and kv_passes_ramp_steps against hand-built references."""

  def test_distillation_teacher_carries_no_gradient(self):
    # Reference: the teacher (unshared pass) and the broadcast K/V from a second params copy p1;
    # the gradient must be d/dp2 of KL(p_u(p1) || p_s(p2)) alone.
    cfg = dataclasses.replace(
      TINY, state_init="zeros", num_prelude_layers=0, num_core_layers=1, num_coda_layers=0
    )
    model, params, batch = _setup(cfg=cfg)
    tokens, read_R = batch["inputs"], objectives.read_mask_R("all", R)

    def two_copy_loss(p2, p1):
      logits_u, aux_u = model.apply(p1, tokens)
      logits_s, _ = model.apply(p2, tokens, shared_kv=aux_u["final_kv"], read_shared_R=read_R)
      return 1.5 * objectives.kl_divergence(logits_u, logits_s)

    bcfg = _benice_cfg(shared_ce_weight=0.0, unshared_ce_weight=0.0, distill_weight=1.5)
    loss_fn = objectives.benice(model, _depth(), bcfg).loss_fn
    key = jax.random.PRNGKey(0)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
      params, None, batch, key
    )
    ref_loss, (grads_p2, grads_p1) = jax.jit(jax.value_and_grad(two_copy_loss, argnums=(0, 1)))(
      params, params
    )
    self.assertGreater(float(ref_loss), 1e-4)  # Sharing changes this model's predictions.
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["distill"], ref_loss / 1.5, rtol=1e-5)
    chex.assert_trees_all_close(grads, grads_p2, atol=1e-7, rtol=1e-5)
    self.assertGreater(float(optax_norm(grads_p1)), 1e-4)  # The teacher path is not void.

  def test_shared_ramp_scales_the_shared_terms(self):
    model, params, batch = _setup()
    key = jax.random.PRNGKey(2)
    bcfg = _benice_cfg(shared_ramp_steps=10, distill_weight=0.5)
    loss_fn = jax.jit(objectives.benice(model, _depth(), bcfg).loss_fn)
    _, m = loss_fn(params, None, batch, key, None)  # Outside training: full weights.
    ce_u, ce_s, distill = m["ce_unshared"], m["ce_shared"], m["distill"]
    np.testing.assert_allclose(m["loss"], ce_u + ce_s + 0.5 * distill, rtol=1e-6)
    for step, scale in ((0, 0.0), (4, 0.4), (10, 1.0), (25, 1.0)):
      loss, m = loss_fn(params, None, batch, key, jnp.int32(step))
      np.testing.assert_allclose(m["shared_scale"], scale, rtol=1e-6)
      np.testing.assert_allclose(loss, ce_u + scale * (ce_s + 0.5 * distill), rtol=1e-6)
    # At step 0 the gradient is standard finetuning's.
    grad = lambda f, *a: jax.jit(jax.grad(lambda p: f(p, None, batch, key, *a)[0]))(params)
    g0 = grad(objectives.benice(model, _depth(), bcfg).loss_fn, jnp.int32(0))
    g_ft = grad(train_objectives.language_modeling(model, _depth()).loss_fn)
    chex.assert_trees_all_close(g0, g_ft, atol=1e-7, rtol=1e-6)

  def test_kv_passes_curriculum(self):
    # kv_passes 3 over 8 steps: floor(4 * step / 8), at most 3 (derived by hand).
    expected = [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    got = [int(objectives.kv_passes_at(jnp.int32(s), 3, 8)) for s in range(10)]
    self.assertEqual(got, expected)
    self.assertEqual(objectives.kv_passes_at(None, 3, 8), 3)
    self.assertEqual(objectives.kv_passes_at(jnp.int32(0), 3, 0), 3)
    # The traced pass count gives the loss of the static one.
    model, params, batch = _setup()
    key = jax.random.PRNGKey(4)
    ramped = jax.jit(
      objectives.benice(model, _depth(), _benice_cfg(kv_passes=3, kv_passes_ramp_steps=8)).loss_fn
    )
    for step, n in ((1, 0), (3, 1), (7, 3)):
      static = objectives.benice(model, _depth(), _benice_cfg(kv_passes=n)).loss_fn
      want = jax.jit(static)(params, None, batch, key)[1]["ce_shared"]
      got = ramped(params, None, batch, key, jnp.int32(step))[1]
      np.testing.assert_allclose(got["ce_shared"], want, rtol=1e-6)
      self.assertEqual(float(got["kv_passes"]), n)
    ce = [float(ramped(params, None, batch, key, jnp.int32(s))[1]["ce_shared"]) for s in (1, 7)]
    self.assertNotAlmostEqual(ce[0], ce[1], places=4)  # The pass count matters here.

  def test_prefill_block_shared_pass(self):
    """prefill_block = C: the shared pass reads as block prefill (reference: the model's own
    block-prefill forward on the unshared pass's K/V); C >= T is the unshared forward."""
    model, params, batch = _setup()
    key = jax.random.PRNGKey(5)
    t = batch["inputs"].shape[1]
    cfg = lambda **kw: _benice_cfg(**kw)
    run = lambda c: jax.jit(objectives.benice(model, _depth(), c).loss_fn)(
      params, None, batch, key
    )[1]
    token = run(cfg())
    block = run(cfg(prefill_block=4))
    _, aux = model.apply(params, batch["inputs"], rngs={"state": jax.random.split(key)[1]})
    logits, _ = model.apply(
      params,
      batch["inputs"],
      shared_kv=aux["final_kv"],
      prefill_block=4,
      rngs={"state": jax.random.split(key)[1]},
    )
    np.testing.assert_allclose(block["ce_shared"], _ce(logits, batch), rtol=1e-5)
    self.assertGreater(abs(float(block["ce_shared"] - token["ce_shared"])), 1e-4)
    whole = run(cfg(prefill_block=t))
    np.testing.assert_allclose(whole["ce_shared"], whole["ce_unshared"], rtol=1e-5)
    # With kv_passes the broadcast K/V come from block-prefill Jacobi passes: after
    # (number of blocks - 1) = 2 of them (blocks 0-3, 4-7, 8), the trained pass is block
    # prefill exactly, as it is after any further passes.
    two, three = run(cfg(prefill_block=4, kv_passes=2)), run(cfg(prefill_block=4, kv_passes=3))
    np.testing.assert_allclose(two["ce_shared"], three["ce_shared"], rtol=1e-5)
    self.assertGreater(abs(float(two["ce_shared"] - block["ce_shared"])), 1e-5)


if __name__ == "__main__":
  absltest.main()
