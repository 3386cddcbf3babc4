"""Per-token losses shared by training and evaluation, so the evaluation's perplexity is the
training objective's cross-entropy by construction (and evaluation needs no trainer import)."""

import jax
import jax.numpy as jnp
import optax


def token_cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
  """Per-token cross-entropy in nats, float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
    logits_BxTxV.astype(jnp.float32), targets_BxT
  )


def chunked_cross_entropy(
  x_NxD: jax.Array, head_DxV: jax.Array, targets_N: jax.Array, chunk: int
) -> jax.Array:
  """Per-token cross-entropy in nats (float32) of the logits x @ head, never all of them at once.

  The vocabulary is walked in chunks of `chunk` ids with an online log-sum-exp (float32
  products, as the model's head in float32; in bfloat16 the head rounds its logits, this does
  not), and each chunk's logits are recomputed in the backward (jax.checkpoint), so memory holds
  one [N, chunk] block, not [N, V]. The last chunk is padded with ids that score -inf.
  """
  d, v = head_DxV.shape
  num_chunks = -(-v // chunk)
  head_CxDxK = jnp.pad(head_DxV, ((0, 0), (0, num_chunks * chunk - v)))
  head_CxDxK = head_CxDxK.reshape(d, num_chunks, chunk).transpose(1, 0, 2)

  @jax.checkpoint
  def body(carry, xs):
    max_N, sum_N, target_N = carry
    w_DxK, start = xs
    ids_K = start + jnp.arange(chunk)
    logits_NxK = jnp.dot(x_NxD, w_DxK, preferred_element_type=jnp.float32)
    logits_NxK = jnp.where(ids_K[None, :] < v, logits_NxK, -jnp.inf)
    # The running max only keeps exp() in range; the log-sum-exp does not depend on it.
    new_max_N = jax.lax.stop_gradient(jnp.maximum(max_N, jnp.max(logits_NxK, axis=-1)))
    sum_N = sum_N * jnp.exp(max_N - new_max_N)
    sum_N = sum_N + jnp.sum(jnp.exp(logits_NxK - new_max_N[:, None]), axis=-1)
    hit_NxK = ids_K[None, :] == targets_N[:, None]
    target_N = target_N + jnp.sum(jnp.where(hit_NxK, logits_NxK, 0.0), axis=-1)
    return (new_max_N, sum_N, target_N), None

  n = x_NxD.shape[0]
  init = (jnp.full((n,), -jnp.inf), jnp.zeros((n,)), jnp.zeros((n,)))
  starts = jnp.arange(num_chunks, dtype=jnp.int32) * chunk
  (max_N, sum_N, target_N), _ = jax.lax.scan(body, init, (head_CxDxK, starts))
  return max_N + jnp.log(sum_N) - target_N
