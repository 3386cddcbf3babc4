"""Block prefill (docs/design.md §3): the decode path over blocks of C tokens against an
independent form of the same semantics, the parallel block-Jacobi passes, and its two ends
(C = 1: exact shared decode; C >= T: the unshared forward). With a KV format, a chunk reads its
own earlier tokens through the format, as token-by-token decode does."""

import dataclasses

import jax
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.model import init_params, sharing
from looped.model.looped_lm import LoopedLM

T = 12
GQA = dataclasses.replace(testing.TINY_MODEL, head_dim=16)
MLA = dataclasses.replace(
  GQA,
  prelude_mixers=("mla",),
  core_mixers=("mla",),
  coda_mixers=("mla",),
  mla_kv_rank=16,
  mla_rope_dim=16,
)
MODELS = {"gqa": GQA, "mla": MLA}


def _setup(name):
  cfg = MODELS[name]
  model = LoopedLM(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, T), 0, cfg.vocab_size)
  return model, init_params(model, jax.random.PRNGKey(0), tokens), tokens


def _blocks(model, params, tokens, block, share_kv=True, kv_format=None):
  fn = lambda p, t: sharing.decode_forward(
    model, p, t, share_kv=share_kv, block=block, kv_format=kv_format
  )[0]
  return np.asarray(jax.jit(fn)(params, tokens))


def _jacobi(model, params, tokens, block, kv_format=None):
  passes = -(-T // block) - 1
  fn = lambda p, t: sharing.jacobi_forward(
    model, p, t, passes, prefill_block=block, kv_format=kv_format
  )[0]
  return np.asarray(jax.jit(fn)(params, tokens))


class BlockPrefillTest(parameterized.TestCase):
  @parameterized.product(name=("gqa", "mla"), block=(4, 5))  # A divisor of T, and not.
  def test_decode_blocks_equal_block_jacobi(self, name, block):
    model, params, tokens = _setup(name)
    got = _blocks(model, params, tokens, block)
    np.testing.assert_allclose(got, _jacobi(model, params, tokens, block), atol=1e-5, rtol=0)

  @parameterized.parameters("gqa", "mla")
  def test_moved_boundary_changes_logits(self, name):
    # The comparison above can fail: the same blocks shifted by one token differ clearly.
    model, params, tokens = _setup(name)
    a, b = _blocks(model, params, tokens, 4), _jacobi(model, params, tokens, 3)
    self.assertGreater(np.max(np.abs(a - b)), 1e-3)

  @parameterized.parameters("gqa", "mla")
  def test_block_one_is_exact_shared_decode(self, name):
    model, params, tokens = _setup(name)
    exact = sharing.jacobi_forward(model, params, tokens, T - 1)[0]  # Token-by-token's form.
    np.testing.assert_allclose(_blocks(model, params, tokens, 1), exact, atol=1e-5, rtol=0)
    # The parallel block form with C = 1 is the ordinary Jacobi pass.
    np.testing.assert_allclose(_jacobi(model, params, tokens, 1), exact, atol=1e-5, rtol=0)

  @parameterized.parameters("gqa", "mla")
  def test_whole_prompt_block_is_unshared(self, name):
    model, params, tokens = _setup(name)
    unshared = model.apply(params, tokens)[0]
    np.testing.assert_allclose(_blocks(model, params, tokens, T), unshared, atol=1e-5, rtol=0)

  @parameterized.parameters(("gqa", "nvfp4"), ("mla", "fp8"))
  def test_formatted_blocks(self, name, kv_format):
    model, params, tokens = _setup(name)
    # Unshared: a chunk in a format computes what its tokens one at a time do, and what the
    # parallel forward with the format's round trip on every earlier position does.
    whole = _blocks(model, params, tokens, T, share_kv=False, kv_format=kv_format)
    one = _blocks(model, params, tokens, 1, share_kv=False, kv_format=kv_format)
    parallel = model.apply(params, tokens, kv_format=kv_format)[0]
    np.testing.assert_allclose(whole, one, atol=2e-5, rtol=0)
    np.testing.assert_allclose(whole, parallel, atol=2e-5, rtol=0)
    # Shared: block prefill in the format against the block-Jacobi form in the format.
    got = _blocks(model, params, tokens, 4, kv_format=kv_format)
    want = _jacobi(model, params, tokens, 4, kv_format=kv_format)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    self.assertGreater(np.max(np.abs(got - _blocks(model, params, tokens, 4))), 1e-4)

  def test_block_jacobi_needs_shared_kv_and_xla(self):
    model, params, tokens = _setup("gqa")
    with self.assertRaisesRegex(ValueError, "prefill_block needs shared_kv"):
      model.apply(params, tokens, prefill_block=4)
    with self.assertRaisesRegex(ValueError, "parallel-mode option"):
      sharing_cache = sharing.decode_forward(model, params, tokens[:, :2], share_kv=True)[1]
      model.apply(params, tokens[:, :1], cache=sharing_cache, prefill_block=4)
    with self.assertRaisesRegex(ValueError, "block must be >= 1"):
      sharing.decode_forward(model, params, tokens, share_kv=True, block=0)


if __name__ == "__main__":
  absltest.main()
