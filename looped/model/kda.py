"""Kimi delta attention (KDA, Kimi Linear) behind the sequence-mixer interface.

Follows flash-linear-attention's `KimiDeltaAttention` layer (fla/layers/kda.py, fla 0.6.0):
q, k, v projections, each through a depthwise causal conv (width `kda_conv_size`, no bias) and
SiLU; q, k L2-normalized (eps 1e-6); per-channel log decay g = -exp(A_log[h]) *
softplus(x W_f1 W_f2 + dt_bias); beta = sigmoid(x W_b); the delta rule with decay

    S_t = (I - b_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T (q_t / sqrt(K))

(fla's `naive_recurrent_kda`; S is [H, E] per head); then a sigmoid-gated RMSNorm per head
(gate x W_g1 W_g2 + bias, eps 1e-5) and the output projection.

What a cache stores for KDA is not per token: decode keeps the state S and the conv tail (the
last conv_size - 1 pre-conv projections), a `KDAState`. The per-token entry a parallel forward
returns (for the Jacobi passes' "final K/V") is the token's `KDARecord`: its pre-conv
projections, g and beta. From the final recurrence's records of s < t one recomputes that
recurrence's conv outputs and states S^(R)_{t-1} exactly, because under sharing the final
recurrence of every token starts from the final recurrence's state and conv tail.

Shared read (exact shared decode, and Jacobi passes): recurrence r of token t starts from the
shared state S_{t-1} and applies its own update, so
    o_t = S_{t-1}^T Diag(exp(g_t)) (q_t - b_t (k_t.q_t) k_t) + b_t (k_t.q_t) v_t,
and its conv window is [shared pre-conv projections of t-W+1..t-1 ; its own of t].
The KDA state and conv tail are not quantized by the KV formats (they are per sequence and
rewritten every token; quantizing them would make the chunkwise form sequential).

Document masking (segment ids): a token that starts a document starts from a zero state (its
decay Diag(exp(g_t)) is replaced by 0) and its conv window sees only inputs of its document. The
chunkwise form masks every pair (t, s) of different documents and the start state's share of
tokens of another document than the chunk's previous token, which is exactly that reset.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from looped.model.layers import projection
from looped.model.mixer_interface import MixerContext, kda_cache

if TYPE_CHECKING:  # Annotations only: the config imports the mixer registry, which imports this.
  from looped.model.config import ModelConfig


@flax.struct.dataclass
class KDAState:
  """Decode cache of one KDA layer: the delta-rule state and the conv tail (raw float32)."""

  state_BxNxHxE: jax.Array
  conv_BxWxM: jax.Array  # Pre-conv q|k|v projections of the last conv_size - 1 tokens.


@flax.struct.dataclass
class KDARecord:
  """Per-token quantities from which the final recurrence's states are recomputed."""

  conv_in_BxTxM: jax.Array  # Pre-conv q|k|v projections.
  g_BxTxNxH: jax.Array  # Log decay (float32).
  beta_BxTxN: jax.Array  # float32.


def l2_normalize(x, eps: float = 1e-6):
  """x / sqrt(sum x^2 + eps) over the last axis, as fla's l2norm_fwd."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(jnp.square(x32), axis=-1, keepdims=True) + eps)


def kda_recurrent(
  q_BxTxNxH,
  k_BxTxNxH,
  v_BxTxNxE,
  g_BxTxNxH,
  beta_BxTxN,
  state_BxNxHxE=None,
  *,
  scale=None,
  reset_BxT=None,
):
  """The delta rule one token at a time (decode form). Returns (o_BxTxNxE, final state), f32.

  reset_BxT: tokens that start a document: the state before them is dropped (zero)."""
  b, _, h, kd = q_BxTxNxH.shape
  vd = v_BxTxNxE.shape[-1]
  scale = kd**-0.5 if scale is None else scale
  f32 = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  if state_BxNxHxE is None:
    state_BxNxHxE = jnp.zeros((b, h, kd, vd), jnp.float32)

  def step(s_BxNxHxE, xs):
    q, k, v, g, beta, keep = xs
    s_BxNxHxE = s_BxNxHxE * (jnp.exp(g) * keep[:, None, None])[..., None]
    delta_BxNxE = v - jnp.einsum("bhk,bhkv->bhv", k, s_BxNxHxE)
    s_BxNxHxE = s_BxNxHxE + jnp.einsum("bhk,bhv->bhkv", beta[..., None] * k, delta_BxNxE)
    return s_BxNxHxE, jnp.einsum("bhk,bhkv->bhv", q * scale, s_BxNxHxE)

  if reset_BxT is None:
    reset_BxT = jnp.zeros(q_BxTxNxH.shape[:2], bool)
  keep_BxT = ~reset_BxT
  xs = tuple(map(f32, (q_BxTxNxH, k_BxTxNxH, v_BxTxNxE, g_BxTxNxH, beta_BxTxN, keep_BxT)))
  state, o_TxBxNxE = jax.lax.scan(step, state_BxNxHxE.astype(jnp.float32), xs)
  return jnp.moveaxis(o_TxBxNxE, 0, 1), state


def _decayed_dot(a_CxH, b_CxH, decay_CxCxH):
  """sum_d a_id b_jd decay_ijd (elementwise + reduce: XLA:CPU fuses it, unlike the einsum)."""
  return jnp.sum(a_CxH[..., :, None, :] * b_CxH[..., None, :, :] * decay_CxCxH, axis=-1)


def _unit_lower_solve(lhs_CxC, rhs_CxC):
  """X with lhs X = rhs for unit lower-triangular lhs, by forward substitution row by row.

  Plain XLA ops (no LAPACK custom call, which hung intermittently inside jitted training steps
  on XLA:CPU); differentiable through the loop.
  """
  c = lhs_CxC.shape[-1]

  def row(i, x_CxC):
    lhs_row = jax.lax.dynamic_index_in_dim(lhs_CxC, i, axis=-2, keepdims=True)
    rhs_row = jax.lax.dynamic_index_in_dim(rhs_CxC, i, axis=-2, keepdims=True)
    # Rows >= i of x are still zero, and lhs[i, i] = 1 is not applied: strictly lower part.
    new_row = rhs_row - lhs_row @ x_CxC
    return jax.lax.dynamic_update_index_in_dim(x_CxC, new_row, i, axis=-2)

  return jax.lax.fori_loop(0, c, row, jnp.zeros_like(rhs_CxC))


def _chunked(x, n: int, c: int):
  """[B, T, H, ...] -> [B, H, N, C, ...] float32, zero-padded to N * C."""
  b, t = x.shape[:2]
  x = x.astype(jnp.float32)
  x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape((b, n, c) + x.shape[2:])
  return jnp.moveaxis(x, 3, 1)


def _pair_decay(rows_g, cum_g, mask_CxC):
  """exp(rows_G_i - cum_G_j) where mask, else 0: [..., C, C, K]."""
  diff = rows_g[..., :, None, :] - cum_g[..., None, :, :]
  mask = mask_CxC[..., None]
  return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)


def _document_masks(segment_ids_BxT, n: int, c: int, strict_CxC, qk_mask_CxC):
  """kda_chunkwise's document masking: (strict_CxC, qk_mask_CxC) kept to same-document pairs,
  and float [B, 1, J, (C,) 1] factors: from_start (no document starts between the chunk's start
  state and the token), to_end (the token is in the chunk's last token's document), end_keeps
  (the chunk's last token is in the start state's document)."""
  b, t = segment_ids_BxT.shape
  seg_BxJxC = jnp.pad(segment_ids_BxT, [(0, 0), (0, n * c - t)], mode="edge").reshape(b, n, c)
  prev_BxJ = jnp.concatenate([seg_BxJxC[:, :1, 0], seg_BxJxC[:, :-1, -1]], axis=1)
  same_Bx1xJxCxC = (seg_BxJxC[..., :, None] == seg_BxJxC[..., None, :])[:, None]
  as_f32 = lambda x: x.astype(jnp.float32)[:, None, ..., None]  # [B, 1, J, (C,) 1]
  from_start = as_f32(seg_BxJxC == prev_BxJ[..., None])  # No document starts since S0.
  to_end = as_f32(seg_BxJxC == seg_BxJxC[..., -1:])  # Same document as the chunk's last.
  end_keeps = as_f32(seg_BxJxC[..., -1:] == prev_BxJ[..., None])
  masks = (strict_CxC & same_Bx1xJxCxC, qk_mask_CxC & same_Bx1xJxCxC)
  return (*masks, from_start, to_end, end_keeps)


def _scan_chunks(state_BxNxHxE, w_CxH, u_CxE, a_qk_CxC, q_decayed, k_to_end, decay_end):
  """Carries the state from chunk to chunk: (final state, outputs [J, B, N, C, E])."""

  def step(s_BxNxHxE, xs):
    w, u, a_qk, q_dec, k_end, decay_end = xs
    delta_BxNxCxE = u - w @ s_BxNxHxE
    o_BxNxCxE = q_dec @ s_BxNxHxE + a_qk @ delta_BxNxCxE
    s_BxNxHxE = decay_end[..., 0, :, None] * s_BxNxHxE + jnp.swapaxes(k_end, -1, -2) @ delta_BxNxCxE
    return s_BxNxHxE, o_BxNxCxE

  per_chunk = lambda x: jnp.moveaxis(x, 2, 0)
  xs = tuple(map(per_chunk, (w_CxH, u_CxE, a_qk_CxC, q_decayed, k_to_end, decay_end)))
  return jax.lax.scan(step, state_BxNxHxE.astype(jnp.float32), xs)


def kda_chunkwise(
  q_BxTxNxH,
  k_BxTxNxH,
  v_BxTxNxE,
  g_BxTxNxH,
  beta_BxTxN,
  state_BxNxHxE=None,
  *,
  scale=None,
  chunk_size: int = 64,
  read_previous: bool = False,
  segment_ids_BxT=None,
):
  """The delta rule in chunkwise-parallel (WY) form (training form). Returns (o, final state).

  Within a chunk with inclusive log-decay cumsum G and start state S0, the state updates
  delta = (I + M)^-1 Diag(b) (v - (k e^G) S0) with M_ts = b_t k_t^T Diag(e^(G_t - G_s)) k_s
  (s < t) satisfy S_t = e^(G_t) S0 + sum_{s<=t} Diag(e^(G_t - G_s)) k_s delta_s^T, so every
  output is a masked matmul and only S0 is carried from chunk to chunk.
  read_previous: o_t = S_{t-1}^T q_t (the state *before* token t) instead of S_t^T q_t; the
  shared read queries the final recurrence's states that way.
  Padded tail tokens have k = v = g = b = 0, which leaves the state unchanged.
  segment_ids_BxT: documents (module docstring): a token starting a document drops the state
  before it, so pairs of different documents and the start state's share of a document other
  than the previous token's are masked (state_BxNxHxE belongs to the first token's document).
  With read_previous a document's first token reads a zero state.
  """
  b, t, h, kd = q_BxTxNxH.shape
  vd = v_BxTxNxE.shape[-1]
  scale = kd**-0.5 if scale is None else scale
  c = min(chunk_size, t)
  n = -(-t // c)
  q, k, v, g = (_chunked(x, n, c) for x in (q_BxTxNxH * scale, k_BxTxNxH, v_BxTxNxE, g_BxTxNxH))
  beta_BxNxJxC = _chunked(beta_BxTxN, n, c)
  cum_g = jnp.cumsum(g, axis=-2)  # [B, N, J, C, H], inclusive.
  q_g = cum_g - g if read_previous else cum_g
  strict_CxC = jnp.tril(jnp.ones((c, c), bool), -1)
  qk_mask_CxC = strict_CxC if read_previous else jnp.tril(jnp.ones((c, c), bool))
  from_start, to_end, end_keeps = 1.0, 1.0, 1.0
  if segment_ids_BxT is not None:
    strict_CxC, qk_mask_CxC, from_start, to_end, end_keeps = _document_masks(
      segment_ids_BxT, n, c, strict_CxC, qk_mask_CxC
    )
  m_CxC = _decayed_dot(k, k, _pair_decay(cum_g, cum_g, strict_CxC))
  eye_CxC = jnp.eye(c, dtype=jnp.float32)
  lhs = eye_CxC + beta_BxNxJxC[..., :, None] * m_CxC
  rhs = jnp.broadcast_to(eye_CxC * beta_BxNxJxC[..., None, :], lhs.shape)
  t_CxC = _unit_lower_solve(lhs, rhs)
  w_CxH = t_CxC @ (k * jnp.exp(cum_g) * from_start)
  u_CxE = t_CxC @ v
  a_qk_CxC = _decayed_dot(q, k, _pair_decay(q_g, cum_g, qk_mask_CxC))
  q_decayed = q * jnp.exp(q_g) * from_start
  last_g = cum_g[..., -1:, :]
  k_to_end = k * jnp.exp(last_g - cum_g) * to_end
  decay_end = jnp.exp(last_g) * end_keeps
  if state_BxNxHxE is None:
    state_BxNxHxE = jnp.zeros((b, h, kd, vd), jnp.float32)
  state, o_JxBxNxCxE = _scan_chunks(
    state_BxNxHxE, w_CxH, u_CxE, a_qk_CxC, q_decayed, k_to_end, decay_end
  )
  o_BxTxNxE = jnp.moveaxis(o_JxBxNxCxE, 0, 2).reshape(b, h, n * c, vd)[:, :, :t]
  return jnp.swapaxes(o_BxTxNxE, 1, 2), state


def shared_read(
  q_BxTxNxH,
  k_BxTxNxH,
  v_BxTxNxE,
  g_BxTxNxH,
  beta_BxTxN,
  past,
  *,
  scale=None,
  chunk_size: int = 64,
  state_BxNxHxE=None,
  segment_ids_BxT=None,
):
  """Outputs of tokens that each start from the state S_{t-1} of a *past* sequence.

  past: (k, v, g, beta) of the sequence whose states are read (the final recurrence's); token
  t's own (q, k, v, g, beta) apply one delta-rule step to S_{t-1}, never stored:
  o_t = S_{t-1}^T Diag(e^(g_t)) (q_t - b_t (k_t.q_t) k_t) + b_t (k_t.q_t) v_t. With
  past = own this is the ordinary causal output. With segment_ids_BxT (the past holds the same
  positions) a document's first token starts from a zero state: o_t = b_t (k_t.q_t) v_t.
  """
  kd = q_BxTxNxH.shape[-1]
  scale = kd**-0.5 if scale is None else scale
  q = q_BxTxNxH.astype(jnp.float32) * scale
  k = k_BxTxNxH.astype(jnp.float32)
  beta_BxTxNx1 = beta_BxTxN.astype(jnp.float32)[..., None]
  kq_BxTxNx1 = jnp.sum(k * q, axis=-1, keepdims=True)
  q_tilde = jnp.exp(g_BxTxNxH.astype(jnp.float32)) * (q - beta_BxTxNx1 * kq_BxTxNx1 * k)
  o_past, _ = kda_chunkwise(
    q_tilde,
    *past,
    state_BxNxHxE,
    scale=1.0,
    chunk_size=chunk_size,
    read_previous=True,
    segment_ids_BxT=segment_ids_BxT,
  )
  return o_past + beta_BxTxNx1 * kq_BxTxNx1 * v_BxTxNxE.astype(jnp.float32)


def causal_conv(x_BxTxM, w_WxM, tail_BxWxM=None, segment_ids_BxT=None, tail_segment_ids_BxW=None):
  """Depthwise causal conv: out_t = sum_i w_i x_{t - W + 1 + i}, with `tail` (W - 1 earlier
  inputs, zeros if None) before x. With segment ids (and the tail's, when a tail is given)
  an input of another document than t's contributes nothing."""
  width = w_WxM.shape[0]
  b, t, _ = x_BxTxM.shape
  if tail_BxWxM is None:
    tail_BxWxM = jnp.zeros((b, width - 1, x_BxTxM.shape[2]), x_BxTxM.dtype)
  xp = jnp.concatenate([tail_BxWxM.astype(x_BxTxM.dtype), x_BxTxM], axis=1)
  if segment_ids_BxT is None:
    return sum(xp[:, i : i + t] * w_WxM[i] for i in range(width))
  if tail_segment_ids_BxW is None:  # Zero tail: its ids do not matter.
    tail_segment_ids_BxW = jnp.broadcast_to(segment_ids_BxT[:, :1], (b, width - 1))
  seg_p = jnp.concatenate([tail_segment_ids_BxW, segment_ids_BxT], axis=1)
  same = lambda i: (seg_p[:, i : i + t] == segment_ids_BxT)[..., None].astype(x_BxTxM.dtype)
  return sum(xp[:, i : i + t] * same(i) * w_WxM[i] for i in range(width))


def conv_tail(window_BxSxM, width: int, num_new_B=None):
  """The last `width` conv inputs of each row: window = [old tail ; the chunk's T inputs], and
  a row with num_new_B[b] real tokens ends its tail at its last real one (padding after it
  is not kept). None: every token is real."""
  if num_new_B is None:
    return window_BxSxM[:, window_BxSxM.shape[1] - width :]
  one = lambda row, n: jax.lax.dynamic_slice_in_dim(row, n, width, axis=0)
  return jax.vmap(one)(window_BxSxM, num_new_B)


def _conv_init(key, shape, dtype):
  bound = 1.0 / math.sqrt(shape[0])  # torch Conv1d's default for a depthwise kernel.
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def _a_log_init(key, shape, dtype):
  return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def _dt_bias_init(key, shape, dtype):
  # Inverse softplus of dt log-uniform in [1e-3, 0.1], as fla.
  u = jax.random.uniform(key, shape, jnp.float32)
  dt = jnp.maximum(jnp.exp(u * (math.log(0.1) - math.log(0.001)) + math.log(0.001)), 1e-4)
  return (dt + jnp.log(-jnp.expm1(-dt))).astype(dtype)


class KDA(nn.Module):
  """Kimi delta attention: num_heads heads of key and value width head_dim.

  ctx.past (mixer_interface.MixerContext) selects the form: None: chunkwise causal
  forward; a `KDAState`: recurrent decode from it (returns the new state); a function of the
  own `KDARecord` (parallel shared / quantized-read passes): the shared read of the returned
  records' states (the own records give the ordinary causal output). ctx.read_past and the
  masks are not used: KDA's cache is not quantized and has no slots; ctx.segment_ids_BxT (and
  in decode ctx.tail_segment_ids_BxW) reset the state and conv window where a document starts.
  In decode, ctx.num_new_B marks each row's padding tokens, which leave its state and conv tail
  unchanged.
  """

  cfg: ModelConfig
  out_std: float
  mixer_cache: ClassVar = staticmethod(kda_cache)

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, ctx: MixerContext):
    del positions_BxT  # The conv carries position information.
    cfg = self.cfg
    conv_in_BxTxM, conv_w, g_BxTxNxH, beta_BxTxN = self._inputs(x_BxTxD)
    own = KDARecord(conv_in_BxTxM, g_BxTxNxH, beta_BxTxN)
    conv_w = conv_w.astype(jnp.float32)
    past = ctx.past(own) if callable(ctx.past) else ctx.past
    conv_in32 = conv_in_BxTxM.astype(jnp.float32)
    seg_BxT = ctx.segment_ids_BxT
    if past is None:
      q, k, v = _split_qkv(causal_conv(conv_in32, conv_w, segment_ids_BxT=seg_BxT), cfg)
      o_BxTxNxE, _ = kda_chunkwise(
        q, k, v, g_BxTxNxH, beta_BxTxN, chunk_size=cfg.kda_chunk_size, segment_ids_BxT=seg_BxT
      )
      entry = own
    elif isinstance(past, KDAState):
      o_BxTxNxE, entry = _decode_from_state(
        cfg, ctx, past, conv_in32, conv_w, g_BxTxNxH, beta_BxTxN
      )
    else:
      o_BxTxNxE = _read_shared_records(cfg, seg_BxT, past, conv_in32, conv_w, g_BxTxNxH, beta_BxTxN)
      entry = own
    return self._output(x_BxTxD, o_BxTxNxE), entry

  def _inputs(self, x_BxTxD):
    """The chunk's conv input [B, T, 3 N H], conv kernel, log-decay g [B, T, N, H] and beta
    [B, T, N] (both float32)."""
    cfg = self.cfg
    h, kd = cfg.num_heads, cfg.head_dim
    channels = 3 * h * kd
    conv_in_BxTxM = projection(cfg, channels, cfg.init_std, "qkv", axes=("embed", None))(x_BxTxD)
    conv_w = self.param("conv", _conv_init, (cfg.kda_conv_size, channels), cfg.weight_dtype)
    f_BxTxA = projection(cfg, kd, cfg.init_std, "decay_down", axes=("embed", None))(x_BxTxD)
    f_BxTxNxH = projection(cfg, (h, kd), cfg.init_std, "decay_up", axes=(None, "heads", None))(
      f_BxTxA
    )
    a_log_N = self.param("A_log", _a_log_init, (h,), jnp.float32)
    dt_bias_NxH = self.param("dt_bias", _dt_bias_init, (h, kd), jnp.float32)
    g_BxTxNxH = -jnp.exp(a_log_N)[:, None] * jax.nn.softplus(
      f_BxTxNxH.astype(jnp.float32) + dt_bias_NxH
    )
    beta_BxTxN = jax.nn.sigmoid(
      projection(cfg, h, cfg.init_std, "beta", axes=("embed", None))(x_BxTxD).astype(jnp.float32)
    )
    return conv_in_BxTxM, conv_w, g_BxTxNxH, beta_BxTxN

  def _output(self, x_BxTxD, o_BxTxNxE):
    """The heads' outputs RMS-normed, gated by a low-rank projection of x, projected out."""
    cfg = self.cfg
    h, kd = cfg.num_heads, cfg.head_dim
    gate_BxTxA = projection(cfg, kd, cfg.init_std, "gate_down", axes=("embed", None))(x_BxTxD)
    gate_BxTxNxE = nn.DenseGeneral(
      (h, kd),
      use_bias=True,
      kernel_init=nn.initializers.normal(cfg.init_std),
      dtype=cfg.compute_dtype,
      param_dtype=cfg.weight_dtype,
      name="gate_up",
    )(gate_BxTxA)
    norm_scale = self.param("out_norm", nn.initializers.ones, (kd,), cfg.weight_dtype)
    o32 = o_BxTxNxE * jax.lax.rsqrt(jnp.mean(jnp.square(o_BxTxNxE), -1, keepdims=True) + 1e-5)
    o32 = o32 * norm_scale.astype(jnp.float32) * jax.nn.sigmoid(gate_BxTxNxE.astype(jnp.float32))
    out = o32.astype(cfg.compute_dtype)
    return projection(
      cfg, cfg.d_model, self.out_std, "out", axis=(-2, -1), axes=("heads", "head_dim", "embed")
    )(out)


def _split_qkv(conv_out_BxTxM, cfg: ModelConfig):
  """(q, k, v) [B, T, N, H] of the conv's output: SiLU, then q and k L2-normalized."""
  b, h, kd = conv_out_BxTxM.shape[0], cfg.num_heads, cfg.head_dim
  q, k, v = jnp.split(jax.nn.silu(conv_out_BxTxM).reshape(b, -1, 3 * h, kd), 3, axis=2)
  return l2_normalize(q), l2_normalize(k), v


def _decode_from_state(
  cfg: ModelConfig, ctx: MixerContext, past: KDAState, conv_in32, conv_w, g, beta
):
  """Recurrent decode of a chunk from the cached state and conv tail: (outputs, new KDAState).
  Padding tokens (ctx.num_new_B) leave both as they are; a document start resets them."""
  t = conv_in32.shape[1]
  seg_BxT = ctx.segment_ids_BxT
  tail_seg, reset_BxT = None, None
  if seg_BxT is not None:  # The tail's documents, and which tokens start one.
    before_BxW = ctx.tail_segment_ids_BxW
    tail_seg = before_BxW[:, before_BxW.shape[1] - (cfg.kda_conv_size - 1) :]
    previous_BxT = jnp.concatenate([before_BxW[:, -1:], seg_BxT[:, :-1]], axis=1)
    reset_BxT = seg_BxT != previous_BxT
  q, k, v = _split_qkv(causal_conv(conv_in32, conv_w, past.conv_BxWxM, seg_BxT, tail_seg), cfg)
  g_step, beta_step = g, beta
  if ctx.num_new_B is not None:  # Padding: g = b = 0 leaves the state exactly as it is.
    real_BxT = jnp.arange(t)[None, :] < ctx.num_new_B[:, None]
    g_step = jnp.where(real_BxT[:, :, None, None], g, 0.0)
    beta_step = jnp.where(real_BxT[:, :, None], beta, 0.0)
    if reset_BxT is not None:  # Nor does a padding token start a document.
      reset_BxT = reset_BxT & real_BxT
  o_BxTxNxE, state = kda_recurrent(
    q, k, v, g_step, beta_step, past.state_BxNxHxE, reset_BxT=reset_BxT
  )
  window = jnp.concatenate([past.conv_BxWxM, conv_in32], axis=1)
  return o_BxTxNxE, KDAState(state, conv_tail(window, cfg.kda_conv_size - 1, ctx.num_new_B))


def _read_shared_records(cfg: ModelConfig, seg_BxT, past: KDARecord, conv_in32, conv_w, g, beta):
  """Shared read of past records (s < t); the diagonal is the token's own."""
  past_in32 = past.conv_in_BxTxM.astype(jnp.float32)
  past_conv = causal_conv(past_in32, conv_w, segment_ids_BxT=seg_BxT)
  _, k_p, v_p = _split_qkv(past_conv, cfg)
  q, k, v = _split_qkv(past_conv + conv_w[-1] * (conv_in32 - past_in32), cfg)
  past_seq = (k_p, v_p, past.g_BxTxNxH, past.beta_BxTxN)
  return shared_read(
    q, k, v, g, beta, past_seq, chunk_size=cfg.kda_chunk_size, segment_ids_BxT=seg_BxT
  )
