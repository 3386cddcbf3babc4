"""The looped LM (docs/design.md §2): prelude -> R recurrences of one core block -> coda -> head.

    tokens -> embed -> prelude -> [norm] -> e;  h_0 = init(e)
    h_r = core(inject(h_{r-1}, e))  for r = 1..R   (masked recurrences keep h_{r-1})
    -> coda -> final norm -> lm head

One `__call__` serves two modes, chosen by whether a decode cache is passed (static):
- parallel (`_parallel`: training, evaluation, Jacobi shared passes): all T positions at once;
- decode (`_decode`: prefill chunks and token-by-token generation): new tokens against a
  `KVCache`.
Both run the same steps (`_embed`, `_plain_layers` for prelude and coda, `_prelude_out`, the
recurrences, `_coda_and_head`) and differ only in what attention reads. Both build the core
block as the same `Recurrence` module named 'recurrence', so one parameter tree serves both,
and `scan_recurrences` (lax.scan vs a Python loop) does not change it either.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from looped.model import adaptive, mixer_registry
from looped.model import depth as depth_lib
from looped.model import kv_cache as kv_cache_lib
from looped.model import kv_policy as kv_policy_lib
from looped.model import mixers as mixers_lib
from looped.model.config import ModelConfig
from looped.model.injection import Injection
from looped.model.kda import KDAState
from looped.model.kv_cache import KVCache, stored_chunk, write_chunk
from looped.model.layers import Mlp, RMSNorm, normal_init, projection
from looped.model.mixer_interface import KV, CacheAndOwnChunk, MixerContext, PagedKV


def causal_mask(t: int, batch: int) -> jax.Array:
  return jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t))


def diagonal_mask(t: int, batch: int) -> jax.Array:
  return jnp.broadcast_to(jnp.eye(t, dtype=bool), (batch, t, t))


def same_segment(segment_ids_BxT: jax.Array, segment_ids_BxS: jax.Array) -> jax.Array:
  """[B, T, S] bool: query t and key s belong to the same document (document masking)."""
  return segment_ids_BxT[:, :, None] == segment_ids_BxS[:, None, :]


def document_positions(positions_BxT, segment_ids_BxT, cache_segment_ids_BxS=None, length_B=None):
  """Each token's position counted from its document's first token: where state_init's
  noise is keyed under document masking, so h_0 does not depend on what is packed before the
  document. Decode: the document may start in the cache (its first `length_B` positions, ids
  cache_segment_ids_BxS) or in the chunk (which starts at position length_B)."""
  big = jnp.iinfo(jnp.int32).max
  same_BxTxT = same_segment(segment_ids_BxT, segment_ids_BxT)
  start_BxT = jnp.where(same_BxTxT, positions_BxT[:, None, :], big).min(-1)
  if cache_segment_ids_BxS is not None:
    s = cache_segment_ids_BxS.shape[1]
    filled_BxS = jnp.arange(s)[None, :] < length_B[:, None]
    in_cache_BxTxS = same_segment(segment_ids_BxT, cache_segment_ids_BxS) & filled_BxS[:, None, :]
    cache_start_BxT = jnp.where(in_cache_BxTxS, jnp.arange(s)[None, None, :], big).min(-1)
    start_BxT = jnp.minimum(start_BxT, cache_start_BxT)
  return positions_BxT - start_BxT


def tail_segment_ids(cache_segment_ids_BxS, length_B, width: int) -> jax.Array:
  """[B, width] documents of the `width` positions before each row's length (clamped at 0:
  a tail slot before position 0 holds zeros, whatever its id)."""
  slots_BxW = length_B[:, None] - width + jnp.arange(width)[None, :]
  slots_BxW = jnp.clip(slots_BxW, 0, cache_segment_ids_BxS.shape[1] - 1)
  return jnp.take_along_axis(cache_segment_ids_BxS, slots_BxW, axis=1)


class Block(nn.Module):
  """Transformer layer: x + mixer(norm(x)), then x + mlp(norm(x)) (cfg.block_norm 'pre');
  'sandwich' also normalizes each branch's output, 'post' each sum.

  mixer: a name in looped.model.mixer_registry; returns its cache entry with the output.
  """

  cfg: ModelConfig
  out_std: float
  mixer: str = "gqa"
  value_embed: bool = False  # GQA with a value embedding (reads ctx.tokens_BxT).

  @nn.compact
  def __call__(self, x_BxTxD, positions_BxT, ctx: MixerContext) -> tuple[jax.Array, KV]:
    cfg = self.cfg
    mixer = mixer_registry.get(self.mixer)
    module, name = mixer.module, mixer.scope
    extra = {"value_embed": True} if self.value_embed else {}
    y_BxTxD, kv = module(cfg, self.out_std, name=name, **extra)(
      RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="attn_norm")(x_BxTxD), positions_BxT, ctx
    )
    x_BxTxD = self._residual(x_BxTxD, y_BxTxD, "attn_out_norm")
    y_BxTxD = Mlp(cfg, self.out_std, name="mlp")(
      RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="mlp_norm")(x_BxTxD)
    )
    x_BxTxD = self._residual(x_BxTxD, y_BxTxD, "mlp_out_norm")
    return nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed")), kv

  def _residual(self, x_BxTxD, y_BxTxD, norm: str):
    if self.cfg.block_norm == "pre":
      return x_BxTxD + y_BxTxD
    if self.cfg.block_norm == "sandwich":
      return x_BxTxD + RMSNorm(self.cfg.weight_dtype, self.cfg.norm_eps, name=norm)(y_BxTxD)
    return RMSNorm(self.cfg.weight_dtype, self.cfg.norm_eps, name=norm)(x_BxTxD + y_BxTxD)


def _out_std(cfg: ModelConfig) -> float:
  applications = cfg.num_prelude_layers + cfg.num_core_layers * cfg.num_recurrences
  return cfg.init_std / (2 * (applications + cfg.num_coda_layers)) ** 0.5


def _token_norms(x_BxTxD):
  return jnp.sqrt(jnp.sum(jnp.square(x_BxTxD.astype(jnp.float32)), axis=-1))


class Recurrence(nn.Module):
  """One recurrence: inject e into h, then the B core layers. The body of the scan.

  carry: {'h': h_BxTxD, 'final_kv': per-layer KV of the last active recurrence (parallel)}.
  xs (per recurrence): {'active_B', 'stop_B', 'read_shared' (scalar), 'past' (unshared decode),
    'read_slot' (the KV policy's copy this recurrence reads, when it caches several),
    'write_C' (parallel, non-final policy: which copies this recurrence writes)}.
  bcast: {'e', 'positions', 'self_mask', 'past_mask', 'shared_kv' (per layer or None),
    'read_past' (optional: KV-format read of earlier positions' K/V), 'segment_ids' and
    'tail_segment_ids' (optional: document masking, MixerContext's)}.
  """

  cfg: ModelConfig
  decode: bool
  collect_states: bool = False
  prefill_block: int | None = None  # Static (bcast entries are traced under remat).

  @nn.compact
  def __call__(self, carry, xs, bcast):
    cfg = self.cfg
    h_prev = carry["h"]
    stop_Bx1x1 = xs["stop_B"][:, None, None]
    h_in = jnp.where(stop_Bx1x1, jax.lax.stop_gradient(h_prev), h_prev)
    if not self.is_initializing():
      # Adds a 'perturbations' variable when the caller passes one (never created by init):
      # the gradient w.r.t. a zero probe is dLoss/dh at this recurrence's entry (tests).
      h_in = self.perturb("h_in", h_in)
    x = Injection(cfg, name="inject")(h_in, bcast["e"])
    kvs = []
    for layer, mixer in enumerate(cfg.mixers("core")):
      ctx = dataclasses.replace(self._context(layer, xs, bcast), tokens_BxT=bcast["tokens"])
      ve = cfg.has_value_embed("core", layer)
      x, kv = Block(cfg, _out_std(cfg), mixer, ve, name=f"layer_{layer}")(
        x, bcast["positions"], ctx
      )
      kvs.append(kv)
    if cfg.core_out_norm == "every":
      x = RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="out_norm")(x)
    active_Bx1x1 = xs["active_B"][:, None, None]
    h_new = jnp.where(active_Bx1x1, x, h_in)

    res_BxT = _token_norms(h_new - h_prev)
    ys = {
      "residual_B": jnp.mean(res_BxT, axis=1),
      "relative_B": jnp.mean(res_BxT / (_token_norms(h_new) + 1e-6), axis=1),
    }
    if self.collect_states:
      ys["h"] = h_new
    if cfg.exit_gate:
      gate = projection(cfg, 1, cfg.init_std, "exit_gate", axes=("embed", None))(h_new)
      bias = self.param("exit_gate_bias", nn.initializers.zeros, (1,), jnp.float32)
      ys["exit_logit_BxT"] = (gate.astype(jnp.float32) + bias)[..., 0]
    new_carry = {"h": h_new}
    if self.decode:
      ys["kv"] = kvs
    else:
      active = lambda x: xs["active_B"].reshape((-1,) + (1,) * (x.ndim - 1))
      update = lambda new, old: jnp.where(active(new), new, old)
      if "write_C" in xs:  # A KV policy's copies: copy i keeps the last active r <= its own.
        update = functools.partial(_write_copies, xs["active_B"], xs["write_C"])
      new_carry["final_kv"] = jax.tree.map(update, kvs, carry["final_kv"])
    return new_carry, ys

  def _context(self, layer: int, xs, bcast) -> MixerContext:
    segments = dict(
      segment_ids_BxT=bcast.get("segment_ids"), tail_segment_ids_BxW=bcast.get("tail_segment_ids")
    )
    if self.decode:
      if "past" in xs:  # Unshared: this recurrence's cache (of a paged entry: its table).
        past = xs["past"][layer]
        pools = bcast.get("paged_pools", {}).get(layer)
        if pools is not None:
          past = PagedKV(*pools, past)
      else:
        past = _read_copy(bcast["shared_kv"][layer], xs)
      if "quantize_own" in bcast:
        past = _with_own_chunk(past, bcast["quantize_own"])
      return MixerContext(
        bcast["self_mask"],
        past,
        bcast["past_mask"],
        bcast.get("read_past"),
        num_new_B=bcast.get("num_new_B"),
        **segments,
      )
    if bcast["shared_kv"] is None:
      if "read_past" in bcast:  # Unshared, quantized reads of the own past.
        return MixerContext(
          bcast["self_mask"], lambda own: own, bcast["past_mask"], bcast["read_past"], **segments
        )
      return MixerContext(bcast["self_mask"], **segments)
    shared = _read_copy(bcast["shared_kv"][layer], xs)
    flag = xs["read_shared"]
    block = self.prefill_block is not None

    def past(own: KV) -> KV:
      # A recurrence that does not read the shared cache sees its own keys for s < t, which
      # with the diagonal self mask is exactly ordinary causal attention. In block mode the
      # past is [shared-or-own ; own]: earlier blocks' slots, then the own block's earlier ones.
      read = jax.tree.map(lambda sh, ow: jnp.where(flag, sh, ow), shared, own)
      return _concat_slots(read, own) if block else read

    return MixerContext(
      bcast["self_mask"],
      past,
      bcast["past_mask"],
      bcast.get("read_past"),
      self.prefill_block,
      **segments,
    )


def _read_copy(entry, xs):
  """The copy of a shared core entry this recurrence reads under a KV policy that caches
  several (leading copies axis); the entry itself when it caches one."""
  if "read_slot" not in xs:
    return entry
  if isinstance(entry, PagedKV):  # One pool for the copies: index the table only.
    return entry.copy(xs["read_slot"])
  return jax.tree.map(lambda a: a[xs["read_slot"]], entry)


def _write_copies(active_B, write_C, new, old_C):
  """A KV policy's cached copies [C, B, ...] after one recurrence: copy i takes `new` in the
  active rows when the recurrence writes it (write_C[i]); a single copy has no C axis."""
  if old_C.ndim == new.ndim:
    mask = write_C[0] & active_B.reshape((-1,) + (1,) * (new.ndim - 1))
    return jnp.where(mask, new, old_C)
  mask_CxB = write_C[:, None] & active_B[None, :]
  return jnp.where(mask_CxB.reshape(mask_CxB.shape + (1,) * (new.ndim - 1)), new[None], old_C)


def _policy_inputs(
  cfg: ModelConfig, name: str, parallel: bool
) -> tuple[kv_policy_lib.KVPolicy, dict]:
  """The parsed KV policy and its per-recurrence scan inputs (Recurrence's xs): the copy each
  recurrence reads when there are several, and in a parallel forward which copies it writes.
  The default 'final' adds none, so its forward is today's."""
  policy = kv_policy_lib.parse(name, cfg.num_recurrences)
  if name == kv_policy_lib.FINAL:
    return policy, {}
  if not mixers_lib.all_with(cfg, "core", "kv_policies"):
    raise ValueError(f"kv_policy {name!r} needs attention core layers (KDA: 'final' only).")
  xs = {}
  if policy.copies > 1:
    xs["read_slot"] = jnp.asarray(policy.slots, jnp.int32)
  if parallel:
    xs["write_C"] = jnp.asarray(policy.writes, bool)
  return policy, xs


def _with_own_chunk(entry, quantize_own):
  """A cache entry read together with the chunk's own earlier tokens stored in the cache's KV
  format, as a token-by-token decode would read them (mixer_interface.CacheAndOwnChunk).
  Recurrent states (KDA) are returned as they are."""
  if isinstance(entry, KDAState):
    return entry
  return CacheAndOwnChunk(entry, lambda own: _concat_slots(entry, quantize_own(own)))


def _concat_slots(a, b):
  """Two cache entries (raw or quantized, [B, S, ...] leaves) joined along the slot axis."""
  return jax.tree.map(lambda x, y: jnp.concatenate([x, y.astype(x.dtype)], axis=1), a, b)


def block_masks(t: int, batch: int, block: int) -> tuple[jax.Array, jax.Array]:
  """Block prefill's reads in a parallel forward (docs/design.md §3): (past mask [B, T, 2T]
  over [earlier blocks' slots ; the own block's earlier slots], diagonal self mask)."""
  t_T = jnp.arange(t)
  start_T = (t_T // block) * block
  earlier_TxS = t_T[None, :] < start_T[:, None]
  own_TxS = (t_T[None, :] >= start_T[:, None]) & (t_T[None, :] < t_T[:, None])
  past_TxS = jnp.concatenate([earlier_TxS, own_TxS], axis=1)
  return jnp.broadcast_to(past_TxS, (batch, t, 2 * t)), diagonal_mask(t, batch)


def _check_mode_options(
  cache, prefill_block, kv_policy, num_new_B, segment_ids_BxT, cache_segment_ids_BxS
) -> None:
  """Refuses an option of the other mode: parallel has no cache, decode reads one."""
  if cache is None:
    if num_new_B is not None:
      raise ValueError("num_new_B is a decode-mode option (it marks a chunk's padding).")
    if cache_segment_ids_BxS is not None:
      raise ValueError("cache_segment_ids_BxS is a decode-mode option (it needs a cache).")
    return
  if prefill_block is not None:
    raise ValueError("prefill_block is a parallel-mode option; a decode call is one block.")
  if kv_policy not in (kv_policy_lib.FINAL, cache.kv_policy):
    raise ValueError(f"Decode reads the cache's kv_policy {cache.kv_policy!r}: {kv_policy!r}.")
  if (segment_ids_BxT is None) != (cache_segment_ids_BxS is None):
    raise ValueError("Decode with document masking needs segment_ids_BxT and the cache's ids.")


def _check_decode_options(cache, depth, jacobi, collect_states, depth_mask_BxR) -> None:
  if depth is not None and (cache is None or collect_states or depth_mask_BxR is not None):
    raise ValueError("depth is a decode option: it replaces depth_mask_BxR, collects no h_r.")
  if jacobi and cache is None:
    raise ValueError("jacobi is a decode option: the chunk reads itself from a cache.")


@dataclasses.dataclass(frozen=True)
class _DecodeReads:
  """What a decode chunk's attention reads: its positions, the masks over the cache's slots
  (past) and over the chunk itself, the document-masking arguments of its mixers, and with a KV
  format the quantizer of the chunk's own K/V (then the past is [cache ; own chunk])."""

  positions_BxT: jax.Array
  past_mask_BxTxS: jax.Array
  self_mask_BxTxT: jax.Array
  segments: dict
  quantize_own: Callable | None


def _decode_reads(
  cfg: ModelConfig,
  cache: KVCache,
  b: int,
  t: int,
  segment_ids_BxT,
  cache_segment_ids_BxS,
  jacobi: bool = False,
) -> _DecodeReads:
  """New tokens attend to the cache's slots below each row's length and causally to each
  other, within their document when segment ids are given. jacobi: token j of the chunk reads
  the chunk's earlier tokens from the cache's slots (length + i for i < j, entries a previous
  pass wrote there) and only itself in the chunk: a Jacobi pass over the chunk."""
  positions_BxT = cache.length_B[:, None] + jnp.arange(t)[None, :]
  s = cache.max_len
  limit_BxT = positions_BxT if jacobi else jnp.broadcast_to(cache.length_B[:, None], (b, t))
  past_mask_BxTxS = jnp.arange(s)[None, None, :] < limit_BxT[:, :, None]
  self_mask_BxTxT = diagonal_mask(t, b) if jacobi else causal_mask(t, b)
  segments = {}
  if segment_ids_BxT is not None:  # Document masking: cache slots and chunk of its document.
    if cache_segment_ids_BxS.shape[1] < max(s, 1):
      raise ValueError(
        f"cache_segment_ids_BxS has {cache_segment_ids_BxS.shape[1]} positions; the cache "
        f"has {s} slots (at least 1 position is needed)."
      )
    slots_BxS = cache_segment_ids_BxS[:, :s]
    past_mask_BxTxS = past_mask_BxTxS & same_segment(segment_ids_BxT, slots_BxS)
    self_mask_BxTxT = self_mask_BxTxT & same_segment(segment_ids_BxT, segment_ids_BxT)
    width = max(cfg.kda_conv_size - 1, 1)  # The conv tail's, and at least the state's.
    tail_BxW = tail_segment_ids(cache_segment_ids_BxS, cache.length_B, width)
    segments = dict(segment_ids_BxT=segment_ids_BxT, tail_segment_ids_BxW=tail_BxW)
  quantize_own = None
  if cache.kv_format is not None and not jacobi:  # (Jacobi: earlier tokens come from the cache.)
    # The chunk's earlier tokens are read through the format too (past = [cache ; own chunk]),
    # so a chunk computes what its tokens one at a time would: a cache never returns raw K/V.
    fmt = cache.kv_format
    quantize_own = lambda own: tuple(kv_cache_lib.quantize_tokens(x, fmt) for x in own)
    own_mask_BxTxT = self_mask_BxTxT & ~diagonal_mask(t, b)
    past_mask_BxTxS = jnp.concatenate([past_mask_BxTxS, own_mask_BxTxT], axis=-1)
    self_mask_BxTxT = diagonal_mask(t, b)
  return _DecodeReads(positions_BxT, past_mask_BxTxS, self_mask_BxTxT, segments, quantize_own)


def _decode_core_reads(cfg: ModelConfig, cache: KVCache, xs: dict):
  """(policy, shared_kv, paged_pools) of the core layers' cache reads; adds the per-recurrence
  inputs to `xs`. Shared: recurrence r reads the copy of its policy's c(r). Unshared:
  recurrence r reads its own cached K/V; a paged entry keeps every recurrence's pages in one
  pool, so only its tables are scanned."""
  if cache.share_kv:
    policy, policy_xs = _policy_inputs(cfg, cache.kv_policy, parallel=False)
    xs.update(policy_xs)
    return policy, cache.layers["core"], {}
  core = cache.layers["core"]
  xs["past"] = [e.page_table_BxP if isinstance(e, PagedKV) else e for e in core]
  paged_pools = {i: (e.k_pages, e.v_pages) for i, e in enumerate(core) if isinstance(e, PagedKV)}
  return None, None, paged_pools


def _decode_broadcasts(reads: _DecodeReads, paged_pools: dict, num_new_B) -> dict:
  """The recurrences' broadcast inputs that only decode has."""
  bcast = {}
  if reads.quantize_own is not None:
    bcast["quantize_own"] = reads.quantize_own
  if paged_pools:
    bcast["paged_pools"] = paged_pools
  if num_new_B is not None:
    bcast["num_new_B"] = num_new_B
  if reads.segments:
    bcast["segment_ids"] = reads.segments["segment_ids_BxT"]
    bcast["tail_segment_ids"] = reads.segments["tail_segment_ids_BxW"]
  return bcast


def _cached_core(cache: KVCache, policy, kv_per_layer: list) -> tuple[list, bool]:
  """(the core layers' entries the cache stores, whether they are [copies, ...] slotted):
  every recurrence's K/V unshared; under sharing the policy's cached recurrences' (one, the
  last, for 'final')."""
  if cache.share_kv and policy.copies > 1:
    cached = jnp.asarray(policy.cached, jnp.int32) - 1
    return [jax.tree.map(lambda a: a[cached], kv) for kv in kv_per_layer], True
  if cache.share_kv:
    return [jax.tree.map(lambda a: a[policy.cached[0] - 1], kv) for kv in kv_per_layer], False
  return kv_per_layer, False


def _depth_start(cfg: ModelConfig, h0_BxTxD, depth, given: bool):
  """h_0 under per-row depth settings: state_init's noise scaled by init_scale (Huginn's; not
  a given initial state), or a warm row's previous final state (continuous compute)."""
  if not given and cfg.state_init == "like_init":
    h0_BxTxD = h0_BxTxD * depth.init_scale_B[:, None, None].astype(h0_BxTxD.dtype)
  warm_BxTxD = depth.state_BxD[:, None, :].astype(h0_BxTxD.dtype)
  return jnp.where(depth.warm_B[:, None, None], warm_BxTxD, h0_BxTxD)


def _new_depths(cache: KVCache, depth_B, t: int, big_r: int):
  """The recurrences the chunk's tokens ran ([B, T]) where the cache records them (all R at
  full depth); None where it does not."""
  if cache.depth_BxS is None:
    return None
  b = cache.length_B.shape[0]
  ran_B = jnp.full((b,), big_r, jnp.int32) if depth_B is None else depth_B
  return jnp.broadcast_to(ran_B[:, None], (b, t))


def _adaptive_kv_zeros(cfg: ModelConfig, cache: KVCache, policy, b: int, t: int) -> list:
  """What an adaptive decode keeps of the core's new entries while rows run, zeros: each cached
  copy's (shared: the policy's copies, [C, ...] when several) or every recurrence's
  (unshared, [R, ...]); a KDA layer's state as its cache entry holds it."""
  lead = () if cache.share_kv else (cfg.num_recurrences,)
  if cache.share_kv and policy.copies > 1:
    lead = (policy.copies,)
  zeros = []
  for kind, entry in zip(cfg.mixers("core"), cache.layers["core"], strict=True):
    if isinstance(entry, KDAState):
      zeros.append(jax.tree.map(jnp.zeros_like, entry))
      continue
    base = mixer_registry.get(kind).entry_zeros(cfg, b, t)
    zeros.append(jax.tree.map(lambda z: jnp.broadcast_to(z, lead + z.shape), base))
  return zeros


def _lookup_reads(cache: KVCache, lookup: str, r, bcast: dict) -> tuple[jax.Array | None, dict]:
  """(the cached recurrence each row reads at recurrence r (1-based), or None: recurrence r's
  own; recurrence r's broadcasts). An unshared cache's lookup for recurrences earlier tokens
  never ran (adaptive.LOOKUPS): 'latest' needs nothing (the cache holds a token's last K/V in
  the recurrences after its exit); 'skip' hides the slots that did not run r; 'always-last'
  reads every slot's last recurrence (the last copy) in a row where some slot did not run r."""
  if cache.share_kv or lookup == "latest":
    return None, bcast
  if cache.depth_BxS is None:
    raise ValueError(f"exit_lookup {lookup!r} needs a cache that records depths (depth_BxS).")
  ran_BxS = cache.depth_BxS >= r
  if lookup == "always-last":
    filled_BxS = jnp.arange(ran_BxS.shape[1])[None, :] < cache.length_B[:, None]
    hole_B = jnp.any(filled_BxS & ~ran_BxS, axis=1)
    return jnp.where(hole_B, _copies(cache) - 1, r - 1), bcast
  past_mask = bcast["past_mask"]  # [B, T, S], or [B, T, S + T] with the own chunk (KV format).
  own = past_mask.shape[-1] - ran_BxS.shape[1]
  ran_BxS = jnp.concatenate([ran_BxS, jnp.ones((ran_BxS.shape[0], own), bool)], axis=1)
  return None, {**bcast, "past_mask": past_mask & ran_BxS[:, None, :]}


def _copies(cache: KVCache) -> int:
  """Recurrences an unshared cache holds (its core entries' leading axis)."""
  entry = cache.layers["core"][0]
  if isinstance(entry, PagedKV):
    return entry.page_table_BxP.shape[0]
  return jax.tree.leaves(entry)[0].shape[0]


def _adaptive_xs(xs: dict, i, read_B, active_B) -> dict:
  """Recurrence i's (0-based) Recurrence inputs in an adaptive decode: its active rows, and the
  copy it reads (a KV policy's slot; unshared: copy i, or per row read_B)."""
  b = active_B.shape[0]
  out = {"active_B": active_B, "stop_B": jnp.zeros_like(active_B)}
  if "read_slot" in xs:
    out["read_slot"] = xs["read_slot"][i]
  if "past" in xs:
    rows, read_B = jnp.arange(b), jnp.full((b,), i) if read_B is None else read_B
    out["past"] = [jax.tree.map(lambda a: a[read_B, rows], e) for e in xs["past"]]
  return out


def _record_kv(kept: list, new: list, i, active_B, write_RxC) -> list:
  """The core entries kept after recurrence i: shared, each copy takes the active rows' new
  entries when the recurrence writes it (write_RxC, the policy's); unshared, copy i does."""
  if write_RxC is not None:
    update = functools.partial(_write_copies, active_B, write_RxC[i])
    return [jax.tree.map(update, n, k) for n, k in zip(new, kept, strict=True)]

  def one(k_R, n):
    mask = active_B.reshape((-1,) + (1,) * (n.ndim - 1))
    return jax.lax.dynamic_update_index_in_dim(k_R, jnp.where(mask, n, k_R[i]), i, 0)

  return [jax.tree.map(one, k, n) for k, n in zip(kept, new, strict=True)]


def _adaptive_cached(cache: KVCache, policy, kept: list, depth_B) -> tuple[list, bool]:
  """(the core entries the cache stores, slotted) after an adaptive decode: shared, the kept
  copies (each the last recurrence a row ran up to its own); unshared, every recurrence's,
  where a row that stopped after k recurrences holds its recurrence-k entry in the later ones
  (what 'latest' reads)."""
  if cache.share_kv:
    return kept, policy.copies > 1
  big_r, b = jax.tree.leaves(kept[0])[0].shape[:2]
  read_RxB = jnp.minimum(jnp.arange(big_r)[:, None], jnp.maximum(depth_B - 1, 0)[None, :])
  rows = jnp.arange(b)[None, :]
  return [jax.tree.map(lambda a: a[read_RxB, rows], e) for e in kept], False


def init_params(model: LoopedLM, rng: jax.Array, tokens_BxT: jax.Array) -> dict:
  """{'params': ...} of a fresh model as plain arrays.

  model.init returns the params boxed with their logical axis names (nn.LogicallyPartitioned);
  looped.sharding reads those boxes to place params on a mesh, everything else wants arrays.
  """
  return {"params": nn.unbox(model.init(rng, tokens_BxT)["params"])}


class LoopedLM(nn.Module):
  """Parcae-style looped LM with optional KV-sharing across recurrences.

  `__call__`'s parallel-mode options (decode mode takes the KV format and policy from the
  cache, and a decode call is one block):
    shared_kv: per core layer (k, v) of the final recurrence from a previous pass; switches
      the core attention to shared reads (Jacobi pass).
    read_shared_R: which recurrences read `shared_kv` (default: all).
    kv_format: every attention read of an earlier position's K/V goes through this format's
      per-token quantize/dequantize round trip, as a cache stored in the format would return it.
    prefill_block: with shared_kv, block prefill's reads (docs/design.md §3): a token reads
      `shared_kv` for positions before its block of this many tokens (blocks aligned from
      position 0) and its own recurrence's K/V inside it. Jacobi passes in this mode reach
      block prefill exactly after (number of blocks - 1) passes.
    kv_policy: which cached recurrence c(r) each recurrence reads from `shared_kv`
      (looped/model/kv_policy.py); 'final_kv' then holds the policy's cached recurrences,
      [copies, ...] per layer when it keeps several. Decode mode takes the policy from the
      cache (init_cache's kv_policy).

  Decode mode's test-time depth (docs/design.md §3, "Depth at test time"):
    depth: each row's recurrences and exit settings (adaptive.DepthInputs, replacing
      depth_mask_BxR); the loop stops once every row has stopped. aux then also holds
      'depth_B' (recurrences each row ran) and 'state_BxD' (its last real token's final state,
      a continuous-compute start).
    exit_lookup: what an unshared cache serves for recurrences a token never ran
      (adaptive.LOOKUPS; 'always-last' and 'skip' need a cache that records depths).

  Decode mode's other options:
    num_new_B: per row, how many of the chunk's tokens are real (None: all T); the rest are
      padding of a batched call. The row's length advances by its real tokens and padding
      never advances a recurrent state (KDA) or its conv tail.
    jacobi: the chunk's tokens read each other from the cache's slots at their positions,
      where a previous pass over the same chunk wrote them (speculative verification's Jacobi
      passes), instead of their own recurrence's K/V.
  """

  cfg: ModelConfig

  @nn.compact
  def __call__(
    self,
    tokens_BxT: jax.Array,
    *,
    depth_mask_BxR: jax.Array | None = None,
    backprop_recurrences: int = 0,
    shared_kv: list[KV] | None = None,
    read_shared_R: jax.Array | None = None,
    cache: KVCache | None = None,
    collect_states: bool = False,
    kv_format: str | None = None,
    initial_state_BxTxD: jax.Array | None = None,
    prefill_block: int | None = None,
    num_new_B: jax.Array | None = None,
    segment_ids_BxT: jax.Array | None = None,
    cache_segment_ids_BxS: jax.Array | None = None,
    kv_policy: str = kv_policy_lib.FINAL,
    depth: adaptive.DepthInputs | None = None,
    exit_lookup: str = adaptive.DEFAULT_LOOKUP,
    jacobi: bool = False,
  ):
    """Returns (logits_BxTxV float32, aux).

    Args:
      tokens_BxT: int token ids (in decode mode: the new chunk).
      depth_mask_BxR: active recurrences (default: all).
      backprop_recurrences: k > 0 cuts the gradient before the last k active recurrences.
      cache: a KVCache: decode mode (prefill a chunk or decode tokens; returned updated).
      collect_states: also return every recurrence's state h_r (aux['states_RxBxTxD']).
        With core_out_norm 'every' and no coda, the head on h_r gives recurrence r's logits
        (`head_logits`).
      initial_state_BxTxD: h_0 of the new tokens instead of cfg.state_init's (a reference's
        own noise draw, to compare with it exactly).
      segment_ids_BxT: document masking (data.document_mask): int ids of the tokens' documents
        (in decode mode: of the new tokens). A token attends only to positions of its own
        document (in every layer, shared reads included), and a KDA layer starts a document from
        a zero state and conv window. Positions stay row positions. None: no masking.
      cache_segment_ids_BxS: decode mode with segment_ids_BxT: the documents of the cache's
        positions 0..S-1 (S >= the cache's slots, covering every filled one).
      shared_kv, read_shared_R, kv_format, prefill_block, kv_policy: parallel-mode options
        (the class docstring).
      depth, exit_lookup, num_new_B, jacobi: decode-mode options (the class docstring).
    aux: 'final_kv' (parallel) or 'cache' (decode), 'residual_norm_R',
      'relative_residual_R' (means over active sequences), optionally 'states_RxBxTxD', and
      with cfg.exit_gate 'exit_logits_RxBxT' (each recurrence's exit-gate logit per token).
    """
    _check_mode_options(
      cache, prefill_block, kv_policy, num_new_B, segment_ids_BxT, cache_segment_ids_BxS
    )
    _check_decode_options(cache, depth, jacobi, collect_states, depth_mask_BxR)
    if cache is None:
      return self._parallel(
        tokens_BxT,
        depth_mask_BxR,
        backprop_recurrences,
        shared_kv,
        read_shared_R,
        collect_states,
        kv_format,
        initial_state_BxTxD,
        prefill_block,
        segment_ids_BxT,
        kv_policy,
      )
    return self._decode(
      tokens_BxT,
      cache,
      depth_mask_BxR,
      backprop_recurrences,
      collect_states,
      initial_state_BxTxD,
      num_new_B,
      segment_ids_BxT,
      cache_segment_ids_BxS,
      depth,
      exit_lookup,
      jacobi,
    )

  def _parallel(
    self,
    tokens_BxT,
    depth_mask_BxR,
    backprop_recurrences,
    shared_kv,
    read_shared_R,
    collect_states,
    kv_format,
    initial_state_BxTxD,
    prefill_block,
    segment_ids_BxT,
    kv_policy=kv_policy_lib.FINAL,
  ):
    """All T positions at once (training, evaluation, Jacobi shared passes); aux['final_kv'] is
    each core layer's K/V of the last active recurrence (under another kv_policy: of each
    cached recurrence, the last active one up to it), what the next Jacobi pass reads."""
    cfg = self.cfg
    b, t = tokens_BxT.shape
    read_past = None
    if kv_format is not None:
      read_past = lambda kv: kv_cache_lib.quantize_roundtrip(kv, kv_format)
    # Reads of s < t go through the "past" path (where quantization applies) whenever K/V are
    # shared or quantized; the diagonal is always the token's own fresh K/V.
    past_path = shared_kv is not None or read_past is not None
    positions_BxT = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    causal_BxTxT = causal_mask(t, b)
    if segment_ids_BxT is not None:  # Document masking: every mask below keeps its document.
      causal_BxTxT = causal_BxTxT & same_segment(segment_ids_BxT, segment_ids_BxT)
    past_mask_BxTxS = causal_BxTxT & ~diagonal_mask(t, b)
    self_mask_BxTxT = diagonal_mask(t, b) if past_path else causal_BxTxT
    segments = dict(segment_ids_BxT=segment_ids_BxT)

    def plain_context(prefix: str, i: int) -> MixerContext:
      if read_past is not None:  # Quantized reads of the own past.
        return MixerContext(
          self_mask_BxTxT, lambda own: own, past_mask_BxTxS, read_past, **segments
        )
      return MixerContext(causal_BxTxT, **segments)

    embed, x_BxTxD = self._embed(tokens_BxT)
    x_BxTxD, _ = self._plain_layers(x_BxTxD, "prelude", positions_BxT, plain_context, tokens_BxT)
    noise_BxT = positions_BxT
    if segment_ids_BxT is not None:
      noise_BxT = document_positions(positions_BxT, segment_ids_BxT)
    e_BxTxD, h0_BxTxD = self._prelude_out(x_BxTxD, noise_BxT, initial_state_BxTxD, t)
    depth_mask_BxR, xs = self._recurrence_inputs(b, depth_mask_BxR, backprop_recurrences)
    if read_shared_R is None:
      read_shared_R = jnp.ones((cfg.num_recurrences,), bool)
    xs["read_shared"] = read_shared_R
    policy, policy_xs = _policy_inputs(cfg, kv_policy, parallel=True)
    xs.update(policy_xs)
    core_self_mask, core_past_mask = self_mask_BxTxT, past_mask_BxTxS
    if prefill_block is not None:
      if shared_kv is None:
        raise ValueError("prefill_block needs shared_kv (it says which reads are shared).")
      if prefill_block < 1:
        raise ValueError(f"prefill_block must be >= 1, got {prefill_block}.")
      if not mixers_lib.all_with(cfg, "core", "block_prefill"):
        raise ValueError("prefill_block in a parallel forward needs no KDA core layers.")
      core_past_mask, core_self_mask = block_masks(t, b, prefill_block)
      if segment_ids_BxT is not None:  # Both halves of the block past are positions 0..T-1.
        same_BxTxT = same_segment(segment_ids_BxT, segment_ids_BxT)
        core_past_mask = core_past_mask & jnp.concatenate([same_BxTxT, same_BxTxT], axis=-1)
    bcast = self._broadcasts(
      tokens_BxT, e_BxTxD, positions_BxT, core_self_mask, core_past_mask, shared_kv, read_past
    )
    if segment_ids_BxT is not None:
      bcast["segment_ids"] = segment_ids_BxT
    zeros = [mixers_lib.parallel_entry_zeros(cfg, kind, b, t) for kind in cfg.mixers("core")]
    if policy.copies > 1:
      zeros = jax.tree.map(lambda z: jnp.broadcast_to(z, (policy.copies, *z.shape)), zeros)
    carry = {"h": h0_BxTxD, "final_kv": zeros}
    carry, ys = self._recurrences(False, collect_states, prefill_block)(carry, xs, bcast)
    logits_BxTxV, _ = self._coda_and_head(
      carry["h"], embed, positions_BxT, plain_context, tokens_BxT
    )
    aux = self._diagnostics(ys, depth_mask_BxR, collect_states)
    aux["final_kv"] = carry["final_kv"]
    return logits_BxTxV, aux

  def _decode(
    self,
    tokens_BxT,
    cache,
    depth_mask_BxR,
    backprop_recurrences,
    collect_states,
    initial_state_BxTxD,
    num_new_B,
    segment_ids_BxT,
    cache_segment_ids_BxS,
    depth=None,
    exit_lookup=adaptive.DEFAULT_LOOKUP,
    jacobi=False,
  ):
    """New tokens (a prefill chunk or one per row) against a KVCache: they attend to its slots
    below each row's length and causally to each other; aux['cache'] has their K/V written (core:
    every recurrence's, or under sharing the final one's, docs/design.md §3)."""
    cfg, (b, t) = self.cfg, tokens_BxT.shape
    read_past = kv_cache_lib.reader(cache.kv_format, cfg.compute_dtype)
    reads = _decode_reads(cfg, cache, b, t, segment_ids_BxT, cache_segment_ids_BxS, jacobi)
    positions_BxT = reads.positions_BxT

    def plain_context(prefix: str, i: int) -> MixerContext:
      past = cache.layers[prefix][i]
      if reads.quantize_own is not None:
        past = _with_own_chunk(past, reads.quantize_own)
      return MixerContext(
        reads.self_mask_BxTxT,
        past,
        reads.past_mask_BxTxS,
        read_past,
        num_new_B=num_new_B,
        **reads.segments,
      )

    embed, x_BxTxD = self._embed(tokens_BxT)
    x_BxTxD, prelude_kvs = self._plain_layers(
      x_BxTxD, "prelude", positions_BxT, plain_context, tokens_BxT
    )
    noise_BxT = positions_BxT
    if segment_ids_BxT is not None:
      noise_BxT = document_positions(
        positions_BxT, segment_ids_BxT, cache_segment_ids_BxS, cache.length_B
      )
    num_positions = cache.max_len + t
    e_BxTxD, h0_BxTxD = self._prelude_out(x_BxTxD, noise_BxT, initial_state_BxTxD, num_positions)
    depth_mask_BxR, xs = self._recurrence_inputs(b, depth_mask_BxR, backprop_recurrences)
    policy, shared_kv, paged_pools = _decode_core_reads(cfg, cache, xs)
    bcast = self._broadcasts(
      tokens_BxT,
      e_BxTxD,
      positions_BxT,
      reads.self_mask_BxTxT,
      reads.past_mask_BxTxS,
      shared_kv,
      read_past,
    )
    bcast.update(_decode_broadcasts(reads, paged_pools, num_new_B))
    if depth is None:
      carry, ys = self._recurrences(True, collect_states)({"h": h0_BxTxD}, xs, bcast)
      h_BxTxD = carry["h"]
      aux = self._diagnostics(ys, depth_mask_BxR, collect_states)
      core_new, slotted = _cached_core(cache, policy, ys["kv"])
    else:
      head = (tokens_BxT, positions_BxT, plain_context, initial_state_BxTxD is not None)
      h_BxTxD, core_new, slotted, aux = self._adaptive_core(
        h0_BxTxD, xs, bcast, depth, cache, policy, num_new_B, head, exit_lookup
      )
    logits_BxTxV, coda_kvs = self._coda_and_head(
      h_BxTxD, embed, positions_BxT, plain_context, tokens_BxT
    )
    new_cache = {"prelude": prelude_kvs, "core": core_new, "coda": coda_kvs}
    num = t if num_new_B is None else num_new_B
    depth_BxT = _new_depths(cache, aux.get("depth_B"), t, cfg.num_recurrences)
    aux["cache"] = write_chunk(cache, new_cache, num, slotted_core=slotted, depth_BxT=depth_BxT)
    # The chunk's entries alone: what a paged engine scatters (the dense write above then goes
    # unused there, and XLA drops it).
    aux["cache_chunk"] = stored_chunk(cache, new_cache)
    return logits_BxTxV, aux

  def _embed(self, tokens_BxT):
    """The embedding module (the tied head reuses it) and the scaled token embeddings."""
    cfg = self.cfg
    embed = nn.Embed(
      cfg.vocab_size,
      cfg.d_model,
      embedding_init=nn.with_logical_partitioning(normal_init(cfg.init_std), ("vocab", "embed")),
      dtype=cfg.compute_dtype,
      param_dtype=cfg.weight_dtype,
      name="embed",
    )
    x_BxTxD = embed(tokens_BxT)
    if cfg.embed_scale != 1.0:
      x_BxTxD = x_BxTxD * jnp.asarray(cfg.embed_scale, x_BxTxD.dtype)
    return embed, nn.with_logical_constraint(x_BxTxD, ("batch", "length", "embed"))

  def _plain_layers(self, x_BxTxD, prefix: str, positions_BxT, context, tokens_BxT):
    """The prelude's or coda's layers (not looped); context(prefix, i) is layer i's
    MixerContext. Returns the output and each layer's cache entry."""
    cfg = self.cfg
    kvs = []
    for i, mixer in enumerate(cfg.mixers(prefix)):
      ctx = dataclasses.replace(context(prefix, i), tokens_BxT=tokens_BxT)
      ve = cfg.has_value_embed(prefix, i)
      x_BxTxD, kv = Block(cfg, _out_std(cfg), mixer, ve, name=f"{prefix}_{i}")(
        x_BxTxD, positions_BxT, ctx
      )
      kvs.append(kv)
    return x_BxTxD, kvs

  def _prelude_out(self, x_BxTxD, positions_BxT, initial_state_BxTxD, num_positions: int):
    """e (the prelude's output, optionally normalized, injected into every recurrence) and
    h_0 (state_init's noise keyed by positions_BxT: counted from the document's start under
    document masking)."""
    cfg = self.cfg
    e_BxTxD = (
      RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="prelude_norm")(x_BxTxD)
      if cfg.prelude_norm
      else x_BxTxD
    )
    if initial_state_BxTxD is None:
      return e_BxTxD, self._initial_state(e_BxTxD, positions_BxT, num_positions)
    return e_BxTxD, initial_state_BxTxD.astype(e_BxTxD.dtype)

  def _recurrence_inputs(self, b: int, depth_mask_BxR, backprop_recurrences: int):
    """The depth mask (default: all recurrences active) and the scan's per-recurrence inputs."""
    if depth_mask_BxR is None:
      depth_mask_BxR = jnp.ones((b, self.cfg.num_recurrences), bool)
    stop_BxR = depth_lib.stop_gradient_mask(depth_mask_BxR, backprop_recurrences)
    return depth_mask_BxR, {"active_B": depth_mask_BxR.T, "stop_B": stop_BxR.T}

  def _broadcasts(
    self, tokens_BxT, e_BxTxD, positions_BxT, self_mask_BxTxT, past_mask_BxTxS, shared_kv, read_past
  ) -> dict:
    """What every recurrence reads unchanged (Recurrence's `bcast`)."""
    bcast = {
      "tokens": tokens_BxT,
      "e": e_BxTxD,
      "positions": positions_BxT,
      "self_mask": self_mask_BxTxT,
      "past_mask": past_mask_BxTxS,
      "shared_kv": shared_kv,
    }
    if read_past is not None:
      bcast["read_past"] = read_past
    return bcast

  def _coda_and_head(self, h_BxTxD, embed, positions_BxT, context, tokens_BxT):
    """h_R -> [core_out_proj] -> coda -> final norm -> LM head: float32 logits and the coda's
    cache entries."""
    cfg = self.cfg
    x_BxTxD = h_BxTxD
    if cfg.core_out_proj:  # Parcae's C, after the recurrences and before the coda.
      x_BxTxD = projection(cfg, cfg.d_model, cfg.init_std, "core_out", axes=("embed", None))(
        x_BxTxD
      )
    final_norm = RMSNorm(cfg.weight_dtype, cfg.norm_eps, name="final_norm")
    if cfg.core_out_norm == "final":
      x_BxTxD = final_norm(x_BxTxD)
    x_BxTxD, coda_kvs = self._plain_layers(x_BxTxD, "coda", positions_BxT, context, tokens_BxT)
    if cfg.core_out_norm != "every":  # 'every': h_R is already normalized by its recurrence.
      x_BxTxD = final_norm(x_BxTxD)
    if cfg.tie_embeddings:
      logits_BxTxV = embed.attend(x_BxTxD.astype(cfg.compute_dtype))
    else:
      head = projection(cfg, cfg.vocab_size, cfg.init_std, "head", axes=("embed", "vocab"))
      logits_BxTxV = head(x_BxTxD)
    logits_BxTxV = nn.with_logical_constraint(logits_BxTxV, ("batch", "length", "vocab"))
    return logits_BxTxV.astype(jnp.float32), coda_kvs

  def _diagnostics(self, ys, depth_mask_BxR, collect_states: bool) -> dict:
    """The aux entries both modes return: residual norms averaged over active sequences,
    optionally the states and the exit-gate logits."""
    active_RxB = depth_mask_BxR.T.astype(jnp.float32)
    count_R = jnp.maximum(jnp.sum(active_RxB, axis=1), 1.0)
    aux = {
      "residual_norm_R": jnp.sum(ys["residual_B"] * active_RxB, axis=1) / count_R,
      "relative_residual_R": jnp.sum(ys["relative_B"] * active_RxB, axis=1) / count_R,
    }
    if collect_states:
      aux["states_RxBxTxD"] = ys["h"]
    if self.cfg.exit_gate:
      aux["exit_logits_RxBxT"] = ys["exit_logit_BxT"]
    return aux

  def _initial_state(self, e_BxTxD, positions_BxT, num_positions: int):
    cfg = self.cfg
    if cfg.state_init == "zeros":
      return jnp.zeros_like(e_BxTxD)
    if cfg.state_init == "embed":
      return e_BxTxD
    # like_init: noise keyed by position, so a token gets the same h_0 whether it is processed
    # in a full sequence or alone in decode.
    # The noise of positions 0..P-1 is one table, gathered by each token's position: the same
    # values whatever the batch's sharding (the positions of document masking depend on the
    # data, and a vmap of fold_in over a batch-sharded array did not reproduce one device's).
    key = self.make_rng("state") if self.has_rng("state") else jax.random.PRNGKey(0)
    table_PxD = jax.vmap(lambda p: jax.random.normal(jax.random.fold_in(key, p), (cfg.d_model,)))(
      jnp.arange(num_positions)
    )
    return (cfg.state_init_std * table_PxD[positions_BxT]).astype(e_BxTxD.dtype)

  def _recurrences(self, decode: bool, collect_states: bool, prefill_block: int | None = None):
    """The core loop: lax.scan (one trace) or a Python loop (R traces), same parameters."""
    cfg = self.cfg
    body_cls = Recurrence
    if cfg.remat != "none":  # What the backward pass keeps of each recurrence's forward.
      policy = None if cfg.remat == "full" else getattr(jax.checkpoint_policies, cfg.remat)
      body_cls = nn.remat(Recurrence, prevent_cse=False, policy=policy)
    if cfg.scan_recurrences:
      scanned = nn.scan(
        body_cls,
        variable_broadcast="params",
        variable_axes={"perturbations": 0},
        split_rngs={"params": False},
        in_axes=(0, nn.broadcast),
        length=cfg.num_recurrences,
        unroll=min(cfg.scan_unroll or cfg.num_recurrences, cfg.num_recurrences),
      )
      return scanned(cfg, decode, collect_states, prefill_block, name="recurrence")
    body = body_cls(cfg, decode, collect_states, prefill_block, name="recurrence")

    def unrolled(carry, xs, bcast):
      ys = []
      for i in range(cfg.num_recurrences):
        carry, y = body(carry, jax.tree.map(lambda a, i=i: a[i], xs), bcast)
        ys.append(y)
      return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    return unrolled

  def _adaptive_core(self, h0_BxTxD, xs, bcast, depth, cache, policy, num_new_B, head, lookup):
    """The recurrences of a decode call with per-row depth (docs/design.md §3, "Depth at test
    time"): one recurrence per iteration of a while loop that ends once every row has stopped
    (its exit criterion, or its own recurrence count); a stopped row keeps its state and its
    cached K/V, and the loop costs nothing more once all have. head: (tokens, positions, the
    coda's context, whether h_0 was given) for the last real token's logits, computed only when
    some row checks a logit criterion. lookup: exit_lookup's. Returns
    (final states, the core entries to cache, slotted, aux: 'depth_B' the recurrences each row
    ran, 'state_BxD' its last real token's final state)."""
    cfg = self.cfg
    b, t, _ = h0_BxTxD.shape
    if lookup not in adaptive.LOOKUPS:
      raise ValueError(f"exit_lookup = {lookup!r}: expected one of {adaptive.LOOKUPS}.")
    tokens_BxT, positions_BxT, context, given = head
    h0_BxTxD = _depth_start(cfg, h0_BxTxD, depth, given)
    num_B = jnp.full((b,), t, jnp.int32) if num_new_B is None else num_new_B.astype(jnp.int32)
    real_BxT = jnp.arange(t)[None, :] < num_B[:, None]
    last_B = jnp.maximum(num_B - 1, 0)
    write_RxC = jnp.asarray(policy.writes, bool) if cache.share_kv else None
    none = adaptive.criterion_index("none")

    def body(mdl, c):
      i = c["i"]
      r = i + 1
      active_B = ~c["done_B"] & (i < depth.recurrences_B)
      read_B, bcast_r = _lookup_reads(cache, lookup, r, bcast)
      xs_r = _adaptive_xs(xs, i, read_B, active_B)
      carry, ys = Recurrence(cfg, True, name="recurrence")({"h": c["h"]}, xs_r, bcast_r)
      h_BxTxD = carry["h"]
      state = c["exit"]
      if cfg.exit_gate:
        gate_B = ys["exit_logit_BxT"][jnp.arange(b), last_B]
        state = adaptive.gate_step(state, gate_B, active_B)
      checks = adaptive.is_check(
        r, depth.min_recurrences_B, depth.check_every_B, depth.recurrences_B
      )
      checked_B = active_B & checks & (depth.criterion_B != none)
      need = jnp.any(checked_B & adaptive.is_logit_criterion(depth.criterion_B))
      skip = lambda m, h: jnp.zeros((b, cfg.vocab_size), jnp.float32)
      predict = lambda m, h: m._last_logits(h, last_B, tokens_BxT, positions_BxT, context)
      logits_BxV = nn.cond(need, predict, skip, mdl, h_BxTxD)
      exit_B, state = adaptive.check(
        state, depth.criterion_B, depth.threshold_B, checked_B, h_BxTxD, logits_BxV, real_BxT
      )
      stop_B = active_B & (exit_B | (r >= depth.recurrences_B))
      return {
        "i": r,
        "h": h_BxTxD,
        "done_B": c["done_B"] | stop_B,
        "depth_B": jnp.where(active_B, r, c["depth_B"]),
        "kv": _record_kv(c["kv"], ys["kv"], i, active_B, write_RxC),
        "exit": state,
      }

    init = {
      "i": jnp.zeros((), jnp.int32),
      "h": h0_BxTxD,
      "done_B": num_B == 0,  # Padding rows run nothing.
      "depth_B": jnp.zeros((b,), jnp.int32),
      "kv": _adaptive_kv_zeros(cfg, cache, policy, b, t),
      "exit": adaptive.init_state(h0_BxTxD, cfg.vocab_size),
    }
    running = lambda mdl, c: (c["i"] < cfg.num_recurrences) & ~jnp.all(c["done_B"])
    c = nn.while_loop(running, body, self, init)
    core_new, slotted = _adaptive_cached(cache, policy, c["kv"], c["depth_B"])
    state_BxD = c["h"][jnp.arange(b), last_B].astype(jnp.float32)
    return c["h"], core_new, slotted, {"depth_B": c["depth_B"], "state_BxD": state_BxD}

  def _last_logits(self, h_BxTxD, last_B, tokens_BxT, positions_BxT, context):
    """The logits of each row's last real token from states h (the coda and head; what a
    logit exit criterion reads after a recurrence)."""
    head, _ = self._embed(tokens_BxT)
    logits, _ = self._coda_and_head(h_BxTxD, head, positions_BxT, context, tokens_BxT)
    return logits[jnp.arange(h_BxTxD.shape[0]), last_B]


def recurrence_logits(cfg: ModelConfig, params, states_RxBxTxD: jax.Array) -> jax.Array:
  """Every recurrence's logits (float32), the LM head on each state h_r: a model whose
  recurrences end in its final norm and that has no coda (core_out_norm 'every', as Ouro's
  per-step outputs) predicts from each h_r directly."""
  if cfg.core_out_norm != "every" or cfg.num_coda_layers:
    raise ValueError("recurrence_logits needs core_out_norm='every' and num_coda_layers=0.")
  p = params["params"]
  head_DxV = p["embed"]["embedding"].T if cfg.tie_embeddings else p["head"]["kernel"]
  states = states_RxBxTxD.astype(cfg.compute_dtype)
  return jnp.einsum("rbtd,dv->rbtv", states, head_DxV.astype(cfg.compute_dtype)).astype(jnp.float32)
