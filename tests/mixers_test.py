"""MLA and KDA layers in the looped LM: every mixer in prelude, core and coda; decode vs
parallel, exact shared decode vs Jacobi passes, KV formats, cache bytes.

References: plain softmax attention (attention.attend) for MLA's expanded form, the expanded
form for the absorbed one, the parallel forward for unshared decode, and token-by-token shared
decode for the Jacobi passes (pass j exact for positions <= j, T - 1 passes exact).
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from configs import pretrain
from looped import config_checks, kv_quant
from looped.benice import evaluation
from looped.model import LoopedLM, init_cache, init_params, mixers, validate
from looped.model.attention import attend
from looped.model.kv_cache import cache_nbytes
from looped.model.mla import mla_absorbed, mla_expanded
from looped.model.sharing import decode_forward, jacobi_forward

_MIXER_DIMS = dict(mla_kv_rank=16, mla_rope_dim=4, kda_chunk_size=4)  # chunk 4: several chunks.
# Two models put every mixer in the core and MLA and KDA in both prelude and coda (GQA there is
# covered by model_test.py). One mixer per model would double the compile time of this file.
MODELS = {
  "hybrid": dict(
    prelude_mixers=("mla",),
    core_mixers=("kda", "mla", "gqa"),
    coda_mixers=("kda",),
    num_core_layers=3,
  ),
  "hybrid_swapped": dict(prelude_mixers=("kda",), core_mixers=("mla", "kda"), coda_mixers=("mla",)),
}


def _cfg(name, **overrides):
  return dataclasses.replace(testing.TINY_MODEL, **{**_MIXER_DIMS, **MODELS[name], **overrides})


@functools.cache
def _setup(name, length=6):
  cfg = _cfg(name)
  model = LoopedLM(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, length), 0, cfg.vocab_size)
  params = init_params(model, jax.random.PRNGKey(0), tokens)
  return model, params, tokens


@functools.cache
def _decode(name, share_kv, prefill=0):
  """Jitted decode_forward, compiled once per (model, layout, prefill) for all tests."""
  model = _setup(name)[0]
  return jax.jit(lambda p, x: decode_forward(model, p, x, share_kv=share_kv, prefill=prefill))


def _mla_inputs(seed, t=5, s=3, n=3, h=8, r=4, c=12):
  keys = jax.random.split(jax.random.PRNGKey(seed), 6)
  q_nope = jax.random.normal(keys[0], (2, t, n, h))
  q_rope = jax.random.normal(keys[1], (2, t, n, r))
  c_kv = jax.random.normal(keys[2], (2, s + t, 1, c))
  k_rope = jax.random.normal(keys[3], (2, s + t, 1, r))
  w_uk = jax.random.normal(keys[4], (c, n, h)) / c**0.5
  w_uv = jax.random.normal(keys[5], (c, n, h)) / c**0.5
  causal = jnp.tril(jnp.ones((t, t), bool))
  mask = jnp.concatenate([jnp.ones((t, s), bool), causal], axis=1)
  mask = jnp.broadcast_to(mask, (2, t, s + t)).at[1, :, :2].set(False)  # Row 1: 1 past slot.
  return q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mask


class MlaFormsTest(absltest.TestCase):
  def test_expanded_equals_plain_attention(self):
    q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mask = _mla_inputs(0)
    n, h, r = q_nope.shape[2], q_nope.shape[3], q_rope.shape[3]
    k_nope = jnp.einsum("bsc,cnh->bsnh", c_kv[:, :, 0], w_uk)
    v = jnp.einsum("bsc,cnh->bsnh", c_kv[:, :, 0], w_uv)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], r))], -1)
    v_padded = jnp.pad(v, [(0, 0)] * 3 + [(0, r)])  # attend needs v as wide as q.
    q = jnp.concatenate([q_nope, q_rope], -1)
    s = c_kv.shape[1] - q.shape[1]
    ref = attend(q, k[:, s:], v_padded[:, s:], mask[..., s:], k[:, :s], v_padded[:, :s],
                 mask[..., :s])[..., :h]  # fmt: skip
    out = mla_expanded(q_nope, q_rope, c_kv, k_rope, w_uk, w_uv, mask)
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
    self.assertEqual(n, out.shape[2])

  def test_absorbed_equals_expanded_values_and_gradients(self):
    args = _mla_inputs(1)
    np.testing.assert_allclose(mla_absorbed(*args), mla_expanded(*args), atol=1e-5, rtol=1e-5)
    w = jax.random.normal(jax.random.PRNGKey(9), mla_expanded(*args).shape)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a, args[-1]) * w)
    grad = lambda fn: jax.jit(jax.grad(loss(fn), argnums=tuple(range(6))))
    chex.assert_trees_all_close(
      grad(mla_absorbed)(*args[:-1]), grad(mla_expanded)(*args[:-1]), atol=1e-5, rtol=1e-5
    )


class MixerModelTest(parameterized.TestCase):
  @parameterized.parameters("hybrid", "hybrid_swapped")
  def test_unshared_decode_equals_parallel_forward(self, name):
    model, params, tokens = _setup(name)
    parallel, _ = jax.jit(model.apply)(params, tokens)
    for prefill in (0, 3):
      decoded, _ = _decode(name, False, prefill)(params, tokens)
      np.testing.assert_allclose(decoded, parallel, atol=2e-5, err_msg=f"prefill={prefill}")

  @parameterized.parameters("hybrid", "hybrid_swapped")
  def test_shared_decode_equals_jacobi_after_t_minus_1_passes(self, name):
    model, params, tokens = _setup(name)
    t = tokens.shape[1]
    exact, _ = _decode(name, True)(params, tokens)
    jacobi = jax.jit(lambda p, x, n: jacobi_forward(model, p, x, n)[0])
    errors = []
    for passes in range(t):
      err_T = np.asarray(jnp.abs(jacobi(params, tokens, passes) - exact).max(axis=(0, 2)))
      errors.append(err_T.max())
      # Pass j is exact for positions <= j.
      np.testing.assert_allclose(err_T[: passes + 1], 0.0, atol=2e-5, err_msg=f"pass {passes}")
    self.assertGreater(errors[0], 1e-3)  # Sharing changes this model's outputs.
    self.assertLess(errors[t - 1], 2e-5)

  def test_shared_core_cache_holds_final_recurrence_state_only(self):
    model, params, tokens = _setup("hybrid")
    _, shared = _decode("hybrid", True)(params, tokens)
    _, unshared = _decode("hybrid", False)(params, tokens)
    kda_shared, kda_unshared = shared.layers["core"][0], unshared.layers["core"][0]
    r = model.cfg.num_recurrences
    self.assertEqual(kda_unshared.state_BxNxHxE.shape[0], r)
    self.assertEqual(kda_shared.state_BxNxHxE.shape, kda_unshared.state_BxNxHxE.shape[1:])
    # Prelude/coda KDA layers are not looped: same state in both layouts (same inputs).
    np.testing.assert_allclose(
      shared.layers["prelude"][0][0], unshared.layers["prelude"][0][0], atol=1e-6
    )
    # The shared core state differs from the unshared final recurrence's (it read shared).
    diff = jnp.abs(kda_shared.state_BxNxHxE - kda_unshared.state_BxNxHxE[-1]).max()
    self.assertGreater(float(diff), 1e-4)


class MixerKvFormatTest(parameterized.TestCase):
  def test_decode_through_nvfp4_matches_parallel_forwards(self):
    fmt = "nvfp4"  # Per-token tensor scales and packed nibbles: the hardest format.
    cfg = _cfg("hybrid", head_dim=16, mla_kv_rank=16, mla_rope_dim=16)
    model = LoopedLM(cfg)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
    params = init_params(model, jax.random.PRNGKey(0), tokens)
    jacobi = jax.jit(lambda p, x, n: jacobi_forward(model, p, x, n, kv_format=fmt)[0])
    decode = lambda share: jax.jit(
      lambda p, x: decode_forward(model, p, x, share_kv=share, kv_format=fmt)
    )(params, tokens)
    (unshared, _), (shared, cache) = decode(False), decode(True)
    np.testing.assert_allclose(unshared, jacobi(params, tokens, 0), atol=1e-4)
    np.testing.assert_allclose(shared, jacobi(params, tokens, 5), atol=1e-4)
    self.assertGreater(float(jnp.abs(unshared - model.apply(params, tokens)[0]).max()), 1e-4)
    # Per-token entries are stored packed; KDA states stay float32.
    mla_latent = cache.layers["prelude"][0][0]
    self.assertIsInstance(mla_latent, kv_quant.QuantizedKV)
    self.assertEqual(cache.layers["core"][0].state_BxNxHxE.dtype, jnp.float32)


class CacheBytesTest(parameterized.TestCase):
  @parameterized.parameters("bf16", "fp8", "mxfp8", "nvfp4")
  def test_mla_bytes_per_token(self, fmt):
    d_c, d_r = 64, 32
    mla_only = dict(prelude_mixers=("mla",), core_mixers=("mla",), coda_mixers=("mla",))
    cfg = _cfg("hybrid", mla_kv_rank=d_c, mla_rope_dim=d_r, num_core_layers=2, **mla_only)
    # (d_c + d_rope) values, each with its format's bytes and block scales:
    per_layer = {
      "bf16": 2 * (d_c + d_r),
      "fp8": (d_c + 4) + (d_r + 4),  # 1 byte + a float32 scale per vector
      "mxfp8": (d_c + d_c // 32) + (d_r + d_r // 32),  # 1 byte + 1 E8M0 per 32
      "nvfp4": (d_c // 2 + d_c // 16) + (d_r // 2 + d_r // 16),  # 4 bits + 1 e4m3 per 16
    }[fmt]
    got = mixers.cache_bytes(cfg, fmt)
    layers_shared = 1 + 1 + 2
    layers_unshared = 1 + 1 + 2 * cfg.num_recurrences
    self.assertEqual(got["per_token"], {"shared": layers_shared * per_layer,
                                        "unshared": layers_unshared * per_layer})  # fmt: skip
    self.assertEqual(got["per_sequence"], {"shared": 0.0, "unshared": 0.0})
    # The stored cache: bytes per slot, plus nvfp4's float32 tensor scale per token slice.
    for share, layers in ((True, layers_shared), (False, layers_unshared)):
      cache = init_cache(cfg, 2, 5, share_kv=share, kv_format=fmt)
      extra = 2 * 4 * layers if fmt == "nvfp4" else 0  # latent and RoPE key slices
      self.assertEqual(cache_nbytes(cache), 2 * 5 * (layers * per_layer + extra))

  def test_kda_state_bytes_per_sequence_and_hybrid(self):
    cfg = _cfg("hybrid")  # prelude mla, core kda/mla/gqa (R = 3), coda kda.
    h, d, w = cfg.num_heads, cfg.head_dim, cfg.kda_conv_size
    kda_state = 4 * (h * d * d + (w - 1) * 3 * h * d)  # float32 state and conv tail
    got = mixers.cache_bytes(cfg, "bf16")
    self.assertEqual(
      got["per_sequence"], {"shared": 2 * kda_state, "unshared": (1 + 3) * kda_state}
    )
    mla = 2 * (cfg.mla_kv_rank + cfg.mla_rope_dim)
    gqa = 2 * 2 * cfg.num_kv_heads * cfg.head_dim
    self.assertEqual(got["per_token_by_mixer"]["mla"], {"shared": 2 * mla, "unshared": 4 * mla})
    self.assertEqual(got["per_token_by_mixer"]["gqa"], {"shared": gqa, "unshared": 3 * gqa})
    cache = init_cache(cfg, 1, 5, share_kv=False, kv_format="bf16")
    self.assertEqual(cache_nbytes(cache), 5 * (4 * mla + 3 * gqa) + 4 * kda_state)
    # The evaluation reports the same per-token bytes, and the per-sequence state bytes.
    ev = evaluation.kv_bytes_per_token(cfg, "bf16")
    self.assertEqual(ev, got["per_token"])
    self.assertEqual(evaluation.cache_bytes(cfg, "bf16"), got)


class MixerConfigTest(absltest.TestCase):
  def test_bad_mixer_names_field_and_allowed_values(self):
    config = ml_collections.ConfigDict({"model": pretrain.model_config()})
    validate(config)
    testing.set_field(config, "model.core_mixers", ("kda", "mamba"))
    with self.assertRaisesRegex(
      config_checks.ConfigError, r"model.core_mixers.*mamba.*'gqa', 'mla', 'kda'"
    ):
      validate(config)
    testing.set_field(config, "model.core_mixers", "kda")
    with self.assertRaisesRegex(config_checks.ConfigError, "model.core_mixers.*non-empty tuple"):
      validate(config)

  def test_qk_bias_is_refused_for_mla_and_kda_layers(self):
    config = ml_collections.ConfigDict({"model": pretrain.model_config()})
    config.model.qk_bias = True
    validate(config)  # Every layer GQA.
    for stage, mixers_, name in (("core", ("gqa", "mla"), "mla"), ("coda", ("kda",), "kda")):
      bad = ml_collections.ConfigDict(config.to_dict())
      testing.set_field(bad, f"model.{stage}_mixers", mixers_)
      with self.assertRaisesRegex(
        config_checks.ConfigError,
        rf"^config.model.qk_bias = True is invalid: biases GQA queries and keys, so every layer "
        rf"must be GQA, but model.{stage}_mixers has {name} layers\.$",
      ):
        validate(bad)
    # A stage without layers uses no mixer.
    testing.set_field(config, "model.coda_mixers", ("kda",))
    config.model.num_coda_layers = 0
    validate(config)

  def test_pattern_repeats_over_layers(self):
    cfg = dataclasses.replace(
      testing.TINY_MODEL, num_core_layers=5, core_mixers=("kda", "kda", "mla")
    )
    self.assertEqual(cfg.mixers("core"), ("kda", "kda", "mla", "kda", "kda"))
    self.assertEqual(cfg.mixers("prelude"), ("gqa",))


if __name__ == "__main__":
  absltest.main()
