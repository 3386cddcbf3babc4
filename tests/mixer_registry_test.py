"""The mixer registry: every record agrees with its layer (cache entries a real forward returns,
parameters it initializes), with the hand-derived multiply-adds, and its capabilities with what
the model and the engine do; the capability questions callers ask of a model config."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped import config_checks
from looped.engine import paged_cache
from looped.model import LoopedLM, ModelConfig, config, init_cache, init_params, mixers, validate
from looped.model.looped_lm import causal_mask
from looped.model.mixer_interface import (
  CAPABILITIES,
  LayerMacs,
  MixerContext,
  PagedKV,
  SequenceMixer,
)
from looped.model.mixer_registry import REGISTRY

STAGES = ("prelude", "core", "coda")
NAMES = tuple(REGISTRY)
B, T, S = 2, 5, 8  # Rows, new tokens of a parallel forward, cached slots of a decode call.


def _cfg(mixer: str, **fields) -> ModelConfig:
  """The tiny model with every layer `mixer` (MLA dims small, KDA chunks shorter than T)."""
  every = {f"{s}_mixers": (mixer,) for s in STAGES}
  dims = dict(mla_kv_rank=16, mla_rope_dim=4, kda_chunk_size=4)
  return dataclasses.replace(testing.TINY_MODEL, **{**dims, **every, **fields})


def _layer(name: str, cfg: ModelConfig):
  """The mixer's layer and params initialized on a causal parallel forward."""
  layer = REGISTRY[name].module(cfg, 0.02)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, cfg.d_model))
  params = layer.init(jax.random.PRNGKey(1), x, _positions(T), MixerContext(causal_mask(T, B)))
  return layer, params


def _positions(t: int, start: int = 0):
  return jnp.broadcast_to(start + jnp.arange(t), (B, t))


class RecordTest(parameterized.TestCase):
  def test_config_names_are_the_registry(self):
    self.assertEqual(config.MIXERS, NAMES)
    bad = ml_collections.ConfigDict({"model": dataclasses.asdict(testing.TINY_MODEL)})
    bad.model.core_mixers = ("gqa", "rnn")
    with self.assertRaisesRegex(config_checks.ConfigError, r"model\.core_mixers"):
      validate(bad)

  @parameterized.named_parameters(*[(n, n) for n in NAMES])
  def test_plain_attention_is_a_plain_attention_blocks_params(self, name):
    """plain_attention: the layer's parameters are only query, key, value and output
    projections (kernels, biases) and q/k norms, what the public families' converters map."""
    _, params = _layer(name, _cfg(name))
    plain = {"query", "key", "value", "out", "query_norm", "key_norm"}
    modules = set(params["params"])
    self.assertEqual(
      REGISTRY[name].plain_attention, modules <= plain and {"query", "out"} <= modules
    )

  def test_each_record_names_its_own_layer_once(self):
    scopes = [m.scope for m in REGISTRY.values()]
    self.assertLen(set(scopes), len(scopes))
    for name, mixer in REGISTRY.items():
      self.assertEqual(mixer.name, name)
      self.assertIs(mixer.module.mixer_cache, mixer.cache)
      self.assertIsInstance(mixer.module(_cfg(name), 0.02), SequenceMixer)
      for capability in CAPABILITIES:
        self.assertIsInstance(getattr(mixer, capability), bool)

  @parameterized.parameters(*NAMES)
  def test_parallel_entry_is_what_the_layer_returns(self, name):
    """entry_zeros is the scan carry the Jacobi passes start from: the layer's own entry's
    structure, shapes and dtypes, all zeros; per-token mixers cache exactly those entries."""
    cfg, mixer = _cfg(name), REGISTRY[name]
    layer, params = _layer(name, cfg)
    x = jax.random.normal(jax.random.PRNGKey(2), (B, T, cfg.d_model))
    _, entry = layer.apply(params, x, _positions(T), MixerContext(causal_mask(T, B)))
    zeros = mixer.entry_zeros(cfg, B, T)
    self.assertEqual(jax.tree.structure(zeros), jax.tree.structure(entry))
    for z, e in zip(jax.tree.leaves(zeros), jax.tree.leaves(entry), strict=True):
      self.assertEqual((z.shape, z.dtype), (e.shape, e.dtype))
      np.testing.assert_array_equal(z, 0)
    if mixer.pages_its_cache:
      shapes = [e.shape[2:] for e in jax.tree.leaves(entry)]
      self.assertEqual(shapes, list(mixer.cache(cfg).token_shapes))

  @parameterized.parameters(*NAMES)
  def test_decode_entry_is_what_the_cache_describes(self, name):
    """One decode token on a cache entry as init_cache lays it out from the record: a
    per-token mixer returns one entry of each token shape, a stateful one a new state of the
    cache's structure and shapes (and a new value: the token moved it)."""
    cfg, mixer = _cfg(name), REGISTRY[name]
    layer, params = _layer(name, cfg)
    past = init_cache(cfg, B, S, share_kv=False).layers["prelude"][0]
    past = jax.tree.map(lambda z: jax.random.normal(jax.random.PRNGKey(3), z.shape, z.dtype), past)
    x = jax.random.normal(jax.random.PRNGKey(4), (B, 1, cfg.d_model))
    ctx = MixerContext(jnp.ones((B, 1, 1), bool), past, jnp.ones((B, 1, S), bool))
    _, entry = layer.apply(params, x, _positions(1, S), ctx)
    cache = mixer.cache(cfg)
    if mixer.pages_its_cache:
      self.assertEqual([e.shape for e in entry], [(B, 1, *s) for s in cache.token_shapes])
      self.assertEqual(cache.state_shapes, ())
    else:
      self.assertEqual(cache.token_shapes, ())
      self.assertEqual(jax.tree.structure(entry), jax.tree.structure(past))
      shapes = [e.shape for e in jax.tree.leaves(entry)]
      self.assertEqual(shapes, [(B, *s) for s in cache.state_shapes])
      moved = [not np.allclose(e, p) for e, p in zip(*map(jax.tree.leaves, (entry, past)))]
      self.assertTrue(all(moved))

  @parameterized.named_parameters(
    ("gqa", "gqa", {}),
    ("gqa_bias_no_norm", "gqa", dict(qk_bias=True, qk_norm=False)),
    ("mla", "mla", {}),
    ("mla_low_rank_query", "mla", dict(mla_q_rank=8)),
    ("kda", "kda", {}),
    ("kda_conv_2", "kda", dict(kda_conv_size=2)),
  )
  def test_params_are_the_layers_tree(self, name, fields):
    cfg = _cfg(name, **fields)
    layer = REGISTRY[name].module(cfg, 0.02)
    x = jnp.zeros((B, T, cfg.d_model))
    init = lambda key: layer.init(key, x, _positions(T), MixerContext(causal_mask(T, B)))
    tree = jax.eval_shape(init, jax.random.PRNGKey(0))
    count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(tree))
    self.assertEqual(REGISTRY[name].params(cfg), count)


# d 8, 2 query heads and 1 KV head of 4; MLA latent 6, RoPE 2, full-rank queries; KDA conv 4
# (model_flops_test.py's and sim_shape_test.py's hand-derived model).
_HAND = ModelConfig(
  vocab_size=10, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=16,
  mla_kv_rank=6, mla_rope_dim=2, mla_q_rank=0, kda_conv_size=4,
)  # fmt: skip


class HandDerivedTest(absltest.TestCase):
  def test_gqa(self):
    # Q, O 8x(2x4) each, K, V 8x4 each = 192; per key read Q.K and P.V over 2 heads of 4 = 16.
    self.assertEqual(REGISTRY["gqa"].macs(_HAND, False), LayerMacs(192, per_key=16))
    self.assertEqual(REGISTRY["gqa"].params(_HAND), 192 + 2 * 4)  # q and k norms.

  def test_mla(self):
    # Query 8x(2x(4+2)) = 96; kv_down 8x(6+2) = 64; key_up, value_up 6x(2x4) = 48 each; out
    # 8x8 = 64: 320. Per key, expanded: scores with RoPE 2x(4+2) = 12, P.V 2x4 = 8; absorbed:
    # scores over the latent and the RoPE key 2x(6+2) = 16, P times the latent 2x6 = 12.
    mla = REGISTRY["mla"]
    self.assertEqual(mla.macs(_HAND, False), LayerMacs(96 + 64 + 2 * 48 + 64, per_key=12 + 8))
    self.assertEqual(mla.macs(_HAND, True), LayerMacs(320, per_key=16 + 12))
    self.assertEqual(mla.params(_HAND), 320 + 6)  # kv_norm over the latent.

  def test_kda(self):
    # qkv 8x24 = 192; decay 8x4 + 4x(2x4) = 64; gate the same 64; beta 8x2 = 16; out 8x8 = 64;
    # conv 4 taps x 24 channels = 96: 496. Delta rule per head on a 4x4 state: k^T S, the
    # rank-1 update and q^T S, 3 x 16, 2 heads: 96.
    kda = REGISTRY["kda"]
    self.assertEqual(kda.macs(_HAND, False), LayerMacs(192 + 64 + 64 + 16 + 64 + 96, state=96))
    self.assertEqual(kda.params(_HAND), 496 + 2 + 8 + 8 + 4)  # A_log, dt_bias, gate bias, norm.


class CapabilityTest(parameterized.TestCase):
  @parameterized.parameters(*NAMES)
  def test_attends_is_reading_scores_over_positions(self, name):
    mixer = REGISTRY[name]
    for absorbed in (False, True):
      self.assertEqual(mixer.macs(_HAND, absorbed).per_key > 0, mixer.attends)

  @parameterized.parameters(*NAMES)
  def test_pages_its_cache_is_what_the_engine_can_page(self, name):
    """A model of only this mixer: the engine refuses it exactly when it caches no per-token
    entry (check_model reads the cache layout, not the capability)."""
    cfg = _cfg(name)
    if REGISTRY[name].pages_its_cache:
      paged_cache.check_model(cfg)
    else:
      with self.assertRaisesRegex(ValueError, "layer to page"):
        paged_cache.check_model(cfg)

  @parameterized.parameters(*NAMES)
  def test_paged_kernel_reads_the_pages_as_the_dense_cache(self, name):
    """A kernel-read mixer gives the same output from its cache held as pages as from the
    dense cache; any other one cannot read pages at all."""
    cfg, mixer = _cfg(name), REGISTRY[name]
    layer, params = _layer(name, cfg)
    past = init_cache(cfg, B, S, share_kv=False).layers["prelude"][0]
    past = jax.tree.map(lambda z: jax.random.normal(jax.random.PRNGKey(5), z.shape, z.dtype), past)
    x = jax.random.normal(jax.random.PRNGKey(6), (B, 1, cfg.d_model))
    mask = jnp.arange(S)[None, None, :] < jnp.array([S, 3])[:, None, None]  # Row 1: 3 slots.
    apply = lambda p: layer.apply(
      params, x, _positions(1, S), MixerContext(jnp.ones((B, 1, 1), bool), p, mask)
    )[0]
    if not mixer.pages_its_cache:  # A state: nothing to hold as pages.
      self.assertFalse(mixer.paged_kernel)
      return
    page = 4
    as_pages = lambda a: a.reshape(B * S // page, page, *a.shape[2:])
    table = jnp.arange(B * S // page, dtype=jnp.int32).reshape(B, S // page)
    if mixer.paged_kernel:
      paged = PagedKV(as_pages(past[0]), as_pages(past[1]), table)
      np.testing.assert_allclose(apply(paged), apply(past), atol=1e-5, rtol=1e-5)
    else:
      paged = PagedKV(*(as_pages(a) for a in past), table)
      with self.assertRaises((TypeError, AttributeError, ValueError)):
        apply(paged)

  def _model_trace(self, name: str, **kwargs):
    """Traces (no compile) a parallel forward of a model whose core is this mixer, reading a
    shared past (the Jacobi passes' entries)."""
    cfg = _cfg(name, prelude_mixers=("gqa",), coda_mixers=("gqa",))
    model = LoopedLM(cfg)
    tokens = jnp.zeros((B, T), jnp.int32)
    params = jax.eval_shape(lambda k: init_params(model, k, tokens), jax.random.PRNGKey(0))
    shared = [mixers.parallel_entry_zeros(cfg, m, B, T) for m in cfg.mixers("core")]
    return jax.eval_shape(lambda p: model.apply(p, tokens, shared_kv=shared, **kwargs), params)

  @parameterized.parameters(*NAMES)
  def test_block_prefill_and_kv_policies_run_where_declared(self, name):
    mixer = REGISTRY[name]
    for capability, kwargs in (
      ("block_prefill", dict(prefill_block=2)),
      ("kv_policies", dict(kv_policy="first")),
    ):
      with self.subTest(capability):
        if getattr(mixer, capability):
          logits, _ = self._model_trace(name, **kwargs)
          self.assertEqual(logits.shape, (B, T, testing.TINY_MODEL.vocab_size))
        else:
          with self.assertRaises(ValueError):
            self._model_trace(name, **kwargs)


class ModelQuestionsTest(absltest.TestCase):
  def test_a_model_config_and_a_config_section_answer_alike(self):
    # Prelude KDA; core pattern (gqa, kda) over 3 layers: gqa, kda, gqa; coda MLA.
    fields = dict(
      prelude_mixers=("kda",), core_mixers=("gqa", "kda"), num_core_layers=3, coda_mixers=("mla",)
    )
    cfg = dataclasses.replace(testing.TINY_MODEL, **fields)
    section = ml_collections.ConfigDict(dataclasses.asdict(cfg))
    for model in (cfg, section):
      self.assertTrue(mixers.any_with(model, "core", "kv_policies"))
      self.assertFalse(mixers.all_with(model, "core", "kv_policies"))
      self.assertEqual(mixers.lacking(model, "core", "kv_policies"), ("kda",))
      self.assertEqual(mixers.lacking(model, None, "paged_kernel"), ("kda", "mla"))
      self.assertTrue(mixers.all_with(model, "coda", "pages_its_cache"))
      self.assertFalse(mixers.any_with(model, "prelude", "attends"))

  def test_only_the_layers_a_pattern_reaches_count(self):
    # One core layer of the pattern (gqa, kda): the KDA entry names no layer.
    cfg = dataclasses.replace(testing.TINY_MODEL, core_mixers=("gqa", "kda"), num_core_layers=1)
    self.assertTrue(mixers.all_with(cfg, "core", "kv_policies"))

  def test_an_unknown_capability_is_refused(self):
    with self.assertRaisesRegex(ValueError, "unknown mixer capability 'pages'"):
      mixers.all_with(testing.TINY_MODEL, None, "pages")


if __name__ == "__main__":
  absltest.main()
