"""KV-shareability of one set of params on held-out data (DESIGN.md §3).

Definitions (all at full depth R, next-token perplexities = exp(mean CE in nats)):
  ppl_unshared         ordinary forward over the whole eval set.
  ppl_shared_jacobi[n] n Jacobi shared passes (every recurrence reads the previous pass's final
                       K/V for s < t), whole eval set; n = T - 1 equals exact shared decode.
  ppl_shared           exact shared decode, token by token through a shared cache
                       (`decode_forward(share_kv=True)`), on a fixed subset: the first
                       `decode_batches` eval batches (sequential, hence the subset).
  gap                  ppl_shared / ppl_unshared - 1, both on the decode subset, so the two
                       perplexities are over the same tokens; gap_jacobi[n] likewise on the
                       whole eval set.
  residual_norms       mean over tokens of ||h_r - h_{r-1}||, r = 1..R (h_0: the initial
                       state), unshared forward; relative_residuals divide by ||h_r||.
  contraction_ratios   residual_norms[r] / residual_norms[r-1], r = 2..R: < 1 means the
                       recurrence contracts towards a common limit.
  kv_bytes_per_token   KV-cache bytes one token takes, shared and unshared layouts, in the
                       evaluated KV format (bf16 when none): GQA and MLA layers.
  cache_bytes          the same per mixer, plus KDA layers' state bytes per sequence
                       (looped.model.mixers.cache_bytes).
With a `kv_format` (looped.kv_quant.FORMATS) every read of an earlier position's K/V, in every
forward above (unshared included), goes through that format's per-token quantize/dequantize,
and exact decode stores the packed bytes in its cache.

One compilation serves every Jacobi pass count (the count is a traced argument; 0 passes is
the unshared forward), and the decode subset reuses the eval batches' shapes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from looped.model import mixers
from looped.model.config import ModelConfig
from looped.model.looped_lm import LoopedLM
from looped.model.sharing import decode_forward, jacobi_forward
from looped.train.objectives import token_cross_entropy

KV_FORMAT = "bf16"  # The cache format the byte counts assume when none is evaluated.


class StatsFns(NamedTuple):
  jacobi: Callable  # (params, inputs, targets, num_passes) -> (ce_sum, residual_R, relative_R)
  decode: Callable  # (params, inputs, targets) -> ce_sum of exact shared decode


@functools.lru_cache(maxsize=16)
def make_stats_fns(cfg: ModelConfig, kv_format: str | None = None) -> StatsFns:
  """Jitted per-batch statistics; cached per model config, so repeated evaluations in one
  process (several models, several pipeline runs) compile once."""
  model = LoopedLM(cfg)

  def jacobi(params, inputs_BxT, targets_BxT, num_passes):
    logits, aux = jacobi_forward(model, params, inputs_BxT, num_passes, kv_format=kv_format)
    ce_sum = jnp.sum(token_cross_entropy(logits, targets_BxT))
    return ce_sum, aux["residual_norm_R"], aux["relative_residual_R"]

  def decode(params, inputs_BxT, targets_BxT):
    logits, _ = decode_forward(model, params, inputs_BxT, share_kv=True, kv_format=kv_format)
    return jnp.sum(token_cross_entropy(logits, targets_BxT))

  return StatsFns(jax.jit(jacobi), jax.jit(decode))


def kv_bytes_per_token(cfg: ModelConfig, kv_format: str | None = None) -> dict:
  return cache_bytes(cfg, kv_format)["per_token"]


def cache_bytes(cfg: ModelConfig, kv_format: str | None = None) -> dict:
  return mixers.cache_bytes(cfg, kv_format or KV_FORMAT)


def contraction_ratios(residual_norms_R) -> list[float]:
  r = np.asarray(residual_norms_R, np.float64)
  return (r[1:] / np.maximum(r[:-1], 1e-30)).tolist()


def _ppl(ce_sum: float, count: int) -> float:
  return math.exp(ce_sum / count)


def evaluate(
  fns: StatsFns,
  model_cfg: ModelConfig,
  params,
  eval_batches: list[dict],
  jacobi_passes: tuple[int, ...],
  decode_batches: int,
  kv_format: str | None = None,
) -> dict:
  """Shareability metrics (module docstring) of `params`; JSON-ready (pass counts as str)."""
  passes = sorted({0, *(int(n) for n in jacobi_passes)})
  ce = {n: 0.0 for n in passes}  # Whole eval set.
  ce_subset = {n: 0.0 for n in passes}  # Decode subset.
  ce_decode = 0.0
  residual_R, relative_R = 0.0, 0.0
  count, count_subset = 0, 0
  for i, batch in enumerate(eval_batches):
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    in_subset = i < decode_batches
    for n in passes:
      ce_sum, res_R, rel_R = fns.jacobi(params, inputs, targets, jnp.int32(n))
      ce[n] += float(ce_sum)
      if in_subset:
        ce_subset[n] += float(ce_sum)
      if n == 0:
        residual_R = residual_R + np.asarray(res_R, np.float64)
        relative_R = relative_R + np.asarray(rel_R, np.float64)
    count += targets.size
    if in_subset:
      ce_decode += float(fns.decode(params, inputs, targets))
      count_subset += targets.size
  num = len(eval_batches)
  ppl_un = _ppl(ce[0], count)
  jacobi = {str(n): _ppl(ce[n], count) for n in passes if n}
  sub_un = _ppl(ce_subset[0], count_subset)
  sub_shared = _ppl(ce_decode, count_subset)
  residual_norms = (residual_R / num).tolist()
  return {
    "ppl_unshared": ppl_un,
    "ppl_shared": sub_shared,
    "ppl_shared_jacobi": jacobi,
    "gap": sub_shared / sub_un - 1.0,
    "gap_jacobi": {n: p / ppl_un - 1.0 for n, p in jacobi.items()},
    "decode_subset": {
      "rows": int(sum(b["inputs"].shape[0] for b in eval_batches[:decode_batches])),
      "tokens": count_subset,
      "ppl_unshared": sub_un,
      "ppl_shared": sub_shared,
      "ppl_shared_jacobi": {str(n): _ppl(ce_subset[n], count_subset) for n in passes if n},
    },
    "residual_norms": residual_norms,
    "relative_residuals": (relative_R / num).tolist(),
    "contraction_ratios": contraction_ratios(residual_norms),
    "kv_bytes_per_token": kv_bytes_per_token(model_cfg, kv_format),
    "cache_bytes": cache_bytes(model_cfg, kv_format),
    "eval_tokens": count,
  }
