"""Shared-cache flash attention (forward and backward kernels, custom VJP).

    out[t] = softmax_s( [q_t . k_past_s for s < t] ++ [q_t . k_t] ) @ [v_past_s ; v_t]

Position t attends to the *past* K/V strictly before it and to its *own* K/V on the diagonal.
Under KV sharing (Jacobi / BeNice! passes) the past is the final recurrence's K/V of a previous
pass; with past = own this is ordinary causal attention. The kernel is strictly-causal flash
attention over the past, started from the diagonal term: the online softmax is initialised with
(max = q_t . k_t, sum = 1, acc = v_t), so the diagonal costs one dot product per position and
every row has a finite max (no -inf - -inf). Never materialises a T x T matrix.

GQA: each program handles one query head and reads its K/V head (h // group). Layout inside
is [B, N, T, H]; T is padded to a multiple of the blocks (padded keys sit after every real query,
so the causal mask hides them; padded query rows are dropped).

Backward (FlashAttention-2 style, two kernels, the forward's log-sum-exp saved):
  dq kernel, per query block: dq over past blocks plus the diagonal terms, which also give the
    own-K/V gradients (one row each, per query head).
  dkv kernel, per past-K/V block: dk_past, dv_past over the query blocks that read it.
Per-query-head K/V gradients are summed over the group outside the kernels.

Block prefill (`prefill_block` C > 1, blocks aligned at 0, b(t) = (t // C) * C): t reads the
past at s < b(t) and its own K/V causally at b(t) <= s <= t. The past loop stops at the last
row's block start; a second loop over the own K/V (given again as whole-T blocks) covers the
tiles between the first row's block start and the diagonal, masked to b(t) <= s < t; the
diagonal is still the initial term. Own keys read by later rows of their block get their dk,
dv from the key-tile kernel (the dkv kernel, with a second pair of outputs), added to the
diagonal's. C = 1 is exactly the plain form (the same kernels).

The past may arrive packed in a KV format (`kv_formats.PackedKV`, per-token layout of
`looped.kv_quant`): the forward and dq kernels then dequantize each past tile as they load it
(`ops.past_tile`), and the past, a constant, gets zero cotangents (no dkv kernel).

Document masking (`segment_ids`, one id per position; the past holds the same positions): every
past and own tile's mask also requires the query's and key's ids to be equal (the diagonal is
always the token's own document). The ids enter as a [Tp, 1] column (query side) and a [1, Tp]
row (key side), so no kernel transposes; without them the kernels take neither.

These are the generic kernels (interpret, Triton, Mosaic), each looping over a whole-T block.
On TPU the default is `shared_attention_tpu`: the same three kernels with that loop as a grid
axis, so Mosaic pipelines the blocks through VMEM.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import kv_formats, ops, platform, shared_attention_tpu

_dot = ops.dot_f32


# ---------------------------------------------------------------------------------------------
# Kernels. Refs are [rows, D] blocks of one (batch, head); softmax statistics [rows, 1].


def _seg_refs(refs, n_leaves: int, prefill_block: int, segmented: bool):
  """The segment-id refs (query column, key row), after the past leaves and own K/V, or None."""
  start = 2 * n_leaves + 2 * (prefill_block > 1)
  return tuple(refs[start : start + 2]) if segmented else None


def _fwd_kernel(
  q_ref, k_ref, v_ref, *refs, sm_scale, block_k, past_fmt, n_leaves, prefill_block, segmented
):
  kp_refs, vp_refs = refs[:n_leaves], refs[n_leaves : 2 * n_leaves]
  seg_refs = _seg_refs(refs, n_leaves, prefill_block, segmented)
  o_ref, lse_ref = refs[-2:]
  block_q = q_ref.shape[0]
  q_start = pl.program_id(2) * block_q
  q_QxH = q_ref[...]
  # Diagonal first: the running max starts finite, the sum at 1, the accumulator at v_t.
  m_Q = jnp.sum(q_QxH.astype(jnp.float32) * k_ref[...].astype(jnp.float32), axis=1) * sm_scale
  l_Q = jnp.ones_like(m_Q)
  acc_QxH = v_ref[...].astype(jnp.float32)

  def update(carry, k_SxH, v_SxH, mask_QxS):
    m_Q, l_Q, acc_QxH = carry
    s_QxS = jnp.where(mask_QxS, _dot(q_QxH, k_SxH, 1, 1) * sm_scale, -jnp.inf)
    m_new = jnp.maximum(m_Q, jnp.max(s_QxS, axis=1))
    alpha = jnp.exp(m_Q - m_new)
    p_QxS = jnp.exp(s_QxS - m_new[:, None])
    l_Q = l_Q * alpha + jnp.sum(p_QxS, axis=1)
    acc_QxH = acc_QxH * alpha[:, None] + _dot(p_QxS.astype(v_SxH.dtype), v_SxH)
    return m_new, l_Q, acc_QxH

  def past_body(j, carry):
    k_start = j * block_k
    kp_SxH = ops.past_tile(kp_refs, k_start, block_k, past_fmt, q_QxH.dtype)
    vp_SxH = ops.past_tile(vp_refs, k_start, block_k, past_fmt, q_QxH.dtype)
    mask = ops.past_mask(q_start, k_start, block_q, block_k, prefill_block)
    mask = ops.same_segment(mask, seg_refs, ..., pl.ds(k_start, block_k))
    return update(carry, kp_SxH, vp_SxH, mask)

  # Past tiles holding some s < block_start(t) for t in this query tile.
  num_blocks = pl.cdiv(ops.past_end(q_start, block_q, prefill_block), block_k)
  carry = lax.fori_loop(0, num_blocks, past_body, (m_Q, l_Q, acc_QxH))
  if prefill_block > 1:  # The own block's earlier positions, from the whole-T own K/V.
    k_all_ref, v_all_ref = refs[2 * n_leaves : 2 * n_leaves + 2]

    def own_body(j, carry):
      rows = pl.ds(j * block_k, block_k)
      mask = ops.own_mask(q_start, j * block_k, block_q, block_k, prefill_block)
      mask = ops.same_segment(mask, seg_refs, ..., rows)
      return update(carry, k_all_ref[rows, :], v_all_ref[rows, :], mask)

    carry = lax.fori_loop(*ops.own_tiles(q_start, block_q, block_k, prefill_block), own_body, carry)
  m_Q, l_Q, acc_QxH = carry
  o_ref[...] = (acc_QxH / l_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = (m_Q + jnp.log(l_Q))[:, None]


def _bwd_dq_kernel(
  q_ref, k_ref, v_ref, *refs, sm_scale, block_k, past_fmt, n_leaves, prefill_block, segmented
):
  kp_refs, vp_refs = refs[:n_leaves], refs[n_leaves : 2 * n_leaves]
  seg_refs = _seg_refs(refs, n_leaves, prefill_block, segmented)
  do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref = refs[-6:]
  block_q = q_ref.shape[0]
  q_start = pl.program_id(2) * block_q
  q_QxH, do_QxH = q_ref[...], do_ref[...]
  lse_Qx1, delta_Qx1 = lse_ref[...], delta_ref[...]
  q32, do32 = q_QxH.astype(jnp.float32), do_QxH.astype(jnp.float32)
  k32, v32 = k_ref[...].astype(jnp.float32), v_ref[...].astype(jnp.float32)
  # Diagonal: p_tt, and ds_tt = p_tt (dO_t . v_t - delta_t); gives dk_t, dv_t directly.
  p_Qx1 = jnp.exp(jnp.sum(q32 * k32, axis=1, keepdims=True) * sm_scale - lse_Qx1)
  ds_Qx1 = p_Qx1 * (jnp.sum(do32 * v32, axis=1, keepdims=True) - delta_Qx1)
  dk_ref[...] = (ds_Qx1 * q32 * sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = (p_Qx1 * do32).astype(dv_ref.dtype)
  dq_QxH = ds_Qx1 * k32 * sm_scale

  def update(dq_QxH, k_SxH, v_SxH, mask_QxS):
    s_QxS = _dot(q_QxH, k_SxH, 1, 1) * sm_scale
    p_QxS = jnp.where(mask_QxS, jnp.exp(s_QxS - lse_Qx1), 0.0)
    dp_QxS = _dot(do_QxH, v_SxH, 1, 1)
    ds_QxS = p_QxS * (dp_QxS - delta_Qx1)
    return dq_QxH + _dot(ds_QxS.astype(k_SxH.dtype), k_SxH) * sm_scale

  def past_body(j, dq_QxH):
    k_start = j * block_k
    kp_SxH = ops.past_tile(kp_refs, k_start, block_k, past_fmt, q_QxH.dtype)
    vp_SxH = ops.past_tile(vp_refs, k_start, block_k, past_fmt, q_QxH.dtype)
    mask = ops.past_mask(q_start, k_start, block_q, block_k, prefill_block)
    mask = ops.same_segment(mask, seg_refs, ..., pl.ds(k_start, block_k))
    return update(dq_QxH, kp_SxH, vp_SxH, mask)

  num_blocks = pl.cdiv(ops.past_end(q_start, block_q, prefill_block), block_k)
  dq_QxH = lax.fori_loop(0, num_blocks, past_body, dq_QxH)
  if prefill_block > 1:  # dq from the own block's earlier positions (their dk, dv: dkv kernel).
    k_all_ref, v_all_ref = refs[2 * n_leaves : 2 * n_leaves + 2]

    def own_body(j, dq_QxH):
      rows = pl.ds(j * block_k, block_k)
      mask = ops.own_mask(q_start, j * block_k, block_q, block_k, prefill_block)
      mask = ops.same_segment(mask, seg_refs, ..., rows)
      return update(dq_QxH, k_all_ref[rows, :], v_all_ref[rows, :], mask)

    lo, hi = ops.own_tiles(q_start, block_q, block_k, prefill_block)
    dq_QxH = lax.fori_loop(lo, hi, own_body, dq_QxH)
  dq_ref[...] = dq_QxH.astype(dq_ref.dtype)


def _bwd_dkv_kernel(
  q_ref, do_ref, lse_ref, delta_ref, *refs, sm_scale, block_q, prefill_block, has_past, segmented
):
  """Gradients of one key tile: of the past K/V (has_past) over the query tiles reading it as
  past, and of the own K/V (prefill_block > 1) over those reading it inside their block."""
  n_keys = 2 * has_past + 2 * (prefill_block > 1)
  n_in = n_keys + 2 * segmented
  ins, outs = refs[:n_keys], refs[n_in:]
  seg_refs = tuple(refs[n_keys:n_in]) if segmented else None
  block_k, d = ins[0].shape
  k_start = pl.program_id(2) * block_k
  num_q_tiles = q_ref.shape[0] // block_q

  def grads(key_ref, value_ref, mask_fn, lo, hi, dk_ref, dv_ref):
    k_SxH, v_SxH = key_ref[...], value_ref[...]

    def body(i, carry):
      dk_SxH, dv_SxH = carry
      q_start = i * block_q
      rows = pl.ds(q_start, block_q)
      q_QxH, do_QxH = q_ref[rows, :], do_ref[rows, :]
      lse_Qx1, delta_Qx1 = lse_ref[rows, :], delta_ref[rows, :]
      s_QxS = _dot(q_QxH, k_SxH, 1, 1) * sm_scale
      mask = mask_fn(q_start, k_start, block_q, block_k, prefill_block)
      mask = ops.same_segment(mask, seg_refs, rows, ...)
      p_QxS = jnp.where(mask, jnp.exp(s_QxS - lse_Qx1), 0.0)
      dv_SxH = dv_SxH + _dot(p_QxS.astype(do_QxH.dtype), do_QxH, 0, 0)
      ds_QxS = p_QxS * (_dot(do_QxH, v_SxH, 1, 1) - delta_Qx1)
      dk_SxH = dk_SxH + _dot(ds_QxS.astype(q_QxH.dtype), q_QxH, 0, 0) * sm_scale
      return dk_SxH, dv_SxH

    zeros = jnp.zeros((block_k, d), jnp.float32)
    dk_SxH, dv_SxH = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk_SxH.astype(dk_ref.dtype)
    dv_ref[...] = dv_SxH.astype(dv_ref.dtype)

  if has_past:  # Query tiles holding some t with block_start(t) > s: t >= the next block start.
    first = ops.past_query_start(k_start, prefill_block) // block_q
    grads(ins[0], ins[1], ops.past_mask, first, num_q_tiles, outs[0], outs[1])
  if prefill_block > 1:
    lo, hi = ops.own_query_tiles(k_start, block_q, block_k, prefill_block, num_q_tiles)
    grads(ins[-2], ins[-1], ops.own_mask, lo, hi, outs[-2], outs[-1])


# ---------------------------------------------------------------------------------------------
# pallas_call wrappers on [B, N, Tp, H] arrays (Tp a multiple of both blocks).


def _row_spec(block: int, d: int, head_map=lambda h: h):
  """One block of rows of one (batch, head): index_map (b, h, i) -> (b, head_map(h), i, 0)."""
  return pl.BlockSpec((None, None, block, d), lambda b, h, i: (b, head_map(h), i, 0))


def _full_spec(t: int, d: int, head_map=lambda h: h):
  return pl.BlockSpec((None, None, t, d), lambda b, h, i: (b, head_map(h), 0, 0))


def _stat_spec(block: int):
  """Per-row softmax statistics, stored as [B, N, T, 1] columns (TPU tiling takes those)."""
  return pl.BlockSpec((None, None, block, 1), lambda b, h, i: (b, h, i, 0))


def _full_stat_spec(t: int):
  return pl.BlockSpec((None, None, t, 1), lambda b, h, i: (b, h, 0, 0))


def _past_leaves(past):
  return [past] if not isinstance(past, kv_formats.PackedKV) else jax.tree.leaves(past)


def _past_fmt(past):
  return past.fmt if isinstance(past, kv_formats.PackedKV) else None


def _past_specs(past, t: int, kv_head):
  """Leaves of the (padded, kernel-layout) past and their whole-T block specs."""
  leaves = _past_leaves(past)
  specs = [_full_spec(t, x.shape[-1], kv_head) for x in leaves]
  if _past_fmt(past) == "nvfp4":  # Its tensor scale [B, 1, T, 1] is shared by the heads.
    specs[2] = _full_spec(t, 1, lambda h: 0)
  return leaves, specs


def _seg_inputs(seg, t: int, block_q: int | None = None, block_k: int | None = None):
  """Segment ids ([B, Tp] or None) as kernel inputs with their specs: a [B, 1, Tp, 1] column
  (query rows; block_q rows per program, or whole-T) and a [B, 1, 1, Tp] row (key side;
  block_k per program, or whole-T). Both are shared by the heads."""
  if seg is None:
    return (), ()
  col, row = seg[:, None, :, None], seg[:, None, None, :]
  if block_q is None:
    col_spec = pl.BlockSpec((None, None, t, 1), lambda b, h, i: (b, 0, 0, 0))
  else:
    col_spec = pl.BlockSpec((None, None, block_q, 1), lambda b, h, i: (b, 0, i, 0))
  if block_k is None:
    row_spec = pl.BlockSpec((None, None, 1, t), lambda b, h, i: (b, 0, 0, 0))
  else:
    row_spec = pl.BlockSpec((None, None, 1, block_k), lambda b, h, i: (b, 0, 0, i))
  return (col, row), (col_spec, row_spec)


def _fwd(q, k, v, kp, vp, seg, sm_scale, block_q, block_k, interpret, variant, prefill_block):
  if variant == "tpu":
    leaves = _past_leaves(kp), _past_leaves(vp)
    return shared_attention_tpu.fwd(
      q, k, v, *leaves, _past_fmt(kp), sm_scale, block_q, block_k, interpret, prefill_block, seg
    )
  b, hq, t, d = q.shape
  group = hq // k.shape[1]
  kv_head = lambda h: h // group
  kp_leaves, kp_specs = _past_specs(kp, t, kv_head)
  vp_leaves, vp_specs = _past_specs(vp, t, kv_head)
  own, own_specs = _own_whole(k, v, prefill_block, kv_head)
  segs, seg_specs = _seg_inputs(seg, t, block_q=block_q)
  kernel = functools.partial(
    _fwd_kernel,
    sm_scale=sm_scale,
    block_k=block_k,
    past_fmt=_past_fmt(kp),
    n_leaves=len(kp_leaves),
    prefill_block=prefill_block,
    segmented=seg is not None,
  )
  return pl.pallas_call(
    kernel,
    grid=(b, hq, t // block_q),
    in_specs=[
      _row_spec(block_q, d),
      _row_spec(block_q, d, kv_head),
      _row_spec(block_q, d, kv_head),
      *kp_specs,
      *vp_specs,
      *own_specs,
      *seg_specs,
    ],
    out_specs=[_row_spec(block_q, d), _stat_spec(block_q)],
    out_shape=[
      jax.ShapeDtypeStruct(q.shape, q.dtype),
      jax.ShapeDtypeStruct((b, hq, t, 1), jnp.float32),
    ],
    interpret=interpret,
    compiler_params=platform.compiler_params(interpret),
    name="shared_attention_fwd",
  )(q, k, v, *kp_leaves, *vp_leaves, *own, *segs)


def _own_whole(k, v, prefill_block: int, kv_head):
  """Block prefill: the own K/V again, as whole-T blocks, for the in-block reads."""
  if prefill_block == 1:
    return (), ()
  t, d = k.shape[2:]
  return (k, v), (_full_spec(t, d, kv_head),) * 2


def _bwd(
  q, k, v, kp, vp, seg, o, lse, do, sm_scale, block_q, block_k, interpret, variant, prefill_block
):
  b, hq, t, d = q.shape
  hkv = k.shape[1]
  group = hq // hkv
  delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
  group_sum = lambda x, like: x.reshape(b, hkv, group, t, d).sum(2).astype(like.dtype)
  blocks = (sm_scale, block_q, block_k, interpret, prefill_block)
  raw_past = _past_fmt(kp) is None
  # Which key tiles get a dkv kernel: a raw past (a packed one is a constant), and in block
  # prefill the own K/V read inside the block (the diagonal's share comes from the dq kernel).
  past = (kp, vp) if raw_past else None
  own = (k, v) if prefill_block > 1 else None
  if variant == "tpu":
    leaves = _past_leaves(kp), _past_leaves(vp)
    dq, dk_h, dv_h = shared_attention_tpu.dq(
      q, k, v, *leaves, _past_fmt(kp), do, lse, delta, *blocks, seg
    )
    dkv = shared_attention_tpu.dkv
  else:
    dq, dk_h, dv_h = _bwd_dq(q, k, v, kp, vp, do, lse, delta, *blocks, seg)
    dkv = _bwd_dkv
  dpast, down = (None, None), (None, None)
  if past is not None or own is not None:
    dpast, down = dkv(q, do, lse, delta, past, own, *blocks, seg)
  if own is not None:  # In-block reads plus the diagonal, per query head (float32 sum).
    dk_h = dk_h.astype(jnp.float32) + down[0].astype(jnp.float32)
    dv_h = dv_h.astype(jnp.float32) + down[1].astype(jnp.float32)
  # Sum the query heads of each group into their K/V head.
  dk, dv = group_sum(dk_h, k), group_sum(dv_h, v)
  if not raw_past:
    return dq, dk, dv, None, None
  return dq, dk, dv, group_sum(dpast[0], kp), group_sum(dpast[1], vp)


def _bwd_dq(
  q, k, v, kp, vp, do, lse, delta, sm_scale, block_q, block_k, interpret, prefill_block, seg
):
  """The generic dq kernel: (dq, dk_h, dv_h) per query head (dk_h, dv_h: the diagonal's)."""
  b, hq, t, d = q.shape
  group = hq // k.shape[1]
  kv_head = lambda h: h // group
  per_head = lambda x: jax.ShapeDtypeStruct((b, hq, t, d), x.dtype)
  common = dict(interpret=interpret, compiler_params=platform.compiler_params(interpret))
  kp_leaves, kp_specs = _past_specs(kp, t, kv_head)
  vp_leaves, vp_specs = _past_specs(vp, t, kv_head)
  own, own_specs = _own_whole(k, v, prefill_block, kv_head)
  segs, seg_specs = _seg_inputs(seg, t, block_q=block_q)
  dq_kernel = functools.partial(
    _bwd_dq_kernel,
    sm_scale=sm_scale,
    block_k=block_k,
    past_fmt=_past_fmt(kp),
    n_leaves=len(kp_leaves),
    prefill_block=prefill_block,
    segmented=seg is not None,
  )
  return pl.pallas_call(
    dq_kernel,
    grid=(b, hq, t // block_q),
    in_specs=[
      _row_spec(block_q, d),
      _row_spec(block_q, d, kv_head),
      _row_spec(block_q, d, kv_head),
      *kp_specs,
      *vp_specs,
      *own_specs,
      *seg_specs,
      _row_spec(block_q, d),
      _stat_spec(block_q),
      _stat_spec(block_q),
    ],
    out_specs=[_row_spec(block_q, d)] * 3,
    out_shape=[per_head(q), per_head(k), per_head(v)],
    name="shared_attention_bwd_dq",
    **common,
  )(q, k, v, *kp_leaves, *vp_leaves, *own, *segs, do, lse, delta)


def _bwd_dkv(
  q, do, lse, delta, past, own, sm_scale, block_q, block_k, interpret, prefill_block, seg
):
  """The generic key-tile kernel: ((dk_past_h, dv_past_h) or Nones, (dk_own_h, dv_own_h) or
  Nones), per query head; `past` / `own` are (k, v) pairs or None."""
  b, hq, t, d = q.shape
  pairs = [x for x in (past, own) if x is not None]
  group = hq // pairs[0][0].shape[1]
  kv_head = lambda h: h // group
  per_head = lambda x: jax.ShapeDtypeStruct((b, hq, t, d), x.dtype)
  common = dict(interpret=interpret, compiler_params=platform.compiler_params(interpret))
  kernel = functools.partial(
    _bwd_dkv_kernel,
    sm_scale=sm_scale,
    block_q=block_q,
    prefill_block=prefill_block,
    has_past=past is not None,
    segmented=seg is not None,
  )
  keys = [x for pair in pairs for x in pair]
  segs, seg_specs = _seg_inputs(seg, t, block_k=block_k)
  grads = pl.pallas_call(
    kernel,
    grid=(b, hq, t // block_k),
    in_specs=[
      _full_spec(t, d),
      _full_spec(t, d),
      _full_stat_spec(t),
      _full_stat_spec(t),
      *[_row_spec(block_k, d, kv_head)] * len(keys),
      *seg_specs,
    ],
    out_specs=[_row_spec(block_k, d)] * len(keys),
    out_shape=[per_head(x) for x in keys],
    name="shared_attention_bwd_dkv",
    **common,
  )(q, do, lse, delta, *keys, *segs)
  return _split_pairs(grads, past, own)


def _split_pairs(grads, past, own):
  """A key-tile kernel's outputs back as (past grads, own grads), (None, None) where absent."""
  grads = list(grads)
  dpast = (grads.pop(0), grads.pop(0)) if past is not None else (None, None)
  down = (grads.pop(0), grads.pop(0)) if own is not None else (None, None)
  return dpast, down


# ---------------------------------------------------------------------------------------------
# Public entry: [B, T, N, H] in and out, padding, custom VJP.


def _to_bhtd(x, t_pad):
  x = jnp.swapaxes(x, 1, 2)
  return jnp.pad(x, ((0, 0), (0, 0), (0, t_pad - x.shape[2]), (0, 0)))


def _past_to_kernel(past, t_pad):
  """Past K or V into the kernel layout [B, heads, Tp, last] (packed: every leaf so)."""
  if not isinstance(past, kv_formats.PackedKV):
    return _to_bhtd(past, t_pad)
  scale = past.scale
  if scale is not None and scale.ndim == 3:  # fp8 [B, T, K] -> a column per token.
    scale = scale[..., None]
  tensor_scale = past.tensor_scale
  if tensor_scale is not None:  # [B, T] -> [B, T, 1, 1], one "head".
    tensor_scale = tensor_scale[:, :, None, None]
  to = lambda x: None if x is None else _to_bhtd(x, t_pad)
  return kv_formats.PackedKV(to(past.data), to(scale), to(tensor_scale), past.fmt)


def _zero_cotangent(packed):
  """Zero cotangents for a packed past (float0 for its integer leaves)."""
  zero = lambda a: (
    jnp.zeros_like(a)
    if jnp.issubdtype(a.dtype, jnp.floating)
    else np.zeros(a.shape, jax.dtypes.float0)
  )
  return jax.tree.map(zero, packed)


def _from_bhtd(x, t):
  return jnp.swapaxes(x[:, :, :t], 1, 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _attention(q, k, v, kp, vp, seg, sm_scale, block_q, block_k, interpret, variant, prefill_block):
  statics = (sm_scale, block_q, block_k, interpret, variant, prefill_block)
  return _attention_fwd(q, k, v, kp, vp, seg, *statics)[0]


def _attention_fwd(
  q, k, v, kp, vp, seg, sm_scale, block_q, block_k, interpret, variant, prefill_block
):
  t = q.shape[1]
  t_pad = math.lcm(block_q, block_k) * pl.cdiv(t, math.lcm(block_q, block_k))
  padded = [_to_bhtd(x, t_pad) for x in (q, k, v)] + [_past_to_kernel(x, t_pad) for x in (kp, vp)]
  if seg is not None:  # Padded positions: their own id (-1), masked causally anyway.
    padded.append(jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, t_pad - t)), constant_values=-1))
  else:
    padded.append(None)
  statics = (sm_scale, block_q, block_k, interpret, variant, prefill_block)
  o, lse = _fwd(*padded, *statics)
  packed = (kp, vp) if isinstance(kp, kv_formats.PackedKV) else None
  return _from_bhtd(o, t), (padded, o, lse, packed)


def _attention_bwd(sm_scale, block_q, block_k, interpret, variant, prefill_block, residuals, do):
  padded, o, lse, packed = residuals
  t = do.shape[1]
  do = _to_bhtd(do, o.shape[2])
  statics = (sm_scale, block_q, block_k, interpret, variant, prefill_block)
  grads = _bwd(*padded, o, lse, do, *statics)
  seg = padded[-1]  # Integer ids: no cotangent.
  dseg = None if seg is None else np.zeros(seg[:, :t].shape, jax.dtypes.float0)
  if packed is None:
    return (*(_from_bhtd(g, t) for g in grads), dseg)
  # A packed past is a constant: its bytes and scales get zero cotangents.
  return (*(_from_bhtd(g, t) for g in grads[:3]), *(_zero_cotangent(p) for p in packed), dseg)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _block(requested: int | None, default: int, t: int) -> int:
  """The requested block, or the platform default capped at T rounded up to a power of two."""
  if requested is not None:
    return requested
  return min(default, max(8, pl.next_power_of_2(t)))


def shared_attention(
  q_BxTxNxH: jax.Array,
  k_BxTxKxH: jax.Array,
  v_BxTxKxH: jax.Array,
  k_past_BxTxKxH: jax.Array | kv_formats.PackedKV,
  v_past_BxTxKxH: jax.Array | kv_formats.PackedKV,
  *,
  sm_scale: float | None = None,
  block_q: int | None = None,
  block_k: int | None = None,
  variant: str | None = None,
  interpret: bool | None = None,
  prefill_block: int | None = None,
  segment_ids_BxT: jax.Array | None = None,
) -> jax.Array:
  """Shared-cache attention: t sees the past K/V at s < t and its own K/V at s = t.

  Args:
    q_BxTxNxH: queries, N query heads.
    k_BxTxKxH, v_BxTxKxH: the tokens' own keys/values (K KV heads; N a multiple of K).
    k_past_BxTxKxH, v_past_BxTxKxH: the past K/V of the same positions (pass the own K/V for
      ordinary causal attention). Or both packed in a KV format (`PackedKV`, leaves [B, T, K,
      ...] and nvfp4 tensor scale [B, T], one quantized token per [K, H] slice as looped's
      caches store it): the kernels dequantize each tile as they read it, so a quantized
      Jacobi pass reads exactly what a cache in that format returns, without a dequantized
      copy. A packed past is a constant (zero cotangents).
    sm_scale: logit scale (default D ** -0.5).
    block_q, block_k: query / key block sizes (default per platform; T need not divide).
    variant: 'generic' (one kernel body for interpret, Triton and Mosaic; the past, or the
      query side in the dkv kernel, is one whole-T block looped over in the kernel) or 'tpu'
      (those blocks pipelined by Mosaic along a grid axis, `shared_attention_tpu`). Default:
      'tpu' on TPU, else 'generic'.
    prefill_block: block prefill with blocks of this many positions aligned at 0: t sees the
      past K/V at s < b(t) = (t // prefill_block) * prefill_block and its own K/V causally at
      b(t) <= s <= t. None (or 1): the past at s < t and the own K/V at s = t.
    segment_ids_BxT: document masking: t also reads only the positions s (past or own) with
      the same id (int; the past holds the same positions). None: no masking.
    interpret: run in Pallas interpret mode (default: exactly when there is no GPU/TPU). With
      the 'tpu' variant, True means Pallas' TPU interpreter (`pltpu.InterpretParams()`).

  Returns:
    [B, T, N, H] in q's dtype. Differentiable in all five arrays (custom VJP with Pallas
    backward kernels; the past only when not packed); softmax statistics in float32.
  """
  b, t, n, d = q_BxTxNxH.shape
  kv_shape = k_BxTxKxH.shape
  if kv_shape[:2] != (b, t) or kv_shape[3] != d or n % kv_shape[2]:
    raise ValueError(f"q {q_BxTxNxH.shape} and k {kv_shape} do not fit [B,T,N,H] / [B,T,K,H].")
  for name, x in (("v", v_BxTxKxH), ("k_past", k_past_BxTxKxH), ("v_past", v_past_BxTxKxH)):
    shape = x.shape if not isinstance(x, kv_formats.PackedKV) else (*x.data.shape[:3], x.head_dim)
    if shape != kv_shape:
      raise ValueError(f"{name} has shape {shape}, expected k's {kv_shape}.")
  if segment_ids_BxT is not None and segment_ids_BxT.shape != (b, t):
    raise ValueError(f"segment_ids has shape {segment_ids_BxT.shape}, expected {(b, t)}.")
  if _past_fmt(k_past_BxTxKxH) != _past_fmt(v_past_BxTxKxH):
    raise ValueError("k_past and v_past must both be arrays or both packed in one format.")
  prefill_block = 1 if prefill_block is None else operator.index(prefill_block)
  if prefill_block < 1:
    raise ValueError(f"prefill_block must be a positive int or None, got {prefill_block!r}.")
  default_q, default_k = platform.FLASH_BLOCKS[platform.platform()]
  block_q, block_k = _block(block_q, default_q, t), _block(block_k, default_k, t)
  sm_scale = float(d**-0.5 if sm_scale is None else sm_scale)
  variant = platform.variant_default(variant)
  interpret = platform.interpret_default(interpret, variant)
  return _attention(
    q_BxTxNxH,
    k_BxTxKxH,
    v_BxTxKxH,
    k_past_BxTxKxH,
    v_past_BxTxKxH,
    segment_ids_BxT,
    sm_scale,
    block_q,
    block_k,
    interpret,
    variant,
    prefill_block,
  )
