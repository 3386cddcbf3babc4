"""KV-sharing policies (docs/design.md §3): each policy's map r -> c(r) against a hand-derived
table, exact decode against a plain token-by-token loop that reads c(r)'s K/V of earlier tokens,
the Jacobi passes against exact decode, and the cache's bytes against its count of cached
recurrences.

The reference loop is independent of the model's policy code: it runs the model's own layers
(Block, Injection, RMSNorm, Embed, applied one at a time to their parameter subtrees) one token
and one recurrence at a time, keeps every layer's K/V per (recurrence, token) in a Python dict,
and reads the hand table's c(r) from it.
"""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped import config_checks
from looped.model import init_params, kv_cache, sharing
from looped.model import kv_policy as kv_policy_lib
from looped.model.cache_layout import cache_layout
from looped.model.injection import Injection
from looped.model.layers import RMSNorm
from looped.model.looped_lm import Block, LoopedLM, _out_std
from looped.model.mixer_interface import MixerContext

R = 4
T = 4
CFG = dataclasses.replace(testing.TINY_MODEL, num_recurrences=R, state_init="zeros")

# c(1..4) derived by hand from each form's definition in docs/design.md §3.
READS = {
  "final": (4, 4, 4, 4),
  "first": (1, 1, 1, 1),
  "full": (1, 2, 3, 4),
  "keep_first2": (1, 2, 2, 2),
  "keep_last2": (3, 3, 3, 4),
  "stride2": (2, 2, 4, 4),
  "stride3": (3, 3, 3, 4),
  "boundaries:1-3-4": (1, 3, 3, 4),
  "huginn_mod2": (3, 4, 3, 4),  # Odd recurrences share slot 1 (last writer 3), even slot 2.
  "huginn_anchor2": (1, 2, 4, 4),
}
# Exact decode is compared for these (one compilation each): one cached copy other than the
# final one, several copies read in and out of order, copies read below and above r.
DECODED = ("final", "first", "keep_first2", "stride2", "huginn_mod2")


def reference_logits(cfg, params, tokens_BxT, reads):
  """Exact shared decode by a plain loop: token t's recurrence r attends to its own K/V and to
  recurrence reads[r - 1]'s K/V of tokens s < t, as each of them computed it."""
  p = params["params"]
  b, t_len = tokens_BxT.shape
  embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.compute_dtype)
  norm = lambda name, x: RMSNorm(cfg.weight_dtype).apply({"params": p[name]}, x)
  store = {}  # (stage layer, recurrence) -> list over tokens of (k, v) [B, 1, K, H].

  def layer(name, params_, mixer, x, pos, key):
    past = store.get(key, [])
    ones = lambda *shape: jnp.ones((b, 1, *shape), bool)
    if past:
      kv = tuple(jnp.concatenate([e[i] for e in past], axis=1) for i in (0, 1))
      ctx = MixerContext(ones(1), kv, ones(len(past)))
    else:
      ctx = MixerContext(ones(1))
    x, own = Block(cfg, _out_std(cfg), mixer).apply({"params": params_}, x, pos, ctx)
    return x, own

  logits = []
  for t in range(t_len):
    pos = jnp.full((b, 1), t)
    x = embed.apply({"params": p["embed"]}, tokens_BxT[:, t : t + 1])
    news = {}
    for i, mixer in enumerate(cfg.mixers("prelude")):
      x, news[(f"prelude_{i}", 0)] = layer(
        f"prelude_{i}", p[f"prelude_{i}"], mixer, x, pos, (f"prelude_{i}", 0)
      )
    e = norm("prelude_norm", x)
    h = jnp.zeros_like(e)
    core = p["recurrence"]
    for r in range(1, cfg.num_recurrences + 1):
      x = Injection(cfg).apply({"params": core["inject"]}, h, e)
      for i, mixer in enumerate(cfg.mixers("core")):
        x, news[(f"core_{i}", r)] = layer(
          f"core_{i}", core[f"layer_{i}"], mixer, x, pos, (f"core_{i}", reads[r - 1])
        )
      h = x
    x = h
    for i, mixer in enumerate(cfg.mixers("coda")):
      x, news[(f"coda_{i}", 0)] = layer(
        f"coda_{i}", p[f"coda_{i}"], mixer, x, pos, (f"coda_{i}", 0)
      )
    x = norm("final_norm", x)
    logits.append(embed.apply({"params": p["embed"]}, x, method="attend"))
    for key, kv in news.items():  # Written after the token, as a cache is.
      store.setdefault(key, []).append(kv)
  return np.asarray(jnp.concatenate(logits, axis=1))


class KVPolicyTest(parameterized.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = LoopedLM(CFG)
    cls.tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T), 0, CFG.vocab_size)
    init = jax.jit(lambda rng, x: init_params(cls.model, rng, x))
    cls.params = init(jax.random.PRNGKey(0), cls.tokens)
    cls.decoded = {}

  def _decode(self, policy):
    if policy not in self.decoded:
      fn = lambda p, x: sharing.decode_forward(self.model, p, x, share_kv=True, kv_policy=policy)
      self.decoded[policy] = np.asarray(jax.jit(fn)(self.params, self.tokens)[0])
    return self.decoded[policy]

  def test_maps_match_hand_table(self):
    for name, reads in READS.items():
      policy = kv_policy_lib.parse(name, R)
      self.assertEqual(policy.reads, reads, name)
      self.assertEqual(policy.cached, tuple(sorted(set(reads))), name)
      self.assertEqual([policy.cached[s] for s in policy.slots], list(reads), name)

  def test_equivalent_forms(self):
    # docs/design.md §3: final, stride and keep_last are boundaries; anchor is keep_first + R.
    same = {
      "final": "boundaries:4",
      "stride2": "boundaries:2-4",
      "keep_last2": "boundaries:3-4",
      "huginn_anchor2": "boundaries:1-2-4",
      "huginn_mod1": "final",
      "keep_first4": "full",
    }
    for a, b in same.items():
      self.assertEqual(kv_policy_lib.parse(a, R).reads, kv_policy_lib.parse(b, R).reads, a)

  @parameterized.parameters(
    "bogus", "stride0", "keep_first5", "boundaries:2-3", "boundaries:3-2-4", "boundaries:x"
  )
  def test_bad_policy_is_one_line_naming_the_field(self, name):
    with self.assertRaises(config_checks.ConfigError) as err:
      kv_policy_lib.check(name, R, "config.eval.kv_policies")
    self.assertIn("config.eval.kv_policies", str(err.exception))
    self.assertNotIn("\n", str(err.exception))

  @parameterized.parameters(*DECODED)
  def test_exact_decode_equals_reference_loop(self, policy):
    want = reference_logits(CFG, self.params, self.tokens, READS[policy])
    np.testing.assert_allclose(self._decode(policy), want, atol=1e-5, rtol=0)

  def test_policies_differ(self):
    # The comparisons above can fail: a policy read with another's map is far off.
    want = reference_logits(CFG, self.params, self.tokens, READS["stride2"])
    self.assertGreater(np.abs(self._decode("huginn_mod2") - want).max(), 1e-2)

  @parameterized.parameters("first", "huginn_mod2")
  def test_jacobi_equals_exact_decode(self, policy):
    fn = lambda p, x: sharing.jacobi_forward(self.model, p, x, T - 1, kv_policy=policy)[0]
    got = np.asarray(jax.jit(fn)(self.params, self.tokens))
    np.testing.assert_allclose(got, self._decode(policy), atol=1e-5, rtol=0)

  def test_cache_bytes_count_cached_recurrences(self):
    # One GQA layer copy: K and V, kv heads x head_dim values of 2 bytes (bf16).
    layer = 2 * CFG.num_kv_heads * CFG.head_dim * 2
    plain = CFG.num_prelude_layers + CFG.num_coda_layers
    for name, reads in READS.items():
      copies = len(set(reads))
      layout = cache_layout(CFG, True, name)
      want = (plain + CFG.num_core_layers * copies) * layer
      self.assertEqual(layout.bytes_per_token("bf16"), want, name)
      # The arrays the model allocates take the same (float32 here: twice bf16's bytes).
      cache = jax.eval_shape(lambda n=name: kv_cache.init_cache(CFG, 1, 8, True, kv_policy=n))
      nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache.layers))
      self.assertEqual(nbytes, 2 * want * 8, name)
    self.assertEqual(
      cache_layout(CFG, True, "full").bytes_per_token("bf16"),
      cache_layout(CFG, False).bytes_per_token("bf16"),
    )


if __name__ == "__main__":
  absltest.main()
