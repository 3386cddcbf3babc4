"""model.attention_impl='pallas' (interpret mode on CPU) against the XLA attention.

Same params, same inputs: a BeNice! training step (loss, metrics and gradients of the causal
forward and a shared pass, with a Jacobi pass building the broadcast K/V), Jacobi passes, and the
exact shared decode, raw and through packed KV formats (dequantized in the kernel).

Through a KV format, the two paths are compared on identical quantized inputs (a cache or a
broadcast K/V built once), not over whole quantized runs: there a ~1e-7 float32 difference in a
K/V value that sits on a rounding boundary flips its stored code, and later tokens inherit a
~1e-4 change. The XLA path does the same to itself: its own params scaled by 1 + 3e-7 noise move
its 2-pass mxfp8 Jacobi logits by 5e-4 here (raw K/V: 5e-6).
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
from looped.benice import objectives
from looped.model import LoopedLM, init_cache
from looped.model.sharing import decode_forward, jacobi_forward

TINY = testing.TINY_MODEL  # Prelude, core and coda layers (for decode: their own caches).
# Core only (interpret-mode kernels compile per layer), head_dim 32: a multiple of the mx (32)
# and nvfp4 (16) blocks, for the KV-format cases.
CORE_ONLY = dataclasses.replace(TINY, num_prelude_layers=0, num_core_layers=1, num_coda_layers=0)
WIDE_HEADS = dataclasses.replace(CORE_ONLY, head_dim=32)


@functools.cache
def _setup(cfg=TINY, batch=2, length=7):
  tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, length + 1), 0, cfg.vocab_size)
  params = {"params": jax.jit(LoopedLM(cfg).init)(jax.random.PRNGKey(0), tokens[:, :-1])["params"]}
  return params, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def _models(cfg):
  return LoopedLM(cfg), LoopedLM(dataclasses.replace(cfg, attention_impl="pallas"))


class AttentionImplTest(parameterized.TestCase):
  def test_benice_training_step(self):
    # Shared CE + unshared CE + residual matching, broadcast K/V after one Jacobi pass: the
    # causal forward, a Jacobi pass and a shared pass, and the gradient through two of them.
    params, batch = _setup(CORE_ONLY)
    depth = ml_collections.ConfigDict(
      {"sampler": "fixed", "poisson_mean": 2.0, "survival": 0.7, "backprop_recurrences": 0}
    )
    benice_cfg = ml_collections.ConfigDict(
      {
        "read_recurrences": "all",
        "shared_ce_weight": 1.0,
        "unshared_ce_weight": 1.0,
        "kl_weight": 0.0,
        "kl_pass": "shared",
        "residual_weight": 0.5,
        "kv_passes": 1,
      }
    )
    key = jax.random.PRNGKey(3)
    results = []
    for model in _models(CORE_ONLY):
      loss_fn = objectives.benice(model, depth, benice_cfg).loss_fn
      step = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
      results.append(step(params, None, batch, key))
    ((loss_x, metrics_x), grads_x), ((loss_p, metrics_p), grads_p) = results
    self.assertGreater(abs(float(metrics_x["shared_gap"])), 1e-3)  # Sharing changes outputs.
    np.testing.assert_allclose(loss_p, loss_x, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(metrics_p, metrics_x, atol=1e-5, rtol=0)
    chex.assert_trees_all_close(grads_p, grads_x, atol=1e-5, rtol=0)

  def test_exact_shared_decode_matches_xla(self):
    # A 2-token prefill chunk, then token by token; prelude, core (shared) and coda caches.
    params, batch = _setup()
    logits = [
      jax.jit(lambda p, x, model=model: decode_forward(model, p, x, share_kv=True, prefill=2)[0])(
        params, batch["inputs"]
      )
      for model in _models(TINY)
    ]
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=0)

  @parameterized.named_parameters(
    ("shared_fp8", True, "fp8", 1),
    ("unshared_nvfp4", False, "nvfp4", 1),
  )
  def test_decode_step_on_packed_cache_matches_xla(self, share, kv_format, chunk):
    # One decode step on the same packed cache, filled by the XLA path. (A whole
    # decode_forward is not compared: both impls write their own K/V to the cache, and a 1e-7
    # difference that crosses an fp8 rounding boundary grows over later tokens.)
    params, batch = _setup(WIDE_HEADS)
    tokens = batch["inputs"]
    b, t = tokens.shape
    xla, pallas = _models(WIDE_HEADS)
    cache = init_cache(WIDE_HEADS, b, t, share, kv_format=kv_format)
    cache = jax.jit(lambda p, x, c: xla.apply(p, x, cache=c)[1]["cache"])(
      params, tokens[:, : t - chunk], cache
    )
    step = lambda model: jax.jit(lambda p, x, c: model.apply(p, x, cache=c)[0])
    logits_x = step(xla)(params, tokens[:, t - chunk :], cache)
    logits_p = step(pallas)(params, tokens[:, t - chunk :], cache)
    np.testing.assert_allclose(logits_p, logits_x, atol=1e-5, rtol=0)

  def test_a_chunk_on_a_packed_cache_needs_xla(self):
    # A chunk reads its own earlier tokens through the cache's format (as one token at a time
    # would), which paged_decode does not do.
    params, batch = _setup(WIDE_HEADS)
    tokens = batch["inputs"]
    _, pallas = _models(WIDE_HEADS)
    cache = init_cache(WIDE_HEADS, tokens.shape[0], tokens.shape[1], False, kv_format="nvfp4")
    with self.assertRaisesRegex(ValueError, "one token at a time"):
      jax.eval_shape(lambda p, c: pallas.apply(p, tokens[:, :2], cache=c), params, cache)

  def test_jacobi_passes_match_xla(self):
    params, batch = _setup(CORE_ONLY)
    logits = [
      jax.jit(lambda p, x, model=model: jacobi_forward(model, p, x, 2)[0])(params, batch["inputs"])
      for model in _models(CORE_ONLY)
    ]
    np.testing.assert_allclose(logits[1], logits[0], atol=1e-5, rtol=0)

  def test_quantized_shared_pass_matches_xla(self):
    # One shared pass reading a broadcast K/V through the mxfp8 round trip (first recurrence
    # only: the others read their own K/V through it, the unshared quantized path).
    params, batch = _setup(WIDE_HEADS)
    xla, pallas = _models(WIDE_HEADS)
    tokens = batch["inputs"]
    kv = jax.jit(lambda p, x: xla.apply(p, x)[1]["final_kv"])(params, tokens)
    read_R = objectives.read_mask_R("first", WIDE_HEADS.num_recurrences)
    shared_pass = lambda model: jax.jit(
      lambda p, x, kv: model.apply(p, x, shared_kv=kv, read_shared_R=read_R, kv_format="mxfp8")[0]
    )
    logits_x = shared_pass(xla)(params, tokens, kv)
    logits_p = shared_pass(pallas)(params, tokens, kv)
    np.testing.assert_allclose(logits_p, logits_x, atol=1e-5, rtol=0)

  def test_block_prefill_jacobi_matches_xla(self):
    # Block prefill passes (C 3 on 7 tokens: blocks 3, 3, 1; two passes reach block prefill
    # exactly): logits and the parameter gradients of a loss through every pass.
    params, batch = _setup()
    tokens, targets = batch["inputs"], batch["targets"]

    def loss(model, block):
      def fn(p):
        logits, _ = jacobi_forward(model, p, tokens, 2, prefill_block=block)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)), logits

      return jax.jit(jax.value_and_grad(fn, has_aux=True))

    xla, pallas = _models(TINY)
    self.assertIn("pallas_call", str(jax.make_jaxpr(lambda p: loss(pallas, 3)(p))(params)))
    (loss_x, logits_x), grads_x = loss(xla, 3)(params)
    (loss_p, logits_p), grads_p = loss(pallas, 3)(params)
    plain_logits, _ = jax.jit(lambda p: jacobi_forward(xla, p, tokens, 2))(params)
    self.assertGreater(float(jnp.abs(plain_logits - logits_x).max()), 1e-3)  # Blocks matter.
    np.testing.assert_allclose(logits_p, logits_x, atol=1e-5, rtol=0)
    np.testing.assert_allclose(loss_p, loss_x, atol=1e-6, rtol=0)
    chex.assert_trees_all_close(grads_p, grads_x, atol=1e-5, rtol=0)

  def test_block_prefill_through_a_kv_format_needs_xla(self):
    params, batch = _setup(CORE_ONLY)
    _, pallas = _models(CORE_ONLY)
    tokens = batch["inputs"]
    kv = jax.eval_shape(lambda p: pallas.apply(p, tokens)[1]["final_kv"], params)
    with self.assertRaisesRegex(ValueError, "block prefill reads raw K/V"):
      jax.eval_shape(
        lambda p, kv: pallas.apply(p, tokens, shared_kv=kv, kv_format="fp8", prefill_block=2),
        params,
        kv,
      )


if __name__ == "__main__":
  absltest.main()
