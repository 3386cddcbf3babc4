"""The model fields Parcae needs, each against a plain reference: value embeddings in GQA
attention (a numpy loop over positions, with a QK-norm epsilon large enough to matter), the
core-output projection (an identity map equals none), and their validation in one line naming
the field. The RMSNorm epsilon is checked with the converted Parcae against a numpy forward
(convert_parcae_test.py)."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped import config_checks, schema
from looped.model import LoopedLM, ModelConfig, init_params
from looped.model import config as model_lib
from looped.model.attention import Attention
from looped.model.looped_lm import causal_mask
from looped.model.mixer_interface import MixerContext

_CFG = ModelConfig(
  vocab_size=11,
  d_model=8,
  num_heads=4,
  num_kv_heads=2,
  head_dim=4,
  value_embed_gate_dim=3,
  qk_norm_eps=0.25,
  rope_base=100.0,
  init_std=0.5,
)


def _rms(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale


def _rope_halves(x, positions, base):  # x [T, H]: pairs (i, i + H/2)
  half = x.shape[-1] // 2
  ang = positions[:, None] * base ** (-np.arange(half) / half)
  a, b = x[:, :half], x[:, half:]
  return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)


def attention_loop(p, x_BxTxD, tokens_BxT, cfg):
  """GQA with a value embedding, one query position and head at a time (numpy float64)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  x = np.asarray(x_BxTxD, np.float64)
  b, t, _ = x.shape
  g = cfg.num_heads // cfg.num_kv_heads
  q = np.einsum("btd,dnh->btnh", x, p["query"]["kernel"])
  k = np.einsum("btd,dnh->btnh", x, p["key"]["kernel"])
  v = np.einsum("btd,dnh->btnh", x, p["value"]["kernel"])
  gate = 2 / (
    1 + np.exp(-(x[..., : cfg.value_embed_gate_dim] @ p["value_embed"]["gate"]["kernel"]))
  )
  v = v + gate[..., None] * p["value_embed"]["table"][np.asarray(tokens_BxT)]
  out = np.zeros((b, t, cfg.num_heads, cfg.head_dim))
  pos = np.arange(t, dtype=np.float64)
  for row in range(b):
    for n in range(cfg.num_heads):
      kv = n // g
      qn = _rms(q[row, :, n], p["query_norm"]["scale"], cfg.qk_norm_eps)
      kn = _rms(k[row, :, kv], p["key_norm"]["scale"], cfg.qk_norm_eps)
      qn, kn = _rope_halves(qn, pos, cfg.rope_base), _rope_halves(kn, pos, cfg.rope_base)
      for i in range(t):
        s = kn[: i + 1] @ qn[i] / np.sqrt(cfg.head_dim)
        w = np.exp(s - s.max())
        out[row, i, n] = (w / w.sum()) @ v[row, : i + 1, kv]
  return np.einsum("btnh,nhd->btd", out, p["out"]["kernel"]), v


class ValueEmbeddingAttentionTest(absltest.TestCase):
  def test_equals_a_loop_over_positions(self):
    b, t = 2, 5
    x_BxTxD = jax.random.normal(jax.random.PRNGKey(1), (b, t, _CFG.d_model))
    tokens_BxT = jax.random.randint(jax.random.PRNGKey(2), (b, t), 0, _CFG.vocab_size)
    layer = Attention(_CFG, 0.5, value_embed=True)
    ctx = MixerContext(causal_mask(t, b), tokens_BxT=tokens_BxT)
    params = nn.unbox(layer.init(jax.random.PRNGKey(0), x_BxTxD, jnp.zeros((b, t), jnp.int32), ctx))
    params = jax.tree.map(lambda a: a + 0.3, params)  # Norm scales other than 1 too.
    positions_BxT = jnp.broadcast_to(jnp.arange(t), (b, t))
    y_BxTxD, (_, v_BxTxKxH) = layer.apply(params, x_BxTxD, positions_BxT, ctx)
    want_y, want_v = attention_loop(params["params"], x_BxTxD, tokens_BxT, _CFG)
    np.testing.assert_allclose(v_BxTxKxH, want_v, rtol=1e-5, atol=1e-5)  # The cached values.
    np.testing.assert_allclose(y_BxTxD, want_y, rtol=1e-4, atol=1e-5)
    # Without the embedding, the same weights give other outputs: the test sees it.
    plain = Attention(_CFG, 0.5).apply(
      {"params": {k: v for k, v in params["params"].items() if k != "value_embed"}},
      x_BxTxD,
      positions_BxT,
      ctx,
    )[0]
    self.assertGreater(float(jnp.max(jnp.abs(plain - y_BxTxD))), 1e-2)

  def test_needs_the_tokens(self):
    x_BxTxD = jnp.ones((1, 2, _CFG.d_model))
    layer = Attention(_CFG, 0.5, value_embed=True)
    with self.assertRaisesRegex(ValueError, "tokens_BxT"):
      layer.init(
        jax.random.PRNGKey(0),
        x_BxTxD,
        jnp.zeros((1, 2), jnp.int32),
        MixerContext(causal_mask(2, 1)),
      )


class ModelPartsTest(absltest.TestCase):
  def test_identity_core_out_proj_equals_none(self):
    cfg = dataclasses.replace(testing.TINY_MODEL, core_out_proj=True, num_recurrences=1)
    tokens_BxT = jax.random.randint(jax.random.PRNGKey(3), (1, 6), 0, cfg.vocab_size)
    params = jax.jit(lambda: init_params(LoopedLM(cfg), jax.random.PRNGKey(0), tokens_BxT))()
    forward = jax.jit(lambda p, c: LoopedLM(c).apply(p, tokens_BxT)[0], static_argnums=1)
    proj = forward(params, cfg)
    params["params"]["core_out"]["kernel"] = jnp.eye(cfg.d_model)
    same = forward(params, cfg)
    without = {"params": {k: v for k, v in params["params"].items() if k != "core_out"}}
    plain = forward(without, dataclasses.replace(cfg, core_out_proj=False))
    np.testing.assert_allclose(same, plain, rtol=1e-6, atol=1e-6)
    self.assertGreater(float(jnp.max(jnp.abs(proj - plain))), 1e-3)


class ValidationTest(absltest.TestCase):
  def _fails(self, field: str, **fields):
    model = schema.defaults(ModelConfig)
    model.update(fields)
    config = ml_collections.ConfigDict({"model": model})
    with self.assertRaises(config_checks.ConfigError) as e:
      model_lib.validate(config)
    self.assertIn(f"config.model.{field} = ", str(e.exception))
    self.assertNotIn("\n", str(e.exception))
    return str(e.exception)

  def test_bad_values_name_the_field(self):
    self.assertIn("numbered 0..3", self._fails("value_embed_layers", value_embed_layers=(4,)))
    self.assertIn(
      "layer 1 is mla",
      self._fails("value_embed_layers", value_embed_layers=(1,), core_mixers=("mla",)),
    )
    self.assertIn("twice", self._fails("value_embed_layers", value_embed_layers=(0, 0)))
    self._fails("value_embed_gate_dim", value_embed_layers=(0,), value_embed_gate_dim=1000)
    self._fails("core_out_proj", core_out_proj=True, core_out_norm="every", num_coda_layers=0)
    self._fails("norm_eps", norm_eps=0.0)


if __name__ == "__main__":
  absltest.main()
