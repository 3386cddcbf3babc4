"""Test-time depth in the model's decode path (docs/design.md §3, "Depth at test time"): at full
depth it is the scan's decode; a token that exits after k recurrences computes and caches what
the same model looping k times does (shared: its recurrence-k K/V in its one slot; unshared:
recurrences 1..k, and k's again in the later ones, the 'latest' lookup); every KV policy keeps,
per cached recurrence c, the last one run up to c; a row's tokens, depths and cache do not
depend on the other rows of its call; the unshared lookups read what they say; and
decode_forward carries exits and continuous compute through the evaluation's decode."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.model import adaptive
from looped.model.kv_cache import init_cache
from looped.model.looped_lm import LoopedLM, init_params
from looped.model.sharing import decode_forward

CFG = dataclasses.replace(testing.TINY_MODEL, num_recurrences=4)
B, STEPS = 3, 6


def _setup(cfg=CFG):
  model = LoopedLM(cfg)
  params = init_params(model, jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (B, STEPS), 0, cfg.vocab_size)
  return model, params, tokens


def _leaves(tree):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _assert_trees_close(test, a, b, atol=2e-5):
  for x, y in zip(_leaves(a), _leaves(b), strict=True):
    np.testing.assert_allclose(x, y, atol=atol, rtol=0)


def _row_cache(cache, b: int, k: int):
  """Row b of a cache as a model with R = k reads it (unshared: its first k copies)."""
  one = lambda e, lead: jax.tree.map(lambda a: a[(slice(None),) * lead + (slice(b, b + 1),)], e)
  layers = {s: [one(e, 0) for e in cache.layers[s]] for s in ("prelude", "coda")}
  core = [one(e, 0) if cache.share_kv else one(e, 1) for e in cache.layers["core"]]
  if not cache.share_kv:
    core = [jax.tree.map(lambda a: a[:k], e) for e in core]
  return cache.replace(length_B=cache.length_B[b : b + 1], layers={**layers, "core": core})


def _index(tree, index):
  """Every leaf of tree indexed by `index`."""
  return jax.tree.map(lambda a: a[index], tree)


def _batch_row(tree, b: int):
  """Row b of per-token entries ([..., B, S, K, H])."""
  return jax.tree.map(lambda a: a[..., b : b + 1, :, :, :], tree)


def _row(tree, b: int, lead: int = 0):
  """Row b of a cache's per-token entries ([lead axes..., B, ...])."""
  return jax.tree.map(lambda x: x[(slice(None),) * lead + (slice(b, b + 1),)], tree)


# A criterion and threshold that exit the tiny random model at several depths.
EXITS = dict(criterion="entropy-diff", threshold=0.01)


class FullDepthTest(parameterized.TestCase):
  @parameterized.parameters((True, None), (False, None), (True, "fp8"), (True, "stride2"))
  def test_full_depth_is_the_scan(self, share_kv, option):
    """recurrences = R, no criterion: the scan's logits and cache, prefill then decode."""
    model, params, tokens = _setup()
    kw = {"kv_policy": option} if option == "stride2" else {"kv_format": option}
    cache = init_cache(CFG, B, STEPS, share_kv, **kw)
    full = adaptive.depth_inputs(B, CFG.d_model, CFG.num_recurrences)
    plain, adapt = cache, cache
    for chunk in (tokens[:, :3], tokens[:, 3:4], tokens[:, 4:]):
      want, aux = model.apply(params, chunk, cache=plain)
      got, aux_d = model.apply(params, chunk, cache=adapt, depth=full)
      plain, adapt = aux["cache"], aux_d["cache"]
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
      _assert_trees_close(self, adapt.layers, plain.layers)
      self.assertEqual(aux_d["depth_B"].tolist(), [CFG.num_recurrences] * B)


class ExitSemanticsTest(parameterized.TestCase):
  @parameterized.parameters(True, False)
  def test_an_exit_is_the_model_looping_that_many_times(self, share_kv):
    """Each step: rows exit at their own depths k; each row alone through the scan of a model
    with R = k from the same cache gives its logits and its cache entries (unshared: copies
    1..k; copies after k hold copy k)."""
    model, params, tokens = _setup()
    cache = init_cache(CFG, B, STEPS, share_kv)
    depth = adaptive.depth_inputs(B, CFG.d_model, CFG.num_recurrences, **EXITS)
    seen = set()
    for t in range(STEPS):
      x = tokens[:, t : t + 1]
      logits, aux = model.apply(params, x, cache=cache, depth=depth)
      depth_B = aux["depth_B"].tolist()
      seen.update(depth_B)
      for b, k in enumerate(depth_B):
        short = LoopedLM(dataclasses.replace(CFG, num_recurrences=k))
        row = _row_cache(cache, b, k)
        want, want_aux = short.apply(params, x[b : b + 1], cache=row)
        np.testing.assert_allclose(logits[b : b + 1], want, atol=2e-5, rtol=0)
        got = aux["cache"]
        for stage in ("prelude", "coda"):
          _assert_trees_close(self, _row(got.layers[stage], b), want_aux["cache"].layers[stage])
        got_core = _batch_row(got.layers["core"], b)
        want_core = want_aux["cache"].layers["core"]
        if share_kv:
          _assert_trees_close(self, got_core, want_core)
        else:
          _assert_trees_close(self, _index(got_core, slice(0, k)), want_core)
          # The new token's slot in the copies after k holds its copy k ('latest' reads it).
          after = _index(got_core, (slice(k, None), 0, t))
          copy_k = _index(got_core, (slice(k - 1, k), 0, t))
          fill = jax.tree.map(lambda c, a: np.broadcast_to(c, a.shape), copy_k, after)
          _assert_trees_close(self, after, fill)
      cache = aux["cache"]
    self.assertGreater(len(seen), 1)  # Several depths: the test saw exits.

  def test_a_policy_keeps_the_last_recurrence_up_to_each_cached_one(self):
    """stride2 at R = 4 caches recurrences 2 and 4: a row that stopped after k holds its
    recurrence-min(c, k) K/V in copy c: copy 4 is the cache of a call running exactly k, copy
    2 that of a call running min(2, k)."""
    model, params, tokens = _setup()
    cache = init_cache(CFG, B, STEPS, True, kv_policy="stride2")
    depth = adaptive.depth_inputs(B, CFG.d_model, CFG.num_recurrences, **EXITS)
    seen = set()
    for t in range(STEPS):
      x = tokens[:, t : t + 1]
      _, aux = model.apply(params, x, cache=cache, depth=depth)
      k_B = aux["depth_B"]
      seen.update(k_B.tolist())
      for copy, ran_B in ((1, k_B), (0, jnp.minimum(k_B, 2))):
        fixed = adaptive.depth_inputs(B, CFG.d_model, 0).replace(recurrences_B=ran_B)
        _, want = model.apply(params, x, cache=cache, depth=fixed)
        got_core = _index(aux["cache"].layers["core"], copy)
        _assert_trees_close(self, got_core, _index(want["cache"].layers["core"], copy))
      cache = aux["cache"]
    self.assertGreater(len(seen), 1)


class BatchIndependenceTest(parameterized.TestCase):
  @parameterized.parameters(True, False)
  def test_a_row_is_what_it_is_alone(self, share_kv):
    """Rows with different recurrences, criteria, thresholds, check rules and initial scales
    in one call: each row's logits, depths and cache equal the row run alone."""
    model, params, tokens = _setup()
    rows = [
      dict(recurrences=2),
      dict(recurrences=4, criterion="entropy-diff", threshold=0.05, min_recurrences=2),
      dict(recurrences=3, criterion="latent-diff", threshold=0.9, check_every=2, init_scale=0.0),
    ]
    one = [adaptive.depth_inputs(1, CFG.d_model, **r) for r in rows]
    both = jax.tree.map(lambda *x: jnp.concatenate(x), *one)
    cache = init_cache(CFG, B, STEPS, share_kv)
    alone = [init_cache(CFG, 1, STEPS, share_kv) for _ in rows]
    step = jax.jit(lambda p, x, c, d: model.apply(p, x, cache=c, depth=d))
    for t in range(STEPS):
      logits, aux = step(params, tokens[:, t : t + 1], cache, both)
      for b in range(B):
        want, want_aux = step(params, tokens[b : b + 1, t : t + 1], alone[b], one[b])
        np.testing.assert_allclose(logits[b : b + 1], want, atol=2e-5, rtol=0)
        self.assertEqual(int(aux["depth_B"][b]), int(want_aux["depth_B"][0]))
        lead = 0 if share_kv else 1
        got_core = [_row(e, b, lead) for e in aux["cache"].layers["core"]]
        _assert_trees_close(self, got_core, want_aux["cache"].layers["core"])
        alone[b] = want_aux["cache"]
      cache = aux["cache"]


class LookupTest(absltest.TestCase):
  def test_lookups_read_what_they_say(self):
    """Unshared, after tokens exited at different depths: 'latest' reads recurrence
    min(r, k); 'always-last' where a slot lacks r reads every slot's last copy (the call equals
    'latest' on a cache whose copies are all the last one); 'skip' hides the slots that did not
    run r (it equals 'latest' where every slot ran every recurrence)."""
    model, params, tokens = _setup()
    cache = init_cache(CFG, B, STEPS, False, depths=True)
    depth = adaptive.depth_inputs(B, CFG.d_model, CFG.num_recurrences, **EXITS)
    for t in range(STEPS - 1):
      _, aux = model.apply(params, tokens[:, t : t + 1], cache=cache, depth=depth)
      cache = aux["cache"]
    ran = np.asarray(cache.depth_BxS[:, : STEPS - 1])
    self.assertTrue((ran < CFG.num_recurrences).any(axis=1).all())  # Every row has a hole.
    x = tokens[:, -1:]
    full = adaptive.depth_inputs(B, CFG.d_model, CFG.num_recurrences)
    call = lambda c, lookup: model.apply(params, x, cache=c, depth=full, exit_lookup=lookup)[0]
    # Recurrence r of a row where some slot stopped before r reads every slot's last copy.
    fewest_B = ran.min(axis=1)
    hole_RxB = np.arange(1, CFG.num_recurrences + 1)[:, None] > fewest_B[None, :]

    def read_last(a):
      mask = jnp.asarray(hole_RxB).reshape(hole_RxB.shape + (1,) * (a.ndim - 2))
      return jnp.where(mask, a[-1:], a)

    last = cache.replace(
      layers={**cache.layers, "core": [jax.tree.map(read_last, e) for e in cache.layers["core"]]}
    )
    np.testing.assert_allclose(call(cache, "always-last"), call(last, "latest"), atol=2e-5)
    self.assertGreater(
      float(jnp.abs(call(cache, "always-last") - call(cache, "latest")).max()), 1e-4
    )
    all_ran = cache.replace(depth_BxS=jnp.full_like(cache.depth_BxS, CFG.num_recurrences))
    np.testing.assert_allclose(call(all_ran, "skip"), call(cache, "latest"), atol=2e-5)
    self.assertGreater(float(jnp.abs(call(cache, "skip") - call(cache, "latest")).max()), 1e-4)


class DecodeForwardTest(absltest.TestCase):
  def test_decode_forward_with_exits_is_the_step_by_step_decode(self):
    """decode_forward(depth=...) token by token: the logits and depths of one decode call per
    token with the same settings, continuous compute carried from call to call."""
    model, params, tokens = _setup()
    settings = adaptive.DepthSettings(
      recurrences=4, exit_criterion="entropy-diff", exit_threshold=0.01, continuous_compute=True
    )
    for share_kv in (True, False):
      logits, cache = decode_forward(model, params, tokens, share_kv=share_kv, depth=settings)
      step_cache = init_cache(CFG, B, STEPS, share_kv)
      state = None
      for t in range(STEPS):
        inputs = settings.inputs(B, CFG.d_model, 4, prompt=False, state_BxD=state)
        if t == 0:
          inputs = inputs.replace(warm_B=jnp.zeros((B,), bool))
        want, aux = model.apply(params, tokens[:, t : t + 1], cache=step_cache, depth=inputs)
        step_cache, state = aux["cache"], aux["state_BxD"]
        np.testing.assert_allclose(logits[:, t : t + 1], want, atol=2e-5, rtol=0)
        self.assertEqual(cache.depth_BxS[:, t].tolist(), aux["depth_B"].tolist())


if __name__ == "__main__":
  absltest.main()
