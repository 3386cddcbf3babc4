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
