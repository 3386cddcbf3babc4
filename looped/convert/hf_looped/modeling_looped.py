"""PyTorch looped LM for transformers: the model `looped` trains, exported by its export program
(configs/export.py, export.family=looped) and loaded with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

Written by the `looped` project as a port of its JAX model (looped/model/looped_lm.py and the
mixers beside it); the names of the weights follow that model's parameter tree.

    tokens -> embed (x embed_scale) -> prelude -> [norm] -> e;  h_0 = init(e)
    h_r = core(inject(h_(r-1), e))  r = 1..R   (one set of core weights)
    -> [core_out] -> coda -> final norm -> head (tied to the embedding or not)

Layers are x + mixer(norm(x)) then x + mlp(norm(x)) ('pre'; 'sandwich' also normalizes each
branch's output, 'post' each sum); the mixer of each layer is grouped-query attention with RoPE
('gqa', with optional QK-norm, QK bias, stored RoPE table and value embeddings), multi-head latent
attention ('mla') or Kimi delta attention ('kda'); the MLP is SwiGLU or ReLU^2. e enters each
recurrence diagonally (h <- a h + softplus(dt) e B^T), linearly ([h; e] W), additively or not at
all. h_0 is the exported noise table at the token's position (state_init 'like_init': the draw
looped's model makes), zeros, or e.

A forward without a cache (use_cache not True, no cache passed) runs all positions at once, the
model as trained (every recurrence's attention reads its own keys and values). A forward with a
cache (`LoopedCache`; generate() makes one) computes its chunk as looped's decode does:

- share_kv=False: the cache keeps every recurrence's keys and values of the core layers, so
  any chunking gives the forward's logits;
- share_kv=True: it keeps only the recurrences kv_policy caches ('final': the last one), and
  recurrence r of token t reads, for earlier tokens s < t of earlier calls, the keys and values
  that recurrence c(r) wrote for them, and its own recurrence-r ones inside its call (a block)
  and at s = t (looped's docs/design.md §3). A chunk is cut into blocks of prefill_block tokens
  aligned from position 0; generate()'s later calls are one token each, so generate() computes
  what looped's generation program (configs/generate.py) computes.

num_recurrences (R') runs the loop at another depth than the recorded R; a cache is made for one
R'. A KDA layer's cache is its state and conv tail, one per sequence; under sharing every
recurrence starts from the final recurrence's state (only kv_policy 'final').

Batches may be padded (attention_mask): each row's tokens must be one contiguous run (left or
right padding) in the first chunk of a cache; a row's positions count from its first token, as
each row alone would. Under sharing, a later chunk of several tokens (blocks aligned to its
start) needs the cache's rows at one length; generate()'s one-token calls need nothing.
generate() decodes greedily or samples; beam search (it reorders caches transformers knows) is
not supported.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.utils import ModelOutput

from .configuration_looped import LoopedConfig

STAGES = ("prelude", "core", "coda")


# --- KV-sharing policies (looped/model/kv_policy.py): c(r), r = 1..R ---


def kv_policy_reads(name: str, big_r: int) -> tuple[int, ...]:
  """c(1..R) of the policy `name` for R recurrences; ValueError naming it if it is none."""
  rs = range(1, big_r + 1)
  fixed = {"final": [big_r] * big_r, "first": [1] * big_r, "full": list(rs)}
  if name in fixed:
    return tuple(fixed[name])
  if name.startswith("boundaries:"):
    try:
      ends = [int(x) for x in name[len("boundaries:") :].split("-")]
    except ValueError:
      raise ValueError(f"kv_policy = {name!r}: boundaries need integers joined by '-'") from None
    if any(b <= a for a, b in zip(ends, ends[1:])) or ends[0] < 1 or ends[-1] != big_r:
      raise ValueError(f"kv_policy = {name!r}: boundaries must increase and end at R = {big_r}")
    return tuple(min(b for b in ends if b >= r) for r in rs)
  match = re.fullmatch(r"(keep_first|keep_last|stride|huginn_mod|huginn_anchor)(\d+)", name)
  if not match or not 1 <= int(match.group(2)) <= big_r:
    raise ValueError(f"kv_policy = {name!r} is not a KV-sharing policy for R = {big_r}")
  form, n = match.group(1), int(match.group(2))
  if form == "keep_first":
    return tuple(min(r, n) for r in rs)
  if form == "keep_last":
    return tuple(max(r, big_r - n + 1) for r in rs)
  if form == "stride":
    return tuple(min(n * -(-r // n), big_r) for r in rs)
  if form == "huginn_mod":
    return tuple(max(q for q in rs if q % n == r % n) for r in rs)
  return tuple(r if r <= n else big_r for r in rs)  # huginn_anchor


def read_slot(reads: tuple[int, ...], r: int) -> int:
  """The cached copy recurrence r (1-based) reads: its c(r)'s index among the cached ones."""
  return sorted(set(reads)).index(reads[r - 1])


# --- The cache ---


class LoopedCache:
  """Per-row length and, per layer, what decode reads: keys and values (GQA), latent and RoPE key
  (MLA), per-token [B, S, ...] tensors; state and conv tail (KDA), per sequence. A core layer's
  entry leads with its copies: R' (share_kv=False) or the policy's cached recurrences."""

  def __init__(self, share_kv: bool, kv_policy: str, num_recurrences: int, batch: int, device):
    self.share_kv = share_kv
    self.kv_policy = kv_policy
    self.num_recurrences = num_recurrences
    self.reads = kv_policy_reads(kv_policy, num_recurrences) if share_kv else None
    self.length = torch.zeros(batch, dtype=torch.long, device=device)
    self.layers = {stage: {} for stage in STAGES}
    self.seen = 0  # Input columns consumed (generate() feeds the columns after them).

  def get_seq_length(self, layer_idx: int = 0) -> int:
    return self.seen

  def slot(self, r: int) -> int:
    """Which copy of a core entry recurrence r reads."""
    return read_slot(self.reads, r) if self.share_kv else r - 1

  @property
  def cached(self) -> tuple[int, ...]:
    """The recurrences whose core entries the cache keeps."""
    if self.share_kv:
      return tuple(sorted(set(self.reads)))
    return tuple(range(1, self.num_recurrences + 1))

  def read(self, stage: str, i: int, slot: int | None):
    entry = self.layers[stage].get(i)
    if entry is None or slot is None:
      return entry
    return tuple(x[slot] for x in entry)

  def write(self, stage: str, i: int, new: tuple, kind: str, t: int) -> None:
    """Stores a layer's chunk: per-token entries at each row's next t slots, a KDA state as
    it is. `new` leads with the copies axis for core layers."""
    if kind == "kda":
      self.layers[stage][i] = new
      return
    lead = 1 if stage == "core" else 0
    old = self.layers[stage].get(i)
    need = int(self.length.max()) + t
    if old is None or old[0].shape[lead + 1] < need:
      size = max(need, 2 * old[0].shape[lead + 1] if old is not None else need)
      grown = []
      for j, x in enumerate(new):
        shape = list(x.shape)
        shape[lead + 1] = size
        buf = torch.zeros(shape, dtype=x.dtype, device=x.device)
        if old is not None:
          buf.narrow(lead + 1, 0, old[j].shape[lead + 1]).copy_(old[j])
        grown.append(buf)
      old = tuple(grown)
    b = self.length.shape[0]
    rows = torch.arange(b, device=self.length.device)[:, None].expand(b, t)
    slots = self.length[:, None] + torch.arange(t, device=self.length.device)[None, :]
    for buf, x in zip(old, new):
      if lead:
        buf[:, rows, slots] = x.to(buf.dtype)
      else:
        buf[rows, slots] = x.to(buf.dtype)
    self.layers[stage][i] = old


@dataclasses.dataclass
class Reads:
  """What a mixer's new tokens read: `past` (None, or the cache's entry for this layer and
  recurrence), each row's filled slots (`length`), each row's real tokens among the chunk's
  (`num_new`, None: all) and the token ids (value embeddings)."""

  past: tuple | None
  length: torch.Tensor | None
  num_new: torch.Tensor | None
  tokens: torch.Tensor


# --- Building blocks ---


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
  """RMSNorm over the last axis in float32, back in x's dtype."""
  x32 = x.float()
  y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
  return (y * weight.float()).to(x.dtype)


class RMSNorm(nn.Module):
  def __init__(self, width: int, eps: float):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(width))
    self.eps = eps

  def forward(self, x):
    return rms_norm(x, self.weight, self.eps)


def rope(x_BxTxNxH, positions_BxT, base: float, table_SxFx2=None):
  """Rotary embedding rotating halves (i, i + H/2), in float32, back in x's dtype; with a table
  ([S, H/2, 2] cos, sin) the angles are read from it (clipped at its last row)."""
  half = x_BxTxNxH.shape[-1] // 2
  if table_SxFx2 is None:
    exponent = torch.arange(half, dtype=torch.float32) * torch.tensor(1.0 / half)
    inv_freq_F = (1.0 / torch.tensor(base, dtype=torch.float64) ** exponent.double()).float()
    angles_BxTxF = positions_BxT[..., None].float() * inv_freq_F.to(x_BxTxNxH.device)
    cos, sin = torch.cos(angles_BxTxF)[:, :, None, :], torch.sin(angles_BxTxF)[:, :, None, :]
  else:
    rows_BxT = positions_BxT.clamp(0, table_SxFx2.shape[0] - 1)
    cs_BxTxFx2 = table_SxFx2.float()[rows_BxT]
    cos, sin = cs_BxTxFx2[:, :, None, :, 0], cs_BxTxFx2[:, :, None, :, 1]
  x1, x2 = x_BxTxNxH.float().split(half, dim=-1)
  out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
  return out.to(x_BxTxNxH.dtype)


def masks(reads: Reads, t: int, s: int, device):
  """(self mask [1, T, T] causal, past mask [B, T, S]: slot s < the row's length)."""
  self_mask_1xTxT = torch.ones(t, t, dtype=torch.bool, device=device).tril()[None]
  past_mask_BxTxS = None
  if reads.past is not None:
    filled_BxS = torch.arange(s, device=device)[None, :] < reads.length[:, None]
    past_mask_BxTxS = filled_BxS[:, None, :].expand(-1, t, -1)
  return self_mask_1xTxT, past_mask_BxTxS


def softmax_rows(logits, mask):
  """Masked softmax over the last axis in float32; rows that see nothing are zeros."""
  logits = logits.masked_fill(~mask, float("-inf"))
  row_max = logits.amax(-1, keepdim=True)
  row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
  p = torch.where(mask, torch.exp(logits - row_max), torch.zeros_like(logits))
  return p / p.sum(-1, keepdim=True).clamp_min(1e-30)


def attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, self_mask_1xTxT, past=None, past_mask_BxTxS=None):
  """Softmax attention over [past slots ; own chunk] (grouped queries), in float32."""
  b, t, n, h = q_BxTxNxH.shape
  kh = k_BxTxKxH.shape[2]
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, kh, n // kh, h).float() * (h**-0.5)
  keys, values, masks_ = [k_BxTxKxH], [v_BxTxKxH], [self_mask_1xTxT.expand(b, t, t)]
  if past is not None:
    keys.insert(0, past[0])
    values.insert(0, past[1])
    masks_.insert(0, past_mask_BxTxS)
  k_BxSxKxH = torch.cat([x.float() for x in keys], 1)
  v_BxSxKxH = torch.cat([x.float() for x in values], 1)
  logits_BxKxGxTxS = torch.einsum("btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxSxKxH)
  p_BxKxGxTxS = softmax_rows(logits_BxKxGxTxS, torch.cat(masks_, -1)[:, None, None])
  out_BxTxKxGxH = torch.einsum("bkgts,bskh->btkgh", p_BxKxGxTxS, v_BxSxKxH)
  return out_BxTxKxGxH.reshape(b, t, n, h).to(q_BxTxNxH.dtype)


def linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
  return nn.Linear(n_in, n_out, bias=bias)


class ValueEmbedding(nn.Module):
  """A gated per-token table added to a layer's values: 2 sigmoid(x[:G] W) * table[token]."""

  def __init__(self, config: LoopedConfig):
    super().__init__()
    self.config = config
    c = config
    self.table = nn.Parameter(torch.zeros(c.vocab_size, c.num_kv_heads, c.head_dim))
    self.gate = linear(c.value_embed_gate_dim, c.num_kv_heads)

  def forward(self, x_BxTxD, tokens_BxT):
    gate_BxTxK = 2 * torch.sigmoid(self.gate(x_BxTxD[..., : self.config.value_embed_gate_dim]))
    return gate_BxTxK[..., None] * self.table[tokens_BxT].to(gate_BxTxK.dtype)


class Attention(nn.Module):
  """Grouped-query attention with RoPE; its cache entry is the post-RoPE keys and values."""

  def __init__(self, config: LoopedConfig, value_embed: bool):
    super().__init__()
    c = config
    self.config = c
    self.query = linear(c.d_model, c.num_heads * c.head_dim)
    self.key = linear(c.d_model, c.num_kv_heads * c.head_dim)
    self.value = linear(c.d_model, c.num_kv_heads * c.head_dim)
    self.out = linear(c.num_heads * c.head_dim, c.d_model)
    if value_embed:
      self.value_embed = ValueEmbedding(c)
    if c.qk_bias:
      self.query_bias = nn.Parameter(torch.zeros(c.num_heads, c.head_dim))
      self.key_bias = nn.Parameter(torch.zeros(c.num_kv_heads, c.head_dim))
    if c.qk_norm:
      self.query_norm = RMSNorm(c.head_dim, c.qk_norm_eps)
      self.key_norm = RMSNorm(c.head_dim, c.qk_norm_eps)
    if c.rope_table:  # Read, never trained (a converted checkpoint's table).
      shape = (c.max_seq_len, c.head_dim // 2, 2)
      self.rope_table = nn.Parameter(torch.zeros(shape, dtype=torch.float32), requires_grad=False)

  def forward(self, x_BxTxD, positions_BxT, reads: Reads):
    c = self.config
    b, t, _ = x_BxTxD.shape
    q_BxTxNxH = self.query(x_BxTxD).view(b, t, c.num_heads, c.head_dim)
    k_BxTxKxH = self.key(x_BxTxD).view(b, t, c.num_kv_heads, c.head_dim)
    v_BxTxKxH = self.value(x_BxTxD).view(b, t, c.num_kv_heads, c.head_dim)
    if hasattr(self, "value_embed"):
      v_BxTxKxH = v_BxTxKxH + self.value_embed(x_BxTxD, reads.tokens).to(v_BxTxKxH.dtype)
    if c.qk_bias:
      q_BxTxNxH = q_BxTxNxH + self.query_bias.to(q_BxTxNxH.dtype)
      k_BxTxKxH = k_BxTxKxH + self.key_bias.to(k_BxTxKxH.dtype)
    if c.qk_norm:
      q_BxTxNxH, k_BxTxKxH = self.query_norm(q_BxTxNxH), self.key_norm(k_BxTxKxH)
    table_SxFx2 = self.rope_table if c.rope_table else None
    q_BxTxNxH = rope(q_BxTxNxH, positions_BxT, c.rope_base, table_SxFx2)
    k_BxTxKxH = rope(k_BxTxKxH, positions_BxT, c.rope_base, table_SxFx2)
    s = reads.past[0].shape[1] if reads.past is not None else 0
    self_mask_1xTxT, past_mask_BxTxS = masks(reads, t, s, x_BxTxD.device)
    out_BxTxNxH = attend(
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, self_mask_1xTxT, reads.past, past_mask_BxTxS
    )
    return self.out(out_BxTxNxH.reshape(b, t, -1)), (k_BxTxKxH, v_BxTxKxH)


class MLA(nn.Module):
  """Multi-head latent attention; its cache entry is the normalized latent and the RoPE key.
  Without a past it computes the expanded form, with one the absorbed form (as looped)."""

  def __init__(self, config: LoopedConfig):
    super().__init__()
    c = config
    self.config = c
    n, h, r = c.num_heads, c.head_dim, c.mla_rope_dim
    if c.mla_q_rank:
      self.query_down = linear(c.d_model, c.mla_q_rank)
      self.query_norm = RMSNorm(c.mla_q_rank, c.norm_eps)
      self.query_up = linear(c.mla_q_rank, n * (h + r))
    else:
      self.query = linear(c.d_model, n * (h + r))
    self.kv_down = linear(c.d_model, c.mla_kv_rank + r)
    self.kv_norm = RMSNorm(c.mla_kv_rank, c.norm_eps)
    self.key_up = nn.Parameter(torch.zeros(c.mla_kv_rank, n, h))
    self.value_up = nn.Parameter(torch.zeros(c.mla_kv_rank, n, h))
    self.out = linear(n * h, c.d_model)

  def forward(self, x_BxTxD, positions_BxT, reads: Reads):
    c = self.config
    b, t, _ = x_BxTxD.shape
    n, h, rank = c.num_heads, c.head_dim, c.mla_kv_rank
    if c.mla_q_rank:
      q_BxTxE = self.query_up(self.query_norm(self.query_down(x_BxTxD)))
    else:
      q_BxTxE = self.query(x_BxTxD)
    q_BxTxNxE = q_BxTxE.view(b, t, n, -1)
    q_nope_BxTxNxH = q_BxTxNxE[..., :h]
    q_rope_BxTxNxY = rope(q_BxTxNxE[..., h:], positions_BxT, c.rope_base)
    kv_BxTxE = self.kv_down(x_BxTxD)
    latent_BxTx1xL = self.kv_norm(kv_BxTxE[..., :rank])[:, :, None, :]
    k_rope_BxTx1xY = rope(kv_BxTxE[:, :, None, rank:], positions_BxT, c.rope_base)
    own = (latent_BxTx1xL, k_rope_BxTx1xY)
    s = reads.past[0].shape[1] if reads.past is not None else 0
    self_mask_1xTxT, past_mask_BxTxS = masks(reads, t, s, x_BxTxD.device)
    mask_BxTxS = self_mask_1xTxT.expand(b, t, t)
    latent_BxSx1xL, k_rope_BxSx1xY = own
    if reads.past is not None:
      latent_BxSx1xL = torch.cat([reads.past[0].to(latent_BxTx1xL.dtype), latent_BxTx1xL], 1)
      k_rope_BxSx1xY = torch.cat([reads.past[1].to(k_rope_BxTx1xY.dtype), k_rope_BxTx1xY], 1)
      mask_BxTxS = torch.cat([past_mask_BxTxS, mask_BxTxS], -1)
    q_nope, q_rope = q_nope_BxTxNxH.float(), q_rope_BxTxNxY.float()
    c_BxSxL, k_rope_BxSxY = latent_BxSx1xL[:, :, 0].float(), k_rope_BxSx1xY[:, :, 0].float()
    w_uk_LxNxH, w_uv_LxNxH = self.key_up.float(), self.value_up.float()
    scale = (h + q_rope.shape[-1]) ** -0.5
    rope_logits_BxNxTxS = torch.einsum("btnr,bsr->bnts", q_rope, k_rope_BxSxY)
    if reads.past is None:  # Expanded: ordinary attention on the up-projected keys and values.
      k_nope_BxSxNxH = torch.einsum("bsc,cnh->bsnh", c_BxSxL, w_uk_LxNxH)
      v_BxSxNxH = torch.einsum("bsc,cnh->bsnh", c_BxSxL, w_uv_LxNxH)
      logits_BxNxTxS = torch.einsum("btnh,bsnh->bnts", q_nope, k_nope_BxSxNxH)
      p_BxNxTxS = softmax_rows((logits_BxNxTxS + rope_logits_BxNxTxS) * scale, mask_BxTxS[:, None])
      out_BxTxNxH = torch.einsum("bnts,bsnh->btnh", p_BxNxTxS, v_BxSxNxH)
    else:  # Absorbed: W_UK into the query, W_UV after the sum over the cached latents.
      q_latent_BxTxNxL = torch.einsum("btnh,cnh->btnc", q_nope, w_uk_LxNxH)
      logits_BxNxTxS = torch.einsum("btnc,bsc->bnts", q_latent_BxTxNxL, c_BxSxL)
      p_BxNxTxS = softmax_rows((logits_BxNxTxS + rope_logits_BxNxTxS) * scale, mask_BxTxS[:, None])
      out_latent_BxTxNxL = torch.einsum("bnts,bsc->btnc", p_BxNxTxS, c_BxSxL)
      out_BxTxNxH = torch.einsum("btnc,cnh->btnh", out_latent_BxTxNxL, w_uv_LxNxH)
    out_BxTxNxH = out_BxTxNxH.to(x_BxTxD.dtype)
    return self.out(out_BxTxNxH.reshape(b, t, n * h)), own


def l2_normalize(x, eps: float = 1e-6):
  x32 = x.float()
  return x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)


class KDA(nn.Module):
  """Kimi delta attention (looped/model/kda.py): q, k, v through a short causal conv and SiLU,
  per-channel decay g, the delta rule one token at a time, a gated RMSNorm, the output
  projection. Its cache is the state S [B, N, H, H] and the conv tail (float32)."""

  def __init__(self, config: LoopedConfig):
    super().__init__()
    c = config
    self.config = c
    n, h = c.num_heads, c.head_dim
    self.qkv = linear(c.d_model, 3 * n * h)
    self.conv = nn.Parameter(torch.zeros(c.kda_conv_size, 3 * n * h))
    self.decay_down = linear(c.d_model, h)
    self.decay_up = linear(h, n * h)
    self.A_log = nn.Parameter(torch.zeros(n, dtype=torch.float32))
    self.dt_bias = nn.Parameter(torch.zeros(n, h, dtype=torch.float32))
    self.beta = linear(c.d_model, n)
    self.gate_down = linear(c.d_model, h)
    self.gate_up = linear(h, n * h, bias=True)
    self.out_norm = nn.Parameter(torch.ones(h))
    self.out = linear(n * h, c.d_model)

  def forward(self, x_BxTxD, positions_BxT, reads: Reads):
    del positions_BxT  # The conv carries position information.
    c = self.config
    b, t, _ = x_BxTxD.shape
    n, h, width = c.num_heads, c.head_dim, c.kda_conv_size
    conv_in_BxTxM = self.qkv(x_BxTxD).float()
    f_BxTxNxH = self.decay_up(self.decay_down(x_BxTxD)).view(b, t, n, h).float()
    g_BxTxNxH = -torch.exp(self.A_log.float())[:, None] * F.softplus(
      f_BxTxNxH + self.dt_bias.float()
    )
    beta_BxTxN = torch.sigmoid(self.beta(x_BxTxD).float())
    if reads.past is None:
      state_BxNxHxE = torch.zeros(b, n, h, h, dtype=torch.float32, device=x_BxTxD.device)
      tail_BxWxM = conv_in_BxTxM.new_zeros(b, width - 1, conv_in_BxTxM.shape[-1])
    else:
      state_BxNxHxE, tail_BxWxM = (z.float() for z in reads.past)
    window_BxSxM = torch.cat([tail_BxWxM, conv_in_BxTxM], 1)
    w_WxM = self.conv.float()
    conv_out_BxTxM = sum(window_BxSxM[:, i : i + t] * w_WxM[i] for i in range(width))
    q, k, v = F.silu(conv_out_BxTxM).view(b, t, 3 * n, h).split(n, dim=2)
    q_BxTxNxH, k_BxTxNxH, v_BxTxNxE = l2_normalize(q), l2_normalize(k), v
    if reads.num_new is not None:  # Padding: g = beta = 0 leaves the state as it is.
      real_BxT = torch.arange(t, device=x_BxTxD.device)[None, :] < reads.num_new[:, None]
      g_BxTxNxH = torch.where(real_BxT[:, :, None, None], g_BxTxNxH, torch.zeros_like(g_BxTxNxH))
      beta_BxTxN = torch.where(real_BxT[:, :, None], beta_BxTxN, torch.zeros_like(beta_BxTxN))
    scale = h**-0.5
    outs = []
    for j in range(t):  # S_t = (I - b k k^T) Diag(e^g) S_(t-1) + b k v^T;  o_t = S_t^T q / sqrt(H)
      k_BxNxH = k_BxTxNxH[:, j]
      state_BxNxHxE = state_BxNxHxE * torch.exp(g_BxTxNxH[:, j])[..., None]
      delta_BxNxE = v_BxTxNxE[:, j] - torch.einsum("bnk,bnkv->bnv", k_BxNxH, state_BxNxHxE)
      update = torch.einsum("bnk,bnv->bnkv", beta_BxTxN[:, j, :, None] * k_BxNxH, delta_BxNxE)
      state_BxNxHxE = state_BxNxHxE + update
      outs.append(torch.einsum("bnk,bnkv->bnv", q_BxTxNxH[:, j] * scale, state_BxNxHxE))
    o_BxTxNxE = torch.stack(outs, 1)
    if reads.num_new is None:
      new_tail_BxWxM = window_BxSxM[:, window_BxSxM.shape[1] - (width - 1) :]
    else:  # The tail ends at each row's last real token.
      cols_BxW = reads.num_new[:, None] + torch.arange(width - 1, device=x_BxTxD.device)[None, :]
      cols_BxWxM = cols_BxW[:, :, None].expand(-1, -1, window_BxSxM.shape[-1])
      new_tail_BxWxM = window_BxSxM.gather(1, cols_BxWxM)
    gate_BxTxNxE = self.gate_up(self.gate_down(x_BxTxD)).view(b, t, n, h)
    o_BxTxNxE = o_BxTxNxE * torch.rsqrt(o_BxTxNxE.square().mean(-1, keepdim=True) + 1e-5)
    o_BxTxNxE = o_BxTxNxE * self.out_norm.float() * torch.sigmoid(gate_BxTxNxE.float())
    y_BxTxD = self.out(o_BxTxNxE.to(x_BxTxD.dtype).reshape(b, t, n * h))
    return y_BxTxD, (state_BxNxHxE, new_tail_BxWxM)


class Mlp(nn.Module):
  def __init__(self, config: LoopedConfig):
    super().__init__()
    self.swiglu = config.mlp_type == "swiglu"
    self.up = linear(config.d_model, config.mlp_dim)
    if self.swiglu:
      self.gate = linear(config.d_model, config.mlp_dim)
    self.down = linear(config.mlp_dim, config.d_model)

  def forward(self, x):
    up = self.up(x)
    hidden = F.silu(self.gate(x)) * up if self.swiglu else torch.square(F.relu(up))
    return self.down(hidden)


MIXERS = {"gqa": "attn", "mla": "mla", "kda": "kda"}  # The mixer's weight names.
# Params looped keeps in float32 whatever param_dtype is (by name; no other param has these).
FLOAT32_PARAMS = ("A_log", "dt", "dt_bias", "rope_table", "exit_gate_bias")


class Block(nn.Module):
  """x + mixer(norm(x)), then x + mlp(norm(x)) (block_norm 'pre'; 'sandwich' and 'post' add a
  norm on each branch's output or on each sum)."""

  def __init__(self, config: LoopedConfig, mixer: str, value_embed: bool):
    super().__init__()
    self.config = config
    self.mixer = mixer
    eps = config.norm_eps
    self.attn_norm = RMSNorm(config.d_model, eps)
    module = {
      "gqa": lambda: Attention(config, value_embed),
      "mla": lambda: MLA(config),
      "kda": lambda: KDA(config),
    }[mixer]()
    setattr(self, MIXERS[mixer], module)
    self.mlp_norm = RMSNorm(config.d_model, eps)
    self.mlp = Mlp(config)
    if config.block_norm != "pre":
      self.attn_out_norm = RMSNorm(config.d_model, eps)
      self.mlp_out_norm = RMSNorm(config.d_model, eps)

  def _residual(self, x, y, norm):
    if self.config.block_norm == "pre":
      return x + y
    if self.config.block_norm == "sandwich":
      return x + norm(y)
    return norm(x + y)

  def forward(self, x, positions, reads: Reads):
    mixer = getattr(self, MIXERS[self.mixer])
    y, entry = mixer(self.attn_norm(x), positions, reads)
    x = self._residual(x, y, getattr(self, "attn_out_norm", None))
    y = self.mlp(self.mlp_norm(x))
    return self._residual(x, y, getattr(self, "mlp_out_norm", None)), entry


class Injection(nn.Module):
  """h <- exp(-softplus(dt) exp(A_log)) h + softplus(dt) e B^T ('diagonal'); [h; e] W ('linear');
  h + e ('additive'); h ('none')."""

  def __init__(self, config: LoopedConfig):
    super().__init__()
    self.kind = config.injection
    d = config.d_model
    if self.kind == "diagonal":
      self.A_log = nn.Parameter(torch.zeros(d, dtype=torch.float32))
      self.dt = nn.Parameter(torch.zeros(d, dtype=torch.float32))
      self.B = linear(d, d)
    elif self.kind == "linear":
      self.linear = linear(2 * d, d)

  def forward(self, h, e):
    if self.kind == "none":
      return h
    if self.kind == "additive":
      return h + e
    if self.kind == "linear":
      return self.linear(torch.cat([h, e], -1))
    step = F.softplus(self.dt.float())
    decay = torch.exp(-step * torch.exp(self.A_log.float()))
    return decay.to(h.dtype) * h + step.to(h.dtype) * self.B(e)


class Recurrence(nn.Module):
  """The looped core: injection, then the core layers (one set of weights for every r)."""

  def __init__(self, config: LoopedConfig):
    super().__init__()
    self.inject = Injection(config)
    p = config.num_prelude_layers
    self.layers = nn.ModuleList(
      Block(config, m, p + i in config.value_embed_layers)
      for i, m in enumerate(config.mixers("core"))
    )
    if config.core_out_norm == "every":
      self.out_norm = RMSNorm(config.d_model, config.norm_eps)
    if config.exit_gate:
      self.exit_gate = linear(config.d_model, 1)
      self.exit_gate_bias = nn.Parameter(torch.zeros(1, dtype=torch.float32))


@dataclasses.dataclass
class LoopedOutput(ModelOutput):
  """loss (with labels), logits [B, T, V] (float32), past_key_values (the `LoopedCache`, with
  use_cache), exit_logits [R, B, T] (models with an exit gate: each recurrence's w.h_r + b)."""

  loss: torch.Tensor | None = None
  logits: torch.Tensor | None = None
  past_key_values: LoopedCache | None = None
  exit_logits: torch.Tensor | None = None


class LoopedPreTrainedModel(PreTrainedModel):
  config_class = LoopedConfig
  base_model_prefix = "model"
  _no_split_modules = ["Block"]
  _supports_cache_class = False

  def _keep_float32(self) -> None:
    """Loads the params looped keeps in float32 whatever the weights' dtype (its bfloat16 models
    too) as float32: those of FLOAT32_PARAMS the model has (transformers refuses others)."""
    names = {part for name, _ in self.named_parameters() for part in name.split(".")}
    self._keep_in_fp32_modules_strict = [n for n in FLOAT32_PARAMS if n in names]

  @classmethod
  def _supports_default_dynamic_cache(cls) -> bool:
    return False  # The cache is a LoopedCache, made by the model.

  def _init_weights(self, module):
    """Fresh weights (a model built from a config, not loaded): looped's normal init."""
    std = self.config.init_std
    if isinstance(module, (nn.Linear, nn.Embedding)):
      nn.init.normal_(module.weight, std=std)
      if getattr(module, "bias", None) is not None:
        nn.init.zeros_(module.bias)
    elif isinstance(module, RMSNorm):
      nn.init.ones_(module.weight)


class LoopedModel(LoopedPreTrainedModel):
  """Embedding, prelude, recurrences, coda and final norm; `run` computes a chunk (LoopedForCausalLM
  adds the head)."""

  def __init__(self, config: LoopedConfig):
    super().__init__(config)
    c = config
    self.embed = nn.Embedding(c.vocab_size, c.d_model)
    ve = set(c.value_embed_layers)
    p, b = c.num_prelude_layers, c.num_core_layers
    self.prelude = nn.ModuleList(Block(c, m, i in ve) for i, m in enumerate(c.mixers("prelude")))
    if c.prelude_norm:
      self.prelude_norm = RMSNorm(c.d_model, c.norm_eps)
    if c.state_init == "like_init":  # h_0 of each position: looped's noise draw, exported.
      noise = torch.zeros(c.max_seq_len, c.d_model)
      self.initial_state = nn.Parameter(noise, requires_grad=False)
    self.recurrence = Recurrence(c)
    if c.core_out_proj:
      self.core_out = linear(c.d_model, c.d_model)
    self.coda = nn.ModuleList(Block(c, m, p + b + i in ve) for i, m in enumerate(c.mixers("coda")))
    if c.core_out_norm != "every":  # 'every': the recurrence's own norm is the final one.
      self.final_norm = RMSNorm(c.d_model, c.norm_eps)
    self._keep_float32()
    self.post_init()

  def _initial_state(self, e, positions):
    kind = self.config.state_init
    if kind == "zeros":
      return torch.zeros_like(e)
    if kind == "embed":
      return e
    return self.initial_state[positions].to(e.dtype)

  def _layers(self, stage: str):
    if stage == "core":
      return self.recurrence.layers
    return getattr(self, stage)

  def run(self, tokens_BxT, num_recurrences: int, cache: LoopedCache | None, num_new_B=None):
    """The final norm's output [B, T, D] of one chunk (one block, with a cache) and the exit
    logits; rows are right-padded after num_new_B[b] real tokens (None: all real). With a
    cache, the chunk reads it and is written into it (the core: the recurrences it caches)."""
    c = self.config
    b, t = tokens_BxT.shape
    device = tokens_BxT.device
    zeros_B = torch.zeros(b, dtype=torch.long, device=device)
    length_B = cache.length if cache is not None else zeros_B
    positions_BxT = length_B[:, None] + torch.arange(t, device=device)[None, :]
    last = int((length_B + (num_new_B if num_new_B is not None else t)).max()) - 1
    if last >= c.max_seq_len:
      raise ValueError(f"position {last} is past the model's max_seq_len {c.max_seq_len}")
    # Padding may sit past the last position; what it computes is never read.
    positions_BxT = positions_BxT.clamp(max=c.max_seq_len - 1)
    x_BxTxD = self.embed(tokens_BxT)
    if c.embed_scale != 1.0:
      x_BxTxD = x_BxTxD * torch.tensor(c.embed_scale, dtype=x_BxTxD.dtype)
    written = {stage: {} for stage in STAGES}

    def plain(stage: str, x_BxTxD):
      for i, layer in enumerate(self._layers(stage)):
        past = cache.read(stage, i, None) if cache is not None else None
        x_BxTxD, entry = layer(x_BxTxD, positions_BxT, Reads(past, length_B, num_new_B, tokens_BxT))
        written[stage][i] = entry
      return x_BxTxD

    x_BxTxD = plain("prelude", x_BxTxD)
    e_BxTxD = self.prelude_norm(x_BxTxD) if c.prelude_norm else x_BxTxD
    h_BxTxD = self._initial_state(e_BxTxD, positions_BxT)
    per_recurrence, exit_logits = [], []
    for r in range(1, num_recurrences + 1):
      x_BxTxD = self.recurrence.inject(h_BxTxD, e_BxTxD)
      entries = []
      for i, layer in enumerate(self.recurrence.layers):
        past = cache.read("core", i, cache.slot(r)) if cache is not None else None
        x_BxTxD, entry = layer(x_BxTxD, positions_BxT, Reads(past, length_B, num_new_B, tokens_BxT))
        entries.append(entry)
      if c.core_out_norm == "every":
        x_BxTxD = self.recurrence.out_norm(x_BxTxD)
      h_BxTxD = x_BxTxD
      per_recurrence.append(entries)
      if c.exit_gate:
        gate_BxTx1 = (
          self.recurrence.exit_gate(h_BxTxD).float() + self.recurrence.exit_gate_bias.float()
        )
        exit_logits.append(gate_BxTx1[..., 0])
    x_BxTxD = self.core_out(h_BxTxD) if c.core_out_proj else h_BxTxD
    if c.core_out_norm == "final":
      x_BxTxD = self.final_norm(x_BxTxD)
    x_BxTxD = plain("coda", x_BxTxD)
    if c.core_out_norm != "every":
      x_BxTxD = self.final_norm(x_BxTxD)
    if cache is not None:
      for stage in ("prelude", "coda"):
        for i, kind in enumerate(c.mixers(stage)):
          cache.write(stage, i, written[stage][i], kind, t)
      for i, kind in enumerate(c.mixers("core")):
        copies = [per_recurrence[r - 1][i] for r in cache.cached]
        stacked = tuple(torch.stack(parts) for parts in zip(*copies))
        cache.write("core", i, stacked, kind, t)
      cache.length = length_B + (num_new_B if num_new_B is not None else t)
    return x_BxTxD, (torch.stack(exit_logits) if exit_logits else None)


def _runs(mask_BxT: torch.Tensor):
  """(first real column, real tokens) of each row; ValueError unless each row's real tokens are
  one contiguous run."""
  count = mask_BxT.sum(1)
  first = torch.where(count > 0, mask_BxT.float().argmax(1), torch.zeros_like(count))
  cols = torch.arange(mask_BxT.shape[1], device=mask_BxT.device)[None, :]
  run = (cols >= first[:, None]) & (cols < (first + count)[:, None])
  if not torch.equal(run, mask_BxT):
    raise ValueError("attention_mask: each row's tokens must be one contiguous run of ones")
  return first, count


class LoopedForCausalLM(LoopedPreTrainedModel, GenerationMixin):
  """The looped LM with its head; see the module docstring for the cached forward."""

  def __init__(self, config: LoopedConfig):
    super().__init__(config)
    self.model = LoopedModel(config)
    if not config.tie_embeddings:
      self.lm_head = linear(config.d_model, config.vocab_size)
    self._keep_float32()
    self.post_init()

  def get_input_embeddings(self):
    return self.model.embed

  def _logits(self, x):
    weight = self.model.embed.weight if self.config.tie_embeddings else self.lm_head.weight
    return F.linear(x, weight.to(x.dtype)).float()

  def forward(
    self,
    input_ids: torch.LongTensor,
    attention_mask: torch.Tensor | None = None,
    past_key_values: LoopedCache | None = None,
    use_cache: bool | None = None,
    labels: torch.LongTensor | None = None,
    num_recurrences: int | None = None,
    share_kv: bool | None = None,
    kv_policy: str | None = None,
    prefill_block: int | None = None,
    return_dict: bool | None = None,
    token_type_ids: torch.Tensor | None = None,
    **kwargs,
  ):
    """Logits of every position (float32). A cache is read and extended when one is passed
    (`past_key_values`, or `cache`) or use_cache=True; otherwise all positions are computed
    at once. num_recurrences, share_kv, kv_policy and prefill_block default to config.json's;
    a cache keeps the ones it was made with. token_type_ids (what some tokenizers return) are
    not read."""
    del token_type_ids
    c = self.config
    cache = past_key_values if past_key_values is not None else kwargs.get("cache")
    if cache is not None and not isinstance(cache, LoopedCache):
      raise TypeError(f"the cache must be a LoopedCache, got {type(cache).__name__}")
    r = num_recurrences or (cache.num_recurrences if cache is not None else c.num_recurrences)
    b, t = input_ids.shape
    if cache is None and use_cache is True:
      share = c.share_kv if share_kv is None else share_kv
      policy = kv_policy or c.kv_policy
      if share and policy != "final" and "kda" in c.mixers("core"):
        raise ValueError(f"kv_policy = {policy!r} needs attention core layers (KDA: 'final')")
      cache = LoopedCache(share, policy, r, b, input_ids.device)
    if cache is not None:
      made = {"num_recurrences": cache.num_recurrences, "share_kv": cache.share_kv}
      made["kv_policy"] = cache.kv_policy
      asked = {"num_recurrences": r, "share_kv": share_kv, "kv_policy": kv_policy}
      for name, value in asked.items():
        if value is not None and value != made[name]:
          raise ValueError(f"{name} = {value!r}, but the cache was made with {made[name]!r}")
    mask = attention_mask[:, -t:].bool() if attention_mask is not None else None
    first = count = None
    tokens = input_ids
    if mask is not None and not bool(mask.all()):
      if cache is not None and bool(cache.length.any()):
        raise ValueError("attention_mask: a chunk after the first must have no padding")
      first, count = _runs(mask)  # Real tokens to the front (right padding), then back.
      cols = (first[:, None] + torch.arange(t, device=input_ids.device)[None, :]).clamp(max=t - 1)
      tokens = input_ids.gather(1, cols)
    if cache is None:
      hidden, exit_logits = self.model.run(tokens, r, None, count)
    else:
      hidden, exit_logits = self._blocks(tokens, cache, count, prefill_block)
      cache.seen += t
    logits = self._logits(hidden)
    if first is not None:  # Back to the input's columns; padding positions get zeros.
      back = torch.zeros_like(logits)
      cols = first[:, None] + torch.arange(t, device=logits.device)[None, :]
      real = torch.arange(t, device=logits.device)[None, :] < count[:, None]
      rows = torch.arange(b, device=logits.device)[:, None].expand(b, t)
      back[rows[real], cols[real]] = logits[real]
      logits = back
    loss = None
    if labels is not None:
      loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
      )
    out = LoopedOutput(loss=loss, logits=logits, past_key_values=cache, exit_logits=exit_logits)
    return out if return_dict is not False else out.to_tuple()

  def _blocks(self, tokens, cache: LoopedCache, count, prefill_block):
    """A chunk with a cache, in blocks of prefill_block positions aligned from 0 (shared
    cache; one block when 0 or unshared, where blocks do not change the result)."""
    c = self.config
    b, t = tokens.shape
    block = c.prefill_block if prefill_block is None else prefill_block
    if not cache.share_kv or block <= 0 or t == 1:
      return self.model.run(tokens, cache.num_recurrences, cache, count)
    start = int(cache.length[0])
    if not bool((cache.length == start).all()):
      raise ValueError("a chunk of several tokens needs every row of the cache at one length")
    hidden, exits, j = [], [], 0
    while j < t:
      end = min(t, j + block - (start + j) % block)
      num = None if count is None else (count - j).clamp(0, end - j)
      h, e = self.model.run(tokens[:, j:end], cache.num_recurrences, cache, num)
      hidden.append(h)
      exits.append(e)
      j = end
    exit_logits = torch.cat(exits, -1) if exits[0] is not None else None
    return torch.cat(hidden, 1), exit_logits

  def prepare_inputs_for_generation(self, input_ids, **kwargs):
    """The columns the cache has not seen, with the cache and the looped options."""
    cache = kwargs.get("looped_cache")
    for name in ("past_key_values", "cache"):
      if cache is None and isinstance(kwargs.get(name), LoopedCache):
        cache = kwargs[name]
    if cache is not None:
      input_ids = input_ids[:, cache.seen :]
    inputs = {
      "input_ids": input_ids,
      "attention_mask": kwargs.get("attention_mask"),
      "past_key_values": cache,
      "use_cache": kwargs.get("use_cache", True),
    }
    for name in ("num_recurrences", "share_kv", "kv_policy", "prefill_block", "labels"):
      if kwargs.get(name) is not None:
        inputs[name] = kwargs[name]
    return inputs

  def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
    model_kwargs = super()._update_model_kwargs_for_generation(
      outputs, model_kwargs, *args, **kwargs
    )
    model_kwargs["looped_cache"] = outputs.past_key_values
    return model_kwargs
