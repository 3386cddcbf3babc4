"""KV-shareability of one set of params on held-out data (docs/design.md §3).

Every perplexity is named by the tokens it covers, and every gap is the ratio of two
perplexities over the same tokens (all at full depth R; ppl = exp(mean next-token CE in nats)):
  ppl_unshared_eval          ordinary forward over the whole eval set.
  ppl_shared_jacobi_eval[n]  n Jacobi shared passes (every recurrence reads the previous pass's
                             final K/V for s < t), whole eval set; n = T - 1 equals exact decode.
  gap_jacobi_eval[n]         ppl_shared_jacobi_eval[n] / ppl_unshared_eval - 1.
  ppl_unshared_subset        ordinary forward on the decode subset: the first `decode_batches`
                             eval batches (0: all of them, the default).
  ppl_shared_exact_subset    exact shared decode, token by token through a shared cache
                             (`decode_forward(share_kv=True)`), on the decode subset.
  ppl_shared_jacobi_subset[n] Jacobi passes on the decode subset.
  gap_exact                  ppl_shared_exact_subset / ppl_unshared_subset - 1.
  ppl_shared_block_subset[C] block prefill with blocks of C tokens aligned from position 0
                             (`decode_forward(share_kv=True, block=C)`), on the decode subset:
                             recurrence r of a token reads the cached final K/V of every token
                             before its block and the recurrence-r K/V of its block's earlier
                             tokens and itself. C = 1 is exact shared decode (gap_exact); C >= T
                             is the unshared forward.
  gap_block[C]               ppl_shared_block_subset[C] / ppl_unshared_subset - 1.
  *_ci95                     95% bootstrap interval of a gap: rows resampled with replacement,
                             shared and unshared paired on the same rows (`BOOTSTRAP_SAMPLES`).
  kv_drift                   {'k', 'v'}: per core layer, per recurrence r = 1..R,
                             ||K_r - K_R|| / ||K_R|| over the decode subset (unshared forward):
                             how far earlier recurrences' keys/values are from the final ones
                             that sharing substitutes for them. For other mixers 'k'/'v' are the
                             layer's two cached entries: MLA latent / RoPE key, KDA state (at
                             the last position) / conv tail.
  residual_norms             mean over tokens of ||h_r - h_{r-1}||, r = 1..R (h_0: the initial
                             state), unshared forward; relative_residuals divide by ||h_r||.
  contraction_ratios         residual_norms[r] / residual_norms[r-1], r = 2..R: < 1 means the
                             recurrence contracts towards a common limit.
  kv_bytes_per_token         KV-cache bytes one token takes, shared (under kv_policy) and
                             unshared layouts, in the evaluated KV format (bf16 when none): GQA
                             and MLA layers.
  cache_bytes                the same per mixer, plus KDA layers' state bytes per sequence
                             (looped.model.mixers.cache_bytes).
  kv_policy                  the KV-sharing policy every shared metric above reads by
                             (looped/model/kv_policy.py; 'final', the default: the final
                             recurrence's K/V).
  kv_policies                {policy: {reads, cached, kv_bytes_per_token, ppl_shared_exact_subset,
                             gap_exact, gap_exact_ci95}} for each extra policy asked for: exact
                             shared decode on the decode subset under that policy, its gap vs
                             ppl_unshared_subset with its interval, c(r) for r = 1..R, the cached
                             recurrences and the shared layout's bytes per token.
  depth                      with an exit criterion (docs/design.md §3, "Depth at test time"):
                             its settings, and for 'shared' and 'unshared' exact token-by-token
                             decode with exits on the decode subset: ppl_exact_subset,
                             gap_vs_full_depth (against the same layout's exact decode at full
                             depth: ppl_shared_exact_subset, ppl_unshared_subset) with its
                             ci95, mean_recurrences per token with its ci95 (rows resampled).
With a `kv_format` (looped.kv_quant.FORMATS) every read of an earlier position's K/V, in every
forward above (unshared included), goes through that format's per-token quantize/dequantize,
and exact decode stores the packed bytes in its cache.

Every Jacobi pass count comes from one chain of passes: pass n + 1 reads pass n's final K/V,
so the CE after passes 0 (the unshared forward), 1, ..., max is taken along a single scan
instead of rerunning the chain per count. A KV format's evaluation (`jacobi_passes=()`,
`drift=False`) takes only what its table reports: the unshared forward and exact decode.
Exact decode runs on `decode_rows` rows at a time (0: the whole subset in one call), since a
token-by-token scan is cheaper per token on a wider batch: on 2 CPU cores all 128
default eval rows in one call take about as long as 2 batches of 16 one after the other.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from looped.losses import token_cross_entropy
from looped.model import adaptive, mixers
from looped.model import kv_policy as kv_policy_lib
from looped.model.config import ModelConfig
from looped.model.kda import KDAState
from looped.model.kv_cache import init_cache
from looped.model.looped_lm import LoopedLM
from looped.model.sharing import decode_forward, jacobi_forward, shared_pass

KV_FORMAT = "bf16"  # The cache format the byte counts assume when none is evaluated.


BOOTSTRAP_SAMPLES = 2000  # Resamples for every gap's 95% interval.
METRICS_VERSION = 3  # Bumped when the metrics change, so cached evaluations are recomputed.
# Version 3's metrics gained 'kv_policy' and 'kv_policies' without a bump: the old ones are
# unchanged, and a report reads a missing 'kv_policies' as none asked for.


class StatsFns(NamedTuple):
  """`segments` is the rows' segment ids (document masking) or None."""

  jacobi: Callable  # (params, inputs, targets, segments, max_passes) -> (ce_IxB, res_R, rel_R)
  decode: Callable  # (params, inputs, targets, segments) -> ce_B of exact shared decode
  drift: Callable  # (params, inputs, segments) -> squared norms (dk, dv [layer, R]; k, v [layer])
  block: Callable  # (params, inputs, targets, segments, C) -> ce_B of block prefill (C static)


@functools.lru_cache(maxsize=32)
def make_stats_fns(
  cfg: ModelConfig, kv_format: str | None = None, kv_policy: str = kv_policy_lib.FINAL
) -> StatsFns:
  """Jitted per-batch statistics (CE summed per row); cached per model config, so repeated
  evaluations in one process (several models, several pipeline runs) compile once. Every
  shared read follows kv_policy (looped/model/kv_policy.py)."""
  model = LoopedLM(cfg)
  policy = {} if kv_policy == kv_policy_lib.FINAL else {"kv_policy": kv_policy}

  def jacobi(params, inputs_BxT, targets_BxT, segments_BxT, max_passes):
    """Row CE after 0, 1, ..., max_passes shared passes (I = max_passes + 1 rows)."""
    ce = lambda logits: jnp.sum(token_cross_entropy(logits, targets_BxT), axis=1)
    kw = dict(kv_format=kv_format, segment_ids_BxT=segments_BxT, **policy)
    logits, aux = jacobi_forward(model, params, inputs_BxT, 0, **kw)

    def next_pass(final_kv, _):
      logits, aux = shared_pass(model, params, inputs_BxT, final_kv, **kw)
      return aux["final_kv"], ce(logits)

    _, shared_ce_IxB = jax.lax.scan(next_pass, aux["final_kv"], None, length=max_passes)
    ce_IxB = jnp.concatenate([ce(logits)[None], shared_ce_IxB])
    return ce_IxB, aux["residual_norm_R"], aux["relative_residual_R"]

  def decode(params, inputs_BxT, targets_BxT, segments_BxT):
    logits, _ = decode_forward(
      model,
      params,
      inputs_BxT,
      share_kv=True,
      kv_format=kv_format,
      segment_ids_BxT=segments_BxT,
      **policy,
    )
    return jnp.sum(token_cross_entropy(logits, targets_BxT), axis=1)

  def block(params, inputs_BxT, targets_BxT, segments_BxT, size):
    """Row CE of block prefill with blocks of `size` tokens (1: exact shared decode)."""
    logits, _ = decode_forward(
      model,
      params,
      inputs_BxT,
      share_kv=True,
      block=size,
      kv_format=kv_format,
      segment_ids_BxT=segments_BxT,
      **policy,
    )
    return jnp.sum(token_cross_entropy(logits, targets_BxT), axis=1)

  def drift(params, inputs_BxT, segments_BxT):
    """Squared norms of K_r - K_R and of K_R per core layer, from an unshared prefill."""
    b, t = inputs_BxT.shape
    cache = init_cache(cfg, b, t, share_kv=False)
    segments = {}
    if segments_BxT is not None:
      segments = dict(segment_ids_BxT=segments_BxT, cache_segment_ids_BxS=segments_BxT)
    _, aux = model.apply(params, inputs_BxT, cache=cache, **segments)
    out = []
    # GQA: (K, V), each [R, B, S, K, H]; MLA: (latent, RoPE key); KDA: (state, conv tail).
    entries = [
      (kv.state_BxNxHxE, kv.conv_BxWxM) if isinstance(kv, KDAState) else kv
      for kv in aux["cache"].layers["core"]
    ]
    for index in (0, 1):  # Per layer (entry sizes differ between mixers), then stacked.
      # Per layer [R, the entry's values].
      flat = [kv[index].reshape(cfg.num_recurrences, -1).astype(jnp.float32) for kv in entries]
      out.append(jnp.stack([jnp.sum((x - x[-1]) ** 2, axis=-1) for x in flat]))
      out.append(jnp.stack([jnp.sum(x[-1] ** 2) for x in flat]))
    dk, k, dv, v = out
    return dk, dv, k, v

  return StatsFns(
    jax.jit(jacobi, static_argnums=4),
    jax.jit(decode),
    jax.jit(drift),
    jax.jit(block, static_argnums=4),
  )


def depth_settings(eval_config) -> adaptive.DepthSettings:
  """The eval section's (config.eval) recurrences and exits."""
  return adaptive.settings_of(eval_config)


def depth_model(cfg: ModelConfig, eval_config) -> ModelConfig:
  """The model every metric runs: R = eval.recurrences where set (fewer or more than trained)."""
  r = eval_config.recurrences
  return dataclasses.replace(cfg, num_recurrences=r) if r else cfg


def depth_fn(cfg: ModelConfig, eval_config) -> Callable | None:
  """evaluate's depth function for the eval section (None without an exit criterion)."""
  settings = depth_settings(eval_config)
  if not settings.exits:
    return None
  return make_depth_fn(cfg, settings, None, eval_config.kv_policy, eval_config.exit_lookup)


@functools.lru_cache(maxsize=32)
def make_depth_fn(
  cfg: ModelConfig,
  depth: adaptive.DepthSettings,
  kv_format: str | None = None,
  kv_policy: str = kv_policy_lib.FINAL,
  exit_lookup: str = adaptive.DEFAULT_LOOKUP,
) -> Callable:
  """Jitted exact decode with exits: (params, inputs, targets, segments, share_kv (static)) ->
  (CE summed per row, recurrences summed per row)."""
  model = LoopedLM(cfg)

  def decode(params, inputs_BxT, targets_BxT, segments_BxT, share_kv):
    policy = {"kv_policy": kv_policy} if share_kv else {}
    logits, cache = decode_forward(
      model,
      params,
      inputs_BxT,
      share_kv=share_kv,
      kv_format=kv_format,
      segment_ids_BxT=segments_BxT,
      depth=depth,
      exit_lookup=exit_lookup,
      **policy,
    )
    ce_B = jnp.sum(token_cross_entropy(logits, targets_BxT), axis=1)
    return ce_B, jnp.sum(cache.depth_BxS, axis=1)

  return jax.jit(decode, static_argnums=4)


def kv_bytes_per_token(
  cfg: ModelConfig, kv_format: str | None = None, kv_policy: str = kv_policy_lib.FINAL
) -> dict:
  return cache_bytes(cfg, kv_format, kv_policy)["per_token"]


def cache_bytes(
  cfg: ModelConfig, kv_format: str | None = None, kv_policy: str = kv_policy_lib.FINAL
) -> dict:
  return mixers.cache_bytes(cfg, kv_format or KV_FORMAT, kv_policy)


def contraction_ratios(residual_norms_R) -> list[float]:
  r = np.asarray(residual_norms_R, np.float64)
  return (r[1:] / np.maximum(r[:-1], 1e-30)).tolist()


def _ppl(ce_rows: np.ndarray, tokens_per_row: int) -> float:
  return math.exp(float(np.sum(ce_rows)) / (len(ce_rows) * tokens_per_row))


def gap_ci95(shared_ce_rows, unshared_ce_rows, tokens_per_row: int, seed: int = 0) -> list[float]:
  """95% percentile-bootstrap interval of exp(mean CE shared - mean CE unshared) - 1, resampling
  rows (paired) with replacement; rows are the independent units of the eval set."""
  shared = np.asarray(shared_ce_rows, np.float64)
  unshared = np.asarray(unshared_ce_rows, np.float64)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(shared), size=(BOOTSTRAP_SAMPLES, len(shared)))
  diff = (shared[idx].sum(1) - unshared[idx].sum(1)) / (len(shared) * tokens_per_row)
  lo, hi = np.percentile(np.expm1(diff), [2.5, 97.5])
  return [float(lo), float(hi)]


def _policy_metrics(cfg, kv_format, name, shared_ce, unshared_ce, tokens_per_row) -> dict:
  """One extra policy's entry of metrics['kv_policies'] (module docstring)."""
  policy = kv_policy_lib.parse(name, cfg.num_recurrences)
  ppl, ppl_un = _ppl(shared_ce, tokens_per_row), _ppl(unshared_ce, tokens_per_row)
  return {
    "reads": list(policy.reads),
    "cached": list(policy.cached),
    "kv_bytes_per_token": kv_bytes_per_token(cfg, kv_format, name)["shared"],
    "ppl_shared_exact_subset": ppl,
    "gap_exact": ppl / ppl_un - 1.0,
    "gap_exact_ci95": gap_ci95(shared_ce, unshared_ce, tokens_per_row),
  }


def evaluate(
  fns: StatsFns,
  model_cfg: ModelConfig,
  params,
  eval_batches: list[dict],
  jacobi_passes: tuple[int, ...],
  decode_batches: int = 0,
  kv_format: str | None = None,
  decode_rows: int = 0,
  drift: bool = True,
  place: Callable = jnp.asarray,
  prefill_blocks: tuple[int, ...] = (),
  kv_policy: str = kv_policy_lib.FINAL,
  kv_policies: tuple[str, ...] = (),
  depth: Callable | None = None,
) -> dict:
  """Shareability metrics (module docstring) of `params`; JSON-ready (pass counts as str).

  jacobi_passes: shared-pass counts reported (may be empty: the unshared forward only).
  decode_batches: eval batches in the exact-decode subset (0: all).
  decode_rows: rows per exact-decode call (a multiple of the eval batch size; 0: the subset).
  drift: also measure K/V drift (an unshared forward that does not depend on the KV format).
  place: puts a host array of rows on the devices; on a mesh, split over its batch axes
    (sharding.batch_sharding), so each device computes its own rows, not all of them.
  prefill_blocks: block sizes C measured by block prefill on the decode subset (may be empty;
    the keys ppl_shared_block_subset, gap_block and gap_block_ci95 are then empty dicts).
  kv_policy: the policy `fns` were made with (make_stats_fns), named in the metrics.
  kv_policies: further policies each measured by exact decode on the decode subset
    (metrics['kv_policies']; make_stats_fns(model_cfg, kv_format, policy) per policy).
  depth: make_depth_fn's function: metrics['depth'] measures exits on the decode subset.
  """
  passes = sorted({0, *(int(n) for n in jacobi_passes)})
  masked = "segment_ids" in eval_batches[0]  # Document masking (data.document_mask).
  ce_rows, residual_R, relative_R = _jacobi_ce(fns, params, eval_batches, passes, masked, place)
  tokens_per_row = int(eval_batches[0]["targets"].shape[1])
  subset = _stack_rows(eval_batches[: decode_batches or len(eval_batches)], masked)
  blocks = sorted({int(c) for c in prefill_blocks})
  policies = list(dict.fromkeys(kv_policies))
  policy_fns = {p: make_stats_fns(model_cfg, kv_format, p) for p in policies}
  sub = _subset_ce(fns, params, subset, decode_rows, blocks, policy_fns, drift, place)
  unshared_sub = ce_rows[0][: len(sub.decode)]
  metrics = {
    "metrics_version": METRICS_VERSION,
    **_eval_metrics(ce_rows, passes, tokens_per_row),
    **_subset_metrics(ce_rows, passes, sub, tokens_per_row),
    **_residual_metrics(residual_R / len(eval_batches), relative_R / len(eval_batches)),
    "kv_bytes_per_token": kv_bytes_per_token(model_cfg, kv_format, kv_policy),
    "cache_bytes": cache_bytes(model_cfg, kv_format, kv_policy),
    "kv_policy": kv_policy,
    "kv_policies": {
      p: _policy_metrics(model_cfg, kv_format, p, ce, unshared_sub, tokens_per_row)
      for p, ce in sub.policy.items()
    },
  }
  if drift:
    metrics["kv_drift"] = _drift_metrics(*sub.drift)
  if depth is not None:
    full = {"shared": sub.decode, "unshared": unshared_sub}
    metrics["depth"] = _depth_metrics(
      depth, params, subset, decode_rows, place, full, tokens_per_row
    )
  return metrics


def _depth_metrics(fn, params, subset, decode_rows, place, full: dict, tokens_per_row) -> dict:
  """metrics['depth'] (module docstring) of make_depth_fn's fn on the decode subset; full: the
  same rows' CE at full depth per layout."""
  sub_inputs, sub_targets, sub_segments = subset
  rows = len(sub_inputs)
  group = decode_rows or rows
  out = {}
  for name, share_kv in (("shared", True), ("unshared", False)):
    ce, ran = [], []
    for start in range(0, rows, group):
      part = slice(start, start + group)
      segments = None if sub_segments is None else place(sub_segments[part])
      ce_B, ran_B = fn(
        params, place(sub_inputs[part]), place(sub_targets[part]), segments, share_kv
      )
      ce.append(np.asarray(ce_B, np.float64))
      ran.append(np.asarray(ran_B, np.float64) / sub_inputs.shape[1])
    ce, ran = np.concatenate(ce), np.concatenate(ran)
    ppl, ppl_full = _ppl(ce, tokens_per_row), _ppl(full[name], tokens_per_row)
    out[name] = {
      "ppl_exact_subset": ppl,
      "gap_vs_full_depth": ppl / ppl_full - 1.0,
      "gap_vs_full_depth_ci95": gap_ci95(ce, full[name], tokens_per_row),
      "mean_recurrences": float(ran.mean()),
      "mean_recurrences_ci95": _mean_ci95(ran),
    }
  return out


def _mean_ci95(per_row, seed: int = 0) -> list[float]:
  """95% percentile-bootstrap interval of the mean of per-row values (rows resampled)."""
  values = np.asarray(per_row, np.float64)
  idx = np.random.default_rng(seed).integers(0, len(values), (BOOTSTRAP_SAMPLES, len(values)))
  lo, hi = np.percentile(values[idx].mean(1), [2.5, 97.5])
  return [float(lo), float(hi)]


def _jacobi_ce(fns: StatsFns, params, eval_batches, passes, masked: bool, place):
  """Row CE after each count of Jacobi passes ({n: ce_rows}) over the whole eval set, and the
  residual and relative-residual norms summed over its batches."""
  ce_rows = {n: [] for n in passes}
  residual_R, relative_R = 0.0, 0.0
  for batch in eval_batches:
    inputs, targets = place(batch["inputs"]), place(batch["targets"])
    segments = place(batch["segment_ids"]) if masked else None
    ce_IxB, res_R, rel_R = fns.jacobi(params, inputs, targets, segments, passes[-1])
    ce_IxB = np.asarray(ce_IxB, np.float64)
    for n in passes:
      ce_rows[n].append(ce_IxB[n])
    residual_R = residual_R + np.asarray(res_R, np.float64)
    relative_R = relative_R + np.asarray(rel_R, np.float64)
  return {n: np.concatenate(v) for n, v in ce_rows.items()}, residual_R, relative_R


def _stack_rows(batches: list[dict], masked: bool) -> tuple:
  """The batches' (inputs, targets, segment ids or None) as host arrays of all their rows."""
  inputs = np.concatenate([b["inputs"] for b in batches])
  targets = np.concatenate([b["targets"] for b in batches])
  segments = np.concatenate([b["segment_ids"] for b in batches]) if masked else None
  return inputs, targets, segments


class _SubsetCE(NamedTuple):
  """Row CE on the decode subset, and the K/V drift's summed squared norms (or None)."""

  decode: np.ndarray  # Exact shared decode.
  block: dict  # Block size C -> block prefill.
  policy: dict  # Extra KV policy -> exact shared decode under it.
  drift: list | None  # (dk, dv, k, v) of StatsFns.drift, summed over the row groups.


def _subset_ce(fns, params, subset, decode_rows, blocks, policy_fns, drift, place) -> _SubsetCE:
  """Exact decode, block prefill, each extra policy's decode and (with drift) the K/V drift on
  the decode subset, `decode_rows` rows per call (0: all of them)."""
  sub_inputs, sub_targets, sub_segments = subset
  rows = len(sub_inputs)
  group = decode_rows or rows
  decode_ce, drift_sums = [], None
  block_ce = {c: [] for c in blocks}
  policy_ce = {p: [] for p in policy_fns}
  for start in range(0, rows, group):
    inputs = place(sub_inputs[start : start + group])
    targets = place(sub_targets[start : start + group])
    segments = None if sub_segments is None else place(sub_segments[start : start + group])
    decode_ce.append(np.asarray(fns.decode(params, inputs, targets, segments), np.float64))
    for c in blocks:
      ce_B = fns.block(params, inputs, targets, segments, c)
      block_ce[c].append(np.asarray(ce_B, np.float64))
    for p, policy in policy_fns.items():
      ce_B = policy.decode(params, inputs, targets, segments)
      policy_ce[p].append(np.asarray(ce_B, np.float64))
    if drift:
      part = [np.asarray(x, np.float64) for x in fns.drift(params, inputs, segments)]
      drift_sums = part if drift_sums is None else [a + b for a, b in zip(drift_sums, part)]
  return _SubsetCE(
    np.concatenate(decode_ce),
    {c: np.concatenate(v) for c, v in block_ce.items()},
    {p: np.concatenate(v) for p, v in policy_ce.items()},
    drift_sums,
  )


def _eval_metrics(ce_rows: dict, passes: list[int], tokens_per_row: int) -> dict:
  """The whole eval set's perplexities and Jacobi gaps."""
  ppl_un = _ppl(ce_rows[0], tokens_per_row)
  jacobi = {str(n): _ppl(ce_rows[n], tokens_per_row) for n in passes if n}
  return {
    "eval_rows": int(len(ce_rows[0])),
    "eval_tokens": int(len(ce_rows[0]) * tokens_per_row),
    "ppl_unshared_eval": ppl_un,
    "ppl_shared_jacobi_eval": jacobi,
    "gap_jacobi_eval": {n: p / ppl_un - 1.0 for n, p in jacobi.items()},
    "gap_jacobi_eval_ci95": {
      str(n): gap_ci95(ce_rows[n], ce_rows[0], tokens_per_row) for n in passes if n
    },
  }


def _subset_metrics(ce_rows: dict, passes: list[int], sub: _SubsetCE, tokens_per_row: int):
  """The decode subset's perplexities and gaps: exact decode, Jacobi passes, block prefill."""
  rows = len(sub.decode)
  unshared_sub = ce_rows[0][:rows]
  sub_un = _ppl(unshared_sub, tokens_per_row)
  sub_exact = _ppl(sub.decode, tokens_per_row)
  sub_block = {str(c): _ppl(ce, tokens_per_row) for c, ce in sub.block.items()}
  return {
    "decode_subset": {"rows": rows, "tokens": rows * tokens_per_row},
    "ppl_unshared_subset": sub_un,
    "ppl_shared_exact_subset": sub_exact,
    "ppl_shared_jacobi_subset": {
      str(n): _ppl(ce_rows[n][:rows], tokens_per_row) for n in passes if n
    },
    "gap_exact": sub_exact / sub_un - 1.0,
    "gap_exact_ci95": gap_ci95(sub.decode, unshared_sub, tokens_per_row),
    "ppl_shared_block_subset": sub_block,
    "gap_block": {c: p / sub_un - 1.0 for c, p in sub_block.items()},
    "gap_block_ci95": {
      str(c): gap_ci95(ce, unshared_sub, tokens_per_row) for c, ce in sub.block.items()
    },
  }


def _residual_metrics(residual_R, relative_R) -> dict:
  """Mean residual norms per recurrence and their contraction."""
  residual_norms = residual_R.tolist()
  return {
    "residual_norms": residual_norms,
    "relative_residuals": relative_R.tolist(),
    "contraction_ratios": contraction_ratios(residual_norms),
  }


def _drift_metrics(dk, dv, k, v) -> dict:
  """||K_r - K_R|| / ||K_R|| (and V's) per core layer and recurrence."""
  return {"k": np.sqrt(dk / k[:, None]).tolist(), "v": np.sqrt(dv / v[:, None]).tolist()}
