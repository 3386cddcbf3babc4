"""KDA's delta rule against flash-linear-attention's naive forms, and its forms against each other.

References: tests/testdata/kda_vectors.npz (tests/make_kda_vectors.py: fla's naive_recurrent_kda
and naive_chunk_kda), live fla when importable, a plain per-token numpy loop for the shared
read, and each row of a padded decode call decoded alone on its real tokens.
"""

import importlib.util
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from looped.model import kda
from looped.model.config import ModelConfig
from looped.model.mixer_interface import MixerContext

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_generator():
  spec = importlib.util.spec_from_file_location(
    "make_kda_vectors", os.path.join(_HERE, "make_kda_vectors.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


gen = _load_generator()
_HAVE_FLA = gen.fla_naive() is not None and importlib.util.find_spec("torch") is not None


def _rel_rms(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


def _random(seed, b=2, t=37, h=2, k=8, v=4):
  x = gen.inputs(seed)  # Same distribution as the fla vectors, cut to a small odd length.
  cut = lambda a: a[:b, :t, :h, :k] if a.ndim == 4 else a[:b, :t, :h]
  out = {name: jnp.asarray(cut(x[name])) for name in ("q", "k", "g", "beta")}
  out["v"] = jnp.asarray(x["v"][:b, :t, :h, :v])
  out["state"] = jnp.asarray(x["state"][:b, :h, :k, :v])
  return out


def _args(x):
  return x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"]


class _Compare(parameterized.TestCase):
  def check_against(self, x, ref):
    args = tuple(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "state"))
    ours = {
      "recurrent": kda.kda_recurrent(*args),
      "chunk": kda.kda_chunkwise(*args, chunk_size=64),
      "chunk16": kda.kda_chunkwise(*args, chunk_size=16),
    }
    errors = {}
    for name, (o, s) in ours.items():
      for ref_name in ("recurrent", "chunk"):
        errors[(name, ref_name, "o")] = _rel_rms(o, ref[f"{ref_name}_o"])
        errors[(name, ref_name, "state")] = _rel_rms(s, ref[f"{ref_name}_state"])
    for key, err in errors.items():
      self.assertLess(err, 5e-3, key)
    return errors


class KdaGoldenTest(_Compare):
  def test_matches_fla_naive_vectors(self):
    with np.load(os.path.join(_HERE, "testdata", "kda_vectors.npz")) as data:
      x = {k[3:]: data[k] for k in data if k.startswith("in/")}
      ref = {k: data[k] for k in data if not k.startswith("in/")}
    errors = self.check_against(x, ref)
    print("KDA vs fla naive, relative RMS:", {" ".join(k): f"{e:.1e}" for k, e in errors.items()})
    # The vectors are not trivial: the state carries information across both chunks.
    self.assertGreater(float(np.abs(ref["recurrent_o"][:, 64:]).mean()), 1e-2)

  @absltest.skipUnless(_HAVE_FLA, "fla/torch not installed (the committed vectors still run)")
  def test_matches_fla_naive_live(self):
    x = gen.inputs(seed=11)
    self.check_against(x, gen.reference(x))


class KdaFormsTest(parameterized.TestCase):
  @parameterized.parameters(4, 16, 64)
  def test_chunkwise_equals_recurrent(self, chunk):
    x = _random(1)
    o_r, s_r = kda.kda_recurrent(*_args(x))
    o_c, s_c = kda.kda_chunkwise(*_args(x), chunk_size=chunk)
    np.testing.assert_allclose(o_c, o_r, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(s_c, s_r, atol=1e-5, rtol=1e-5)

  def test_chunkwise_gradients_equal_recurrent_autodiff(self):
    x = _random(2, t=21)
    w_o = jax.random.normal(jax.random.PRNGKey(0), x["v"].shape)
    w_s = jax.random.normal(jax.random.PRNGKey(1), x["state"].shape)

    def loss(fn):
      def f(*args):
        o, s = fn(*args)
        return jnp.sum(o * w_o) + jnp.sum(s * w_s)

      return jax.jit(jax.grad(f, argnums=tuple(range(6))))

    g_rec = loss(kda.kda_recurrent)(*_args(x))
    g_chunk = loss(lambda *a: kda.kda_chunkwise(*a, chunk_size=8))(*_args(x))
    chex.assert_trees_all_close(g_chunk, g_rec, atol=1e-5, rtol=1e-5)
    self.assertGreater(float(jnp.abs(g_rec[3]).max()), 1e-3)  # Decays get gradient.

  def test_read_previous_reads_state_before_token(self):
    x = _random(3, t=13)
    q, k, v, g, beta, s0 = _args(x)
    o_prev, _ = kda.kda_chunkwise(q, k, v, g, beta, s0, chunk_size=4, read_previous=True)
    # S_{t-1} from the recurrent form run on the first t tokens.
    for t in (0, 1, 4, 12):
      _, s_before = kda.kda_recurrent(q[:, :t], k[:, :t], v[:, :t], g[:, :t], beta[:, :t], s0)
      expected = jnp.einsum("bhk,bhkv->bhv", q[:, t] * 8**-0.5, s_before)
      np.testing.assert_allclose(o_prev[:, t], expected, atol=1e-5, rtol=1e-5)

  def test_shared_read_equals_per_token_loop(self):
    own, past = _random(4, t=11), _random(5, t=11)
    q, k, v, g, beta, _ = _args(own)
    past_seq = (past["k"], past["v"], past["g"], past["beta"])
    out = kda.shared_read(q, k, v, g, beta, past_seq, chunk_size=4)
    # Token t: S_{t-1} of the past sequence, then one step of its own update, never kept.
    for t in range(11):
      seq = [a[:, :t] for a in past_seq]
      s_prev = kda.kda_recurrent(q[:, :t], *seq)[1]
      own_t = [a[:, t : t + 1] for a in (q, k, v, g, beta)]
      expected, _ = kda.kda_recurrent(*own_t, s_prev)
      np.testing.assert_allclose(out[:, t], expected[:, 0], atol=1e-5, rtol=1e-5)
    # With its own sequence as the past, the shared read is the ordinary causal output.
    causal, _ = kda.kda_recurrent(q, k, v, g, beta)
    np.testing.assert_allclose(
      kda.shared_read(q, k, v, g, beta, (k, v, g, beta), chunk_size=4), causal, atol=1e-5
    )

  def test_causal_conv_with_tail_equals_longer_conv(self):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 9, 5))
    w = jax.random.normal(jax.random.PRNGKey(1), (4, 5))
    full = kda.causal_conv(x, w)
    np.testing.assert_allclose(kda.causal_conv(x[:, 6:], w, x[:, 3:6]), full[:, 6:], atol=1e-6)
    # Hand-computed: out_t = sum_i w_i x_{t-3+i} with zeros before the start.
    np.testing.assert_allclose(full[:, 1], w[2] * x[:, 0] + w[3] * x[:, 1], atol=1e-6)


class KdaPaddingTest(absltest.TestCase):
  """A batched decode call pads rows to one length: padding tokens (after num_new_B[b] real
  ones) leave the row's state and conv tail as its real tokens left them."""

  def test_padding_leaves_state_and_conv_tail(self):
    cfg = ModelConfig(vocab_size=16, d_model=16, num_heads=2, head_dim=8, kda_conv_size=3)
    layer = kda.KDA(cfg, 0.02)
    lengths, t = (3, 6, 0), 6  # Row 2 is a padding row: nothing real at all.
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    x_BxTxD = jax.random.normal(keys[0], (3, t, cfg.d_model))
    past = kda.KDAState(
      0.1 * jax.random.normal(keys[1], (3, 2, 8, 8)),
      jax.random.normal(keys[2], (3, cfg.kda_conv_size - 1, 3 * 2 * 8)),
    )
    mask = jnp.ones((3, t, t), bool)
    params = layer.init(keys[0], x_BxTxD, None, MixerContext(mask, past))
    ctx = MixerContext(mask, past, num_new_B=jnp.asarray(lengths))
    y_BxTxD, state = layer.apply(params, x_BxTxD, None, ctx)
    for b, n in enumerate(lengths):
      row = lambda a, b=b: a[b : b + 1]
      if n:  # The row alone, on exactly its real tokens.
        one = MixerContext(mask[:1, :n, :n], jax.tree.map(row, past))
        y_want, want = layer.apply(params, x_BxTxD[b : b + 1, :n], None, one)
        np.testing.assert_allclose(y_BxTxD[b, :n], y_want[0], atol=1e-6)
      else:
        want = jax.tree.map(row, past)
      np.testing.assert_allclose(state.state_BxNxHxE[b], want.state_BxNxHxE[0], atol=1e-6)
      np.testing.assert_array_equal(state.conv_BxWxM[b], want.conv_BxWxM[0])


if __name__ == "__main__":
  absltest.main()
