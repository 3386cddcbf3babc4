"""Shared-cache flash attention (interpret mode) against its pure-JAX reference and the model's.

Forward values and the gradients of all five inputs (q, own k/v, past k/v) are compared with
`jax.vjp` of `pallas_kernels.reference.shared_attention`, a dense softmax over
[past (s < t) ; own (s = t)]; that reference is itself checked against the model's attention
math (`looped.model.attention.attend` with the masks LoopedLM builds for a Jacobi pass). A past
packed by `looped.kv_quant` must read as its `kv_quant.dequantize` round trip. The TPU variant
(past / query blocks pipelined along a grid axis) runs in Pallas' TPU interpreter against the
same references, with blocks that are multiples of 8 as Mosaic tiles them.

The block form (`prefill_block` C: past at s < b(t), own K/V causally from b(t)) is checked the
same way against the reference, and against `attend` with the block masks LoopedLM builds.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from looped import kv_quant
from looped.model import looped_lm
from looped.model.attention import attend
from pallas_kernels import PackedKV, reference, shared_attention


def _inputs(b, t, hq, hkv, d, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  normal = lambda heads: jnp.asarray(rng.standard_normal((b, t, heads, d)), dtype)
  return normal(hq), normal(hkv), normal(hkv), normal(hkv), normal(hkv), normal(hq)


@functools.partial(jax.jit, static_argnums=0)
def _value_and_grads(fn, args, do):
  out, vjp = jax.vjp(fn, *args)
  return out, vjp(do)


class SharedAttentionTest(parameterized.TestCase):
  @parameterized.named_parameters(
    # name, B, T, Hq, Hkv, block_q, block_k, causal (past = own K/V), variant
    ("mha_t_not_multiple", 2, 13, 2, 2, 8, 4, False, "generic"),
    ("gqa2_causal", 1, 13, 4, 2, 4, 8, True, "generic"),
    ("gqa4_one_block", 2, 7, 4, 1, 8, 8, False, "generic"),
    ("single_head_many_blocks", 1, 16, 1, 1, 4, 4, False, "generic"),
    ("gqa2_t1", 2, 1, 2, 1, 8, 8, False, "generic"),
    # TPU: past blocks above the diagonal skipped (q 16 x k 8), query blocks before a past
    # block skipped in dkv (q 8 x k 16), T 21 padded to 32.
    ("tpu_gqa2_causal_q16_k8", 1, 21, 4, 2, 16, 8, True, "tpu"),
    ("tpu_mha_q8_k16", 2, 21, 2, 2, 8, 16, False, "tpu"),
    ("tpu_gqa4_t1", 1, 1, 4, 1, 8, 8, False, "tpu"),
  )
  def test_forward_and_gradients_match_reference(self, b, t, hq, hkv, bq, bk, causal, variant):
    q, k, v, kp, vp, do = _inputs(b, t, hq, hkv, 16)
    if causal:
      kp, vp = k, v
    kernel = lambda *a: shared_attention(
      *a, block_q=bq, block_k=bk, variant=variant, interpret=True
    )
    out, grads = _value_and_grads(kernel, (q, k, v, kp, vp), do)
    ref_out, ref_grads = _value_and_grads(reference.shared_attention, (q, k, v, kp, vp), do)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for name, g, r in zip(("q", "k", "v", "k_past", "v_past"), grads, ref_grads):
      if t == 1 and name != "v":  # One position: out = v exactly, nothing else matters.
        np.testing.assert_array_equal(g, 0.0)
      else:
        self.assertGreater(float(jnp.abs(r).max()), 0.1, name)  # Not vacuous.
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=name)

  @parameterized.parameters(
    *[(fmt, "generic") for fmt in ("bf16", "fp8", "mxfp8", "nvfp4")],
    # TPU: the two formats with extra leaves per block (fp8 scale column, nvfp4 tensor scale);
    # the others dequantize through the same code as the generic cases (CPU time).
    ("fp8", "tpu"),
    ("nvfp4", "tpu"),
  )
  def test_packed_past_is_dequantized_in_kernel(self, fmt, variant):
    # The past packed per token by looped.kv_quant; the reference reads its kv_quant round trip.
    q, k, v, kp, vp, do = _inputs(2, 13, 4, 2, 32, seed=4)
    per_token = lambda fn: jax.jit(jax.vmap(jax.vmap(fn)))
    quantized = [per_token(lambda tok: kv_quant.quantize(tok, fmt))(x) for x in (kp, vp)]
    kp_read, vp_read = (per_token(kv_quant.dequantize)(x) for x in quantized)
    kp_packed, vp_packed = (PackedKV(x.data, x.scale, x.tensor_scale, fmt) for x in quantized)

    blocks = dict(block_q=8, block_k=4) if variant == "generic" else dict(block_q=8, block_k=8)

    def kernel(q, k, v, kp, vp):
      return shared_attention(q, k, v, kp, vp, **blocks, variant=variant, interpret=True)

    out, grads = _value_and_grads(kernel, (q, k, v, kp_packed, vp_packed), do)
    ref_out, ref_grads = _value_and_grads(
      reference.shared_attention, (q, k, v, kp_read, vp_read), do
    )
    self.assertGreater(float(jnp.abs(kp_read - kp).max()), 1e-3)  # The round trip is visible.
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for g, r in zip(grads[:3], ref_grads[:3]):
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
    for cotangent in jax.tree.leaves(grads[3:]):  # A packed past is a constant.
      if jnp.issubdtype(cotangent.dtype, jnp.floating):
        np.testing.assert_array_equal(cotangent.astype(jnp.float32), 0.0)

  def test_causal_with_past_as_own_is_causal_attention_and_grads_sum(self):
    # Passing the same arrays as own and past K/V: gradients of both uses must add up.
    q, k, v, _, _, do = _inputs(2, 11, 4, 2, 16, seed=1)
    # A non-default logit scale, and jax.nn's causal attention as an independent reference.
    kernel = lambda q, k, v: shared_attention(
      q, k, v, k, v, sm_scale=0.3, block_q=4, block_k=4, interpret=True
    )
    out, grads = _value_and_grads(kernel, (q, k, v), do)
    causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.3, is_causal=True)
    ref_out, ref_grads = _value_and_grads(causal, (q, k, v), do)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for g, r in zip(grads, ref_grads):
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)

  def test_bfloat16_forward(self):
    q, k, v, kp, vp, _ = _inputs(2, 21, 4, 2, 32, jnp.bfloat16, seed=2)
    out = shared_attention(q, k, v, kp, vp, block_q=8, block_k=8, interpret=True)
    self.assertEqual(out.dtype, jnp.bfloat16)
    ref_out = jax.jit(reference.shared_attention)(
      *(x.astype(jnp.float32) for x in (q, k, v, kp, vp))
    )
    np.testing.assert_allclose(out.astype(jnp.float32), ref_out, atol=2e-2, rtol=0)

  def test_reference_is_the_models_jacobi_attention(self):
    # LoopedLM's shared pass: past mask strictly causal, self mask the diagonal.
    q, k, v, kp, vp, _ = _inputs(2, 9, 4, 2, 8, seed=3)
    b, t = q.shape[:2]
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    strict = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool), -1), (b, t, t))
    model_out = jax.jit(attend)(q, k, v, eye, kp, vp, strict)
    ref_out = jax.jit(reference.shared_attention)(q, k, v, kp, vp)
    np.testing.assert_allclose(ref_out, model_out, atol=1e-6)

  def test_rejects_mismatched_shapes(self):
    q, k, v, kp, vp, _ = _inputs(1, 4, 3, 2, 8)
    with self.assertRaisesRegex(ValueError, "do not fit"):
      shared_attention(q, k, v, kp, vp, interpret=True)


def _block_masks(b, t, c):
  """Block prefill's reads, written out position by position: (past [B, T, T], own [B, T, T])."""
  past, own = np.zeros((t, t), bool), np.zeros((t, t), bool)
  for ti in range(t):
    start = ti // c * c
    past[ti, :start] = True
    own[ti, start : ti + 1] = True
  return (jnp.broadcast_to(x, (b, t, t)) for x in (past, own))


class BlockPrefillTest(parameterized.TestCase):
  """prefill_block C: t reads the past K/V at s < b(t) = (t // C) * C, its own K/V at
  b(t) <= s <= t. C 1 is the plain form; C >= T reads no past at all."""

  @parameterized.named_parameters(
    # name, B, T, Hq, Hkv, block_q, block_k, C, variant
    ("c1_is_plain", 2, 13, 4, 2, 8, 4, 1, "generic"),
    ("c4_divides_tiles", 2, 13, 4, 2, 8, 4, 4, "generic"),
    ("c2_divides_tiles_q4_k8", 1, 13, 2, 2, 4, 8, 2, "generic"),
    ("c3_not_a_divisor", 2, 13, 4, 2, 8, 4, 3, "generic"),
    ("c5_not_a_divisor_q4_k8", 1, 21, 4, 1, 4, 8, 5, "generic"),
    ("c_at_least_t", 1, 13, 4, 2, 8, 4, 16, "generic"),
    ("c12_spans_tiles", 1, 21, 2, 1, 4, 4, 12, "generic"),
    ("tpu_c5_q16_k8", 1, 21, 4, 2, 16, 8, 5, "tpu"),
    ("tpu_c4_q8_k16", 2, 21, 2, 2, 8, 16, 4, "tpu"),
    ("tpu_c_at_least_t", 1, 21, 4, 1, 8, 8, 32, "tpu"),
  )
  def test_forward_and_gradients_match_reference(self, b, t, hq, hkv, bq, bk, c, variant):
    q, k, v, kp, vp, do = _inputs(b, t, hq, hkv, 16, seed=5)
    kernel = lambda *a: shared_attention(
      *a, block_q=bq, block_k=bk, variant=variant, interpret=True, prefill_block=c
    )
    ref = lambda *a: reference.shared_attention(*a, prefill_block=c)
    out, grads = _value_and_grads(kernel, (q, k, v, kp, vp), do)
    ref_out, ref_grads = _value_and_grads(ref, (q, k, v, kp, vp), do)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for name, g, r in zip(("q", "k", "v", "k_past", "v_past"), grads, ref_grads):
      if c >= t and name in ("k_past", "v_past"):  # One block: the past is never read.
        np.testing.assert_array_equal(g, 0.0, err_msg=name)
      else:
        self.assertGreater(float(jnp.abs(r).max()), 0.1, name)  # Not vacuous.
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=name)
    if c == 1:  # C 1 is the plain form, the same kernels.
      plain = lambda *a: shared_attention(
        *a, block_q=bq, block_k=bk, variant=variant, interpret=True
      )
      plain_out, plain_grads = _value_and_grads(plain, (q, k, v, kp, vp), do)
      np.testing.assert_array_equal(out, plain_out)
      for g, p in zip(grads, plain_grads):
        np.testing.assert_array_equal(g, p)

  @parameterized.named_parameters(
    # name, T, C, variant, block_q, block_k
    ("c3", 13, 3, "generic", 8, 4),
    ("c8", 13, 8, "generic", 4, 4),
    ("c_at_least_t", 11, 11, "generic", 8, 8),
    ("tpu_c6", 13, 6, "tpu", 8, 8),
  )
  def test_matches_the_models_attention_with_block_masks(self, t, c, variant, bq, bk):
    # looped's block prefill: past [shared ; own] with masks [s < b(t) ; b(t) <= s < t] and
    # the diagonal as self mask (LoopedLM.block_masks, here also written out by hand).
    q, k, v, kp, vp, _ = _inputs(2, t, 4, 2, 8, seed=6)
    b = q.shape[0]
    past_mask, own_mask = _block_masks(b, t, c)
    eye = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    model_past, model_self = looped_lm.block_masks(t, b, c)
    np.testing.assert_array_equal(model_past, jnp.concatenate([past_mask, own_mask & ~eye], -1))
    np.testing.assert_array_equal(model_self, eye)
    projection = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)

    def model(q, k, v, kp, vp):
      past_k, past_v = (jnp.concatenate([x, y], axis=1) for x, y in ((kp, k), (vp, v)))
      return attend(q, k, v, model_self, past_k, past_v, model_past)

    def kernel(q, k, v, kp, vp):
      return shared_attention(
        q, k, v, kp, vp, block_q=bq, block_k=bk, variant=variant, interpret=True, prefill_block=c
      )

    loss = lambda fn: jax.jit(
      jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * projection), argnums=(0, 1, 2, 3, 4))
    )
    (model_loss, model_grads), (kernel_loss, kernel_grads) = (
      loss(fn)(q, k, v, kp, vp) for fn in (model, kernel)
    )
    np.testing.assert_allclose(kernel_loss, model_loss, atol=1e-4, rtol=0)
    np.testing.assert_allclose(
      jax.jit(kernel)(q, k, v, kp, vp), jax.jit(model)(q, k, v, kp, vp), atol=2e-6, rtol=0
    )
    for name, g, r in zip(("q", "k", "v", "k_past", "v_past"), kernel_grads, model_grads):
      if c < t:
        self.assertGreater(float(jnp.abs(r).max()), 0.1, name)
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=name)

  @parameterized.parameters(("fp8", "generic"), ("nvfp4", "tpu"))
  def test_packed_past(self, fmt, variant):
    # The past read through a KV format (a constant); own K/V gradients include the in-block
    # reads, which come from the key-tile kernel even though the past has none.
    q, k, v, kp, vp, do = _inputs(2, 13, 4, 2, 32, seed=8)
    per_token = lambda fn: jax.jit(jax.vmap(jax.vmap(fn)))
    quantized = [per_token(lambda tok: kv_quant.quantize(tok, fmt))(x) for x in (kp, vp)]
    kp_read, vp_read = (per_token(kv_quant.dequantize)(x) for x in quantized)
    kp_packed, vp_packed = (PackedKV(x.data, x.scale, x.tensor_scale, fmt) for x in quantized)

    def kernel(q, k, v, kp, vp):
      return shared_attention(
        q, k, v, kp, vp, block_q=8, block_k=8, variant=variant, interpret=True, prefill_block=5
      )

    ref = lambda *a: reference.shared_attention(*a, prefill_block=5)
    out, grads = _value_and_grads(kernel, (q, k, v, kp_packed, vp_packed), do)
    ref_out, ref_grads = _value_and_grads(ref, (q, k, v, kp_read, vp_read), do)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for g, r in zip(grads[:3], ref_grads[:3]):
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
    for cotangent in jax.tree.leaves(grads[3:]):
      if jnp.issubdtype(cotangent.dtype, jnp.floating):
        np.testing.assert_array_equal(cotangent.astype(jnp.float32), 0.0)

  def test_past_as_own_is_causal_attention(self):
    # Whatever the blocks, reading the own K/V as past is ordinary causal attention.
    q, k, v, _, _, do = _inputs(1, 13, 2, 1, 16, seed=9)
    kernel = lambda q, k, v: shared_attention(
      q, k, v, k, v, block_q=4, block_k=8, interpret=True, prefill_block=3
    )
    causal = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    out, grads = _value_and_grads(kernel, (q, k, v), do)
    ref_out, ref_grads = _value_and_grads(causal, (q, k, v), do)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for g, r in zip(grads, ref_grads):
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)

  def test_rejects_a_block_below_one(self):
    q, k, v, kp, vp, _ = _inputs(1, 4, 2, 2, 8)
    with self.assertRaisesRegex(ValueError, "prefill_block"):
      shared_attention(q, k, v, kp, vp, interpret=True, prefill_block=0)


class SegmentIdsTest(parameterized.TestCase):
  """Document masking: t reads only positions s (past and own) with t's segment id."""

  @parameterized.named_parameters(
    # name, B, T, Hq, Hkv, block_q, block_k, C (None: plain form), variant
    ("plain", 2, 13, 4, 2, 8, 4, None, "generic"),
    ("block_c3_q4_k8", 2, 13, 4, 2, 4, 8, 3, "generic"),
    ("tpu_plain_q16_k8", 1, 21, 4, 2, 16, 8, None, "tpu"),
    ("tpu_c5_q8_k16", 2, 21, 2, 2, 8, 16, 5, "tpu"),
  )
  def test_forward_and_gradients_match_reference(self, b, t, hq, hkv, bq, bk, c, variant):
    q, k, v, kp, vp, do = _inputs(b, t, hq, hkv, 16, seed=7)
    rng = np.random.default_rng(t)
    seg = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), axis=1), jnp.int32)
    kernel = lambda *a: shared_attention(
      *a,
      block_q=bq,
      block_k=bk,
      variant=variant,
      interpret=True,
      prefill_block=c,
      segment_ids_BxT=seg,
    )
    ref = lambda *a: reference.shared_attention(*a, prefill_block=c, segment_ids_BxT=seg)
    out, grads = _value_and_grads(kernel, (q, k, v, kp, vp), do)
    ref_out, ref_grads = _value_and_grads(ref, (q, k, v, kp, vp), do)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for name, g, r in zip(("q", "k", "v", "k_past", "v_past"), grads, ref_grads):
      self.assertGreater(float(jnp.abs(r).max()), 0.1, name)  # Not vacuous.
      np.testing.assert_allclose(g, r, atol=1e-5, rtol=0, err_msg=name)
    unmasked = reference.shared_attention(q, k, v, kp, vp, prefill_block=c)
    self.assertGreater(float(jnp.abs(unmasked - out).max()), 0.1)  # The ids matter.
    if c is None:  # Independently: each document attended alone, at its own positions.
      seg_np = np.asarray(seg)
      for row in range(b):
        for doc in np.unique(seg_np[row]):
          cols = np.flatnonzero(seg_np[row] == doc)
          part = lambda x, cols=cols, row=row: x[row : row + 1, cols[0] : cols[-1] + 1]
          alone = reference.shared_attention(*map(part, (q, k, v, kp, vp)))
          np.testing.assert_allclose(part(out), alone, atol=2e-6, rtol=0)

  def test_rejects_segment_ids_of_another_shape(self):
    q, k, v, kp, vp, _ = _inputs(1, 5, 2, 1, 8)
    with self.assertRaisesRegex(ValueError, r"segment_ids has shape \(1, 4\), expected \(1, 5\)"):
      shared_attention(q, k, v, kp, vp, segment_ids_BxT=jnp.zeros((1, 4), jnp.int32))


if __name__ == "__main__":
  absltest.main()
