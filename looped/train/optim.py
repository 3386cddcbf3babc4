"""AdamW with linear warmup and cosine decay, global-norm clipping, decay on matrices only."""

from __future__ import annotations

import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=train_cfg.learning_rate,
    warmup_steps=train_cfg.warmup_steps,
    decay_steps=max(train_cfg.num_steps, train_cfg.warmup_steps + 1),
    end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio,
  )


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  # Norm scales, injection decay rates and other vectors are not weight-decayed, nor a fixed
  # RoPE table (model.rope_table: it gets no gradient, so decay alone would move it).
  fixed = lambda path: any(getattr(k, "key", None) == "rope_table" for k in path)
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
    lambda path, p: p.ndim >= 2 and not fixed(path), params
  )
  chain = []
  if train_cfg.grad_clip > 0:
    chain.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  chain.append(
    optax.adamw(
      learning_rate_schedule(train_cfg),
      b1=train_cfg.b1,
      b2=train_cfg.b2,
      weight_decay=train_cfg.weight_decay,
      mask=decay_mask,
    )
  )
  return optax.chain(*chain)
