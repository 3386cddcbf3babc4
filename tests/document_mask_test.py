"""Document masking (segment ids, data.document_mask) in the model, against each document alone.

Two documents are packed into one row, A (positions 0..4) then B (5..9), with segment ids
[0, ..., 0, 1, ..., 1]. The reference is B run on its own, a separate, unmasked call at positions
0..4: with masking, B's logits in the packed row equal it (RoPE scores depend on relative
positions only, and the default h_0's noise, state_init='like_init', is keyed by the position
within the document) in the parallel forward, in exact shared decode (`decode_forward`,
sharing.py) and in the Jacobi form (T - 1 shared passes), for every mixer: a GQA model and a
hybrid (KDA prelude, KDA:MLA core, MLA coda: KDA and MLA each both looped and plain). The same
packed row as one document (segment ids all 0, which the row without segment ids equals) must
give other logits in every form, so each comparison can fail. Gradients of B's loss are compared
with the reference's the same way, and the model with `attention_impl='pallas'` (the
shared-attention kernel reading segment ids, interpret mode) against the same reference in its
parallel and Jacobi forms.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.losses import token_cross_entropy
from looped.model import LoopedLM
from looped.model.sharing import decode_forward, jacobi_forward

A, B = 5, 5  # Document lengths; B starts at position 5.
# Small programs (CI time): R = 3 in a scan of one recurrence per step. Two models hold every
# mixer (one model per mixer would double this file's compile time).
_DIMS = dict(mla_kv_rank=16, mla_rope_dim=4, state_init="like_init", scan_unroll=1)
MODELS = {
  "gqa": dict(num_core_layers=1),
  # KDA chunks of 4: B starts inside the second chunk, whose start state holds A.
  "hybrid": dict(
    prelude_mixers=("kda",), core_mixers=("kda", "mla"), coda_mixers=("mla",), kda_chunk_size=4
  ),
}


def _cfg(name, **overrides):
  return dataclasses.replace(testing.TINY_MODEL, **{**_DIMS, **MODELS[name], **overrides})


def _rows(vocab):
  doc_a = jax.random.randint(jax.random.PRNGKey(1), (2, A), 0, vocab)
  doc_b = jax.random.randint(jax.random.PRNGKey(2), (2, B + 1), 0, vocab)  # + B's last target.
  packed = jnp.concatenate([doc_a, doc_b[:, :-1]], axis=1)
  segments = jnp.concatenate([jnp.zeros((2, A), jnp.int32), jnp.ones((2, B), jnp.int32)], axis=1)
  return packed, segments, doc_b[:, :-1], doc_b[:, 1:]


@functools.cache
def _forms(cfg):
  """Jitted (parallel, exact shared decode, T - 1 Jacobi passes) logits of a row."""
  model = LoopedLM(cfg)

  def forms(params, tokens_BxT, segments_BxT):
    seg = dict(segment_ids_BxT=segments_BxT)
    parallel, _ = model.apply(params, tokens_BxT, **seg)
    decode, _ = decode_forward(model, params, tokens_BxT, share_kv=True, **seg)
    jacobi, _ = jacobi_forward(model, params, tokens_BxT, tokens_BxT.shape[1] - 1, **seg)
    return parallel, decode, jacobi

  return jax.jit(forms)


class DocumentMaskTest(parameterized.TestCase):
  @parameterized.parameters(*MODELS)
  def test_a_document_does_not_see_the_one_packed_before_it(self, name):
    cfg = _cfg(name)
    params = testing.random_params(cfg, tokens_shape=(2, A + B))
    packed, segments, doc_b, _ = _rows(cfg.vocab_size)
    forms = _forms(cfg)
    alone = forms(params, doc_b, None)
    masked = forms(params, packed, segments)
    unmasked = forms(params, packed, jnp.zeros_like(segments))  # One document: no masking.
    for form, want, got, off in zip(("parallel", "decode", "jacobi"), alone, masked, unmasked):
      np.testing.assert_allclose(got[:, A:], want, atol=1e-5, rtol=1e-5, err_msg=form)
      # Unmasked, B attends into A: the comparison above can fail.
      self.assertGreater(float(jnp.max(jnp.abs(off[:, A:] - want))), 1e-2, form)
    # Shared reads do change B's logits (the decode and Jacobi comparisons test sharing).
    self.assertGreater(float(jnp.max(jnp.abs(alone[1] - alone[0]))), 1e-4)
    # Ids all 0 are the row without segment ids (data.document_mask off).
    no_ids, _ = jax.jit(LoopedLM(cfg).apply)(params, packed)
    np.testing.assert_allclose(unmasked[0], no_ids, atol=1e-5, rtol=1e-5)

  def test_gradients_equal_the_document_alone(self):
    cfg = _cfg("hybrid")
    model = LoopedLM(cfg)
    params = testing.random_params(cfg, tokens_shape=(2, A + B))
    packed, segments, doc_b, targets_b = _rows(cfg.vocab_size)

    def loss(params, tokens, segments, start):
      logits, _ = model.apply(params, tokens, segment_ids_BxT=segments)
      return jnp.sum(token_cross_entropy(logits[:, start:], targets_b))

    grads = jax.jit(jax.grad(loss), static_argnums=3)
    want = grads(params, doc_b, None, 0)
    got = grads(params, packed, segments, A)
    off = grads(params, packed, jnp.zeros_like(segments), A)  # One document: no masking.
    differ = 0.0
    for (path, g), w, o in zip(*map(jax.tree.leaves_with_path, (got, want, off))):
      scale = float(jnp.max(jnp.abs(w[1]))) + 1e-6
      np.testing.assert_allclose(g, w[1], atol=1e-5 * scale, rtol=1e-4, err_msg=str(path))
      differ = max(differ, float(jnp.max(jnp.abs(o[1] - w[1]))) / scale)
    self.assertGreater(differ, 1e-2)  # Unmasked, A changes B's gradients.

  def test_pallas_shared_attention_reads_segment_ids(self):
    cfg = _cfg("gqa")
    params = testing.random_params(cfg, tokens_shape=(2, A + B))
    packed, segments, doc_b, _ = _rows(cfg.vocab_size)
    model = LoopedLM(dataclasses.replace(cfg, attention_impl="pallas"))
    forms = jax.jit(
      lambda p, x, s: (
        model.apply(p, x, segment_ids_BxT=s)[0],
        jacobi_forward(model, p, x, x.shape[1] - 1, segment_ids_BxT=s)[0],
      )
    )
    alone = _forms(cfg)(params, doc_b, None)
    masked = forms(params, packed, segments)
    for want, got in zip(alone, masked):
      np.testing.assert_allclose(got[:, A:], want, atol=1e-5, rtol=1e-5)
    off = forms(params, packed, jnp.zeros_like(segments))[0]
    self.assertGreater(float(jnp.max(jnp.abs(off[:, A:] - alone[0]))), 1e-2)


if __name__ == "__main__":
  absltest.main()
