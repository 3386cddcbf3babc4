"""model.rope_table: RoPE cos/sin read from a stored table (a converted checkpoint's buffer).
rope() against a numpy rotate-half on the table's values; a fresh table equal to the computed
RoPE; a changed table changes the logits; AdamW's weight decay leaves the table alone; a table
with a non-GQA layer fails validation."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped import config_checks
from looped.model import LoopedLM
from looped.model import config as model_lib
from looped.model.layers import rope, rope_table
from looped.train.optim import make_optimizer

CFG = dataclasses.replace(testing.TINY_MODEL, rope_table=True)


def _tables(params, fn):
  """params with every rope_table leaf replaced by fn(leaf)."""
  swap = lambda path, x: fn(x) if path[-1].key == "rope_table" else x
  return jax.tree_util.tree_map_with_path(swap, params)


class RopeTableTest(absltest.TestCase):
  def test_rope_reads_the_table_at_the_positions(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 3, 2, 8)).astype(np.float32)
    table = rng.normal(size=(16, 4, 2)).astype(np.float32)  # Not a rotation: read as given.
    positions = np.array([[0, 5, 15], [3, 3, 9]])
    c, s = table[positions, :, 0][:, :, None], table[positions, :, 1][:, :, None]
    x1, x2 = x[..., :4], x[..., 4:]
    want = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    got = rope(jnp.asarray(x), jnp.asarray(positions), 1e4, jnp.asarray(table))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # A fresh table holds the computed angles.
    computed = rope(jnp.asarray(x), jnp.asarray(positions), 1e4)
    tabled = rope(jnp.asarray(x), jnp.asarray(positions), 1e4, rope_table(16, 8, 1e4))
    np.testing.assert_allclose(tabled, computed, atol=1e-6)

  def test_model_uses_its_table(self):
    params = testing.random_params(CFG)
    layer = params["params"]["recurrence"]["layer_0"]["attn"]
    self.assertEqual(layer["rope_table"].shape, (CFG.max_seq_len, CFG.head_dim // 2, 2))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 8)))
    forward = jax.jit(lambda p, m: m.apply(p, tokens)[0], static_argnums=1)
    computed = LoopedLM(dataclasses.replace(CFG, rope_table=False, state_init="zeros"))
    tabled = LoopedLM(dataclasses.replace(CFG, state_init="zeros"))
    plain = jax.tree.map(lambda x: x, params)
    for scope in ("prelude_0", "coda_0"):
      del plain["params"][scope]["attn"]["rope_table"]
    for name in ("layer_0", "layer_1"):
      del plain["params"]["recurrence"][name]["attn"]["rope_table"]
    want = forward(plain, computed)
    np.testing.assert_allclose(forward(params, tabled), want, atol=1e-5)
    bent = _tables(params, lambda t: t.at[..., 1].multiply(0.9))
    self.assertGreater(float(jnp.max(jnp.abs(forward(bent, tabled) - want))), 1e-2)

  def test_weight_decay_leaves_the_table(self):
    train = types.SimpleNamespace(
      learning_rate=0.1,
      warmup_steps=1,
      num_steps=10,
      min_lr_ratio=0.1,
      grad_clip=1.0,
      b1=0.9,
      b2=0.95,
      weight_decay=0.5,
    )
    params = {"attn": {"rope_table": jnp.ones((4, 2, 2)), "kernel": jnp.ones((3, 3))}}
    grads = jax.tree.map(jnp.zeros_like, params)
    opt = make_optimizer(train)
    state = opt.init(params)
    for _ in range(3):
      updates, state = opt.update(grads, state, params)
      params = jax.tree.map(lambda p, u: p + u, params, updates)
    np.testing.assert_array_equal(params["attn"]["rope_table"], 1.0)
    self.assertLess(float(params["attn"]["kernel"][0, 0]), 1.0)  # Decay applies elsewhere.

  def test_a_table_with_a_non_gqa_layer_fails(self):
    fields = dataclasses.asdict(dataclasses.replace(CFG, core_mixers=("gqa", "mla")))
    with self.assertRaisesRegex(config_checks.ConfigError, "model.rope_table.*mla"):
      model_lib.validate(ml_collections.ConfigDict({"model": fields}))


if __name__ == "__main__":
  absltest.main()
