"""Looped LM against independent references: unrolled loops, exact decode, hand-derived facts."""

import dataclasses
import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.model import LoopedLM, depth, init_cache, init_params
from looped.model.cache_layout import cache_layout
from looped.model.kv_cache import num_cached_values
from looped.model.sharing import decode_forward, jacobi_forward

TINY = testing.TINY_MODEL


def _jacobi(model):
  """One compilation for every pass count (the count is traced)."""
  return jax.jit(lambda params, tokens, n: jacobi_forward(model, params, tokens, n))


def _decode(model, share_kv, prefill=0):
  fn = lambda params, tokens: decode_forward(
    model, params, tokens, share_kv=share_kv, prefill=prefill
  )[0]
  return jax.jit(fn)


def _setup(cfg=TINY, batch=2, length=9, seed=0):
  model = LoopedLM(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(seed + 1), (batch, length), 0, cfg.vocab_size)
  params = init_params(model, jax.random.PRNGKey(seed), tokens)
  return model, params, tokens


class ScanTest(parameterized.TestCase):
  @parameterized.parameters("diagonal", "linear", "additive")
  def test_scan_equals_unrolled_loop(self, injection):
    cfg = dataclasses.replace(TINY, injection=injection)
    scanned, params, tokens = _setup(cfg)
    unrolled = LoopedLM(dataclasses.replace(cfg, scan_recurrences=False))
    # One parameter tree serves both.
    chex.assert_trees_all_equal_shapes(
      params["params"], init_params(unrolled, jax.random.PRNGKey(0), tokens)["params"]
    )
    mask = jnp.array([[1, 0, 1], [1, 1, 0]], bool)
    out_s, aux_s = scanned.apply(params, tokens, depth_mask_BxR=mask)
    out_u, aux_u = unrolled.apply(params, tokens, depth_mask_BxR=mask)
    np.testing.assert_allclose(out_s, out_u, atol=1e-5)
    np.testing.assert_allclose(aux_s["residual_norm_R"], aux_u["residual_norm_R"], rtol=1e-5)

  def test_scan_gradients_equal_unrolled_loop(self):
    scanned, params, tokens = _setup()
    unrolled = LoopedLM(dataclasses.replace(TINY, scan_recurrences=False))
    mask = jnp.array([[1, 0, 1], [1, 1, 0]], bool)
    loss = lambda m: lambda p: jnp.mean(m.apply(p, tokens, depth_mask_BxR=mask)[0] ** 2)
    grads_s = jax.jit(jax.grad(loss(scanned)))(params)
    grads_u = jax.jit(jax.grad(loss(unrolled)))(params)
    chex.assert_trees_all_close(grads_s, grads_u, atol=1e-5)

  def test_init_creates_only_params(self):
    # Any other collection (e.g. the gradient probes) would have to be threaded by every user.
    model = LoopedLM(TINY)
    variables = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
    self.assertEqual(set(variables), {"params"})

  def test_masked_recurrence_keeps_state(self):
    model, params, tokens = _setup()
    mask = jnp.array([[1, 0, 1], [1, 1, 0]], bool)
    _, aux = model.apply(params, tokens, depth_mask_BxR=mask, collect_states=True)
    h = aux["states_RxBxTxD"]
    np.testing.assert_array_equal(h[1, 0], h[0, 0])  # row 0: recurrence 2 skipped
    np.testing.assert_array_equal(h[2, 1], h[1, 1])  # row 1: recurrence 3 skipped
    self.assertGreater(float(jnp.abs(h[2, 0] - h[1, 0]).max()), 1e-3)

  def test_state_after_masked_tail_is_used_by_coda(self):
    model, params, tokens = _setup()
    # A sequence whose last recurrence is masked gives the logits of a depth-2 model.
    two = LoopedLM(dataclasses.replace(TINY, num_recurrences=2))
    full_mask = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
    np.testing.assert_allclose(
      model.apply(params, tokens, depth_mask_BxR=full_mask)[0],
      two.apply(params, tokens)[0],
      atol=1e-5,
    )


class StochasticDepthTest(parameterized.TestCase):
  def test_poisson_matches_clipped_poisson(self):
    n, r, mean = 40000, 5, 2.0
    mask = depth.sample_mask(jax.random.PRNGKey(0), n, r, "poisson", poisson_mean=mean)
    counts = np.bincount(np.asarray(mask.sum(1)), minlength=r + 1)
    pmf = [math.exp(-mean) * mean**k / math.factorial(k) for k in range(r + 1)]
    expected = np.array([0.0, pmf[0] + pmf[1], *pmf[2:r], 1 - sum(pmf[:r])])
    np.testing.assert_allclose(counts / n, expected, atol=4 * np.sqrt(0.25 / n))
    # The first n recurrences are the active ones.
    active = np.asarray(mask)
    np.testing.assert_array_equal(active, np.sort(active, axis=1)[:, ::-1])

  def test_bernoulli_marginals_and_at_least_one(self):
    n, r, p = 40000, 4, 0.3
    mask = np.asarray(depth.sample_mask(jax.random.PRNGKey(1), n, r, "bernoulli", survival=p))
    self.assertTrue(mask.any(axis=1).all())
    expected = p + (1 - p) ** r / r  # Empty rows get one recurrence, uniformly.
    np.testing.assert_allclose(mask.mean(0), expected, atol=4 * np.sqrt(0.25 / n))
    # Independence of two recurrences given non-empty rows is not exact; check the pair
    # probability of the unconstrained draw instead on rows with >= 2 kept.
    both = (mask[:, 0] & mask[:, 1]).mean()
    np.testing.assert_allclose(both, p * p, atol=4 * np.sqrt(0.25 / n))

  def test_fixed_is_all_active(self):
    mask = depth.sample_mask(jax.random.PRNGKey(0), 7, 3, "fixed")
    np.testing.assert_array_equal(mask, np.ones((7, 3), bool))

  @parameterized.parameters(
    # (mask, k, recurrences whose entry state must receive gradient)
    ([1, 1, 1, 1], 2, [2, 3]),
    ([1, 1, 1, 1], 1, [3]),
    ([1, 1, 0, 1], 2, [1, 2, 3]),  # last 2 active: 1 and 3 (2 is a pass-through)
    ([1, 0, 0, 0], 2, [0, 1, 2, 3]),  # fewer active than k: everything
    ([1, 1, 1, 1], 0, [0, 1, 2, 3]),  # k = 0: full backprop
  )
  def test_truncated_backprop(self, mask_row, k, live):
    grads = _entry_state_grads(k)(jnp.array([mask_row], bool))
    per_recurrence = np.abs(np.asarray(grads["recurrence"]["h_in"])).sum(axis=(1, 2, 3))
    for r in range(4):
      if r in live:
        self.assertGreater(per_recurrence[r], 0.0, f"recurrence {r}")
      else:
        self.assertEqual(per_recurrence[r], 0.0, f"recurrence {r}")


@functools.cache
def _entry_state_grads(k: int):
  """mask -> dLoss/dh at each recurrence's entry (zero 'perturbations' probes), jitted once."""
  cfg = dataclasses.replace(TINY, num_recurrences=4)
  model, params, tokens = _setup(cfg, batch=1)
  shape = (cfg.num_recurrences, *tokens.shape, cfg.d_model)
  variables = {"perturbations": {"recurrence": {"h_in": jnp.zeros(shape)}}}

  def loss(perturbations, mask):
    logits, _ = model.apply(
      {"params": params["params"], "perturbations": perturbations},
      tokens,
      depth_mask_BxR=mask,
      backprop_recurrences=k,
    )
    return jnp.sum(logits[..., 0])

  grad = jax.jit(jax.grad(loss))
  return lambda mask: grad(variables["perturbations"], mask)


class CausalityAndDecodeTest(parameterized.TestCase):
  def _perturb_future(self, tokens, t):
    return tokens.at[:, t:].set((tokens[:, t:] + 7) % TINY.vocab_size)

  @parameterized.parameters(0, 1, 3)
  def test_future_tokens_never_change_earlier_logits(self, passes):
    model, params, tokens = _setup()
    changed = self._perturb_future(tokens, 5)
    jacobi = _jacobi(model)
    a, _ = jacobi(params, tokens, passes)
    b, _ = jacobi(params, changed, passes)
    np.testing.assert_array_equal(a[:, :5], b[:, :5])
    self.assertGreater(float(jnp.abs(a[:, 5:] - b[:, 5:]).max()), 1e-4)

  @parameterized.parameters(True, False)
  def test_decode_is_causal(self, share):
    model, params, tokens = _setup()
    decode = _decode(model, share)
    a = decode(params, tokens)
    b = decode(params, self._perturb_future(tokens, 4))
    np.testing.assert_array_equal(a[:, :4], b[:, :4])

  @parameterized.parameters(("like_init", "diagonal"), ("zeros", "linear"), ("embed", "additive"))
  def test_unshared_decode_equals_parallel_forward(self, state_init, injection):
    cfg = dataclasses.replace(TINY, state_init=state_init, injection=injection)
    model, params, tokens = _setup(cfg)
    parallel, _ = model.apply(params, tokens)
    decoded = _decode(model, False)(params, tokens)
    np.testing.assert_allclose(decoded, parallel, atol=2e-5)
    prefilled = _decode(model, False, prefill=4)(params, tokens)
    np.testing.assert_allclose(prefilled, parallel, atol=2e-5)

  def test_shared_decode_equals_jacobi_after_t_passes(self):
    model, params, tokens = _setup()
    t = tokens.shape[1]
    exact = _decode(model, True)(params, tokens)
    jacobi = _jacobi(model)
    errors = []
    for passes in range(t + 1):
      approx, _ = jacobi(params, tokens, passes)
      err_T = np.asarray(jnp.abs(approx - exact).max(axis=(0, 2)))
      errors.append(err_T.max())
      # Pass j is exact for positions <= j (induction on position).
      np.testing.assert_allclose(err_T[: passes + 1], 0.0, atol=2e-5)
    self.assertGreater(errors[0], 1e-3)  # Sharing changes this model's outputs.
    self.assertLess(errors[t], 2e-5)
    # The error shrinks as passes grow (non-increasing, and strictly down overall).
    self.assertTrue(all(b <= a + 2e-5 for a, b in zip(errors, errors[1:])), errors)

  def test_shared_decode_cache_holds_the_converged_final_kv(self):
    model, params, tokens = _setup()
    t = tokens.shape[1]
    _, cache = jax.jit(lambda p, x: decode_forward(model, p, x, share_kv=True))(params, tokens)
    _, aux = _jacobi(model)(params, tokens, t)  # T passes: the exact shared forward.
    self.assertLen(cache.layers["core"], TINY.num_core_layers)
    for (k_cache, v_cache), (k_ref, v_ref) in zip(cache.layers["core"], aux["final_kv"]):
      self.assertEqual(k_cache.shape, k_ref.shape)  # [B, S, K, H]: one recurrence only.
      np.testing.assert_allclose(k_cache, k_ref, atol=2e-5)
      np.testing.assert_allclose(v_cache, v_ref, atol=2e-5)
    # ... and not the unshared forward's final K/V (sharing changed them).
    _, unshared = model.apply(params, tokens)
    self.assertGreater(
      float(jnp.abs(cache.layers["core"][0][0] - unshared["final_kv"][0][0]).max()), 1e-4
    )

  @parameterized.parameters(1, 0)
  def test_prefill_is_exact_unshared_then_shared(self, coda_layers):
    model, params, tokens = _setup(dataclasses.replace(TINY, num_coda_layers=coda_layers))
    p, t = 5, tokens.shape[1]
    parallel, unshared = model.apply(params, tokens)
    out = _decode(model, True, prefill=p)(params, tokens)
    np.testing.assert_allclose(out[:, :p], parallel[:, :p], atol=2e-5)
    self.assertGreater(float(jnp.abs(out[:, p:] - parallel[:, p:]).max()), 1e-4)
    if coda_layers:
      return
    # Reference for the decoded tokens: the parallel shared pass iterated to its fixed point,
    # with the past K/V of the prefix clamped to the prefill's (unshared) final K/V, since that
    # is what a prefilled cache holds; positions >= p read the previous pass's final K/V. (Exact
    # without coda layers only: in this pass the prefix's own states are shared ones, which a
    # coda layer of a later token would read; prelude K/V do not depend on sharing.)
    clamp = lambda new: jax.tree.map(
      lambda u, n: jnp.concatenate([u[:, :p], n[:, p:]], axis=1), unshared["final_kv"], new
    )
    shared_pass = jax.jit(lambda kv: model.apply(params, tokens, shared_kv=kv))
    kv = unshared["final_kv"]
    for _ in range(t - p):
      logits, aux = shared_pass(kv)
      kv = clamp(aux["final_kv"])
    np.testing.assert_allclose(out[:, p:], logits[:, p:], atol=2e-5)

  def test_shared_cache_holds_one_rth_of_core_entries(self):
    cfg = TINY
    shared = init_cache(cfg, 2, 16, share_kv=True)
    unshared = init_cache(cfg, 2, 16, share_kv=False)
    core = lambda c: sum(x.size for x in jax.tree.leaves(c.layers["core"]))
    self.assertEqual(core(unshared), cfg.num_recurrences * core(shared))
    plain = sum(x.size for k in ("prelude", "coda") for x in jax.tree.leaves(shared.layers[k]))
    per_token_slot = 2 * 16 * cfg.head_dim  # batch x max_len slots x head_dim values
    self.assertEqual(
      num_cached_values(shared), cache_layout(cfg, True).vectors_per_token * per_token_slot
    )
    self.assertEqual(
      num_cached_values(unshared), cache_layout(cfg, False).vectors_per_token * per_token_slot
    )
    self.assertEqual(plain, num_cached_values(shared) - core(shared))

  def test_read_shared_first_only_touches_first_recurrence(self):
    model, params, tokens = _setup()
    _, aux = model.apply(params, tokens)
    none_read = jnp.zeros((TINY.num_recurrences,), bool)
    same, _ = model.apply(params, tokens, shared_kv=aux["final_kv"], read_shared_R=none_read)
    np.testing.assert_allclose(same, model.apply(params, tokens)[0], atol=2e-5)
    _, states_un = model.apply(params, tokens, collect_states=True)
    first = jnp.array([True, False, False])
    _, states_first = model.apply(
      params, tokens, shared_kv=aux["final_kv"], read_shared_R=first, collect_states=True
    )
    # Token 0 has no past: identical under any sharing; later tokens differ from r = 1 on.
    h_un, h_first = states_un["states_RxBxTxD"], states_first["states_RxBxTxD"]
    np.testing.assert_allclose(h_first[:, :, 0], h_un[:, :, 0], atol=2e-5)
    self.assertGreater(float(jnp.abs(h_first[0, :, 1:] - h_un[0, :, 1:]).max()), 1e-4)


if __name__ == "__main__":
  absltest.main()
