"""One cache layout for the model, the engine's page pool and the serving simulator.

For GQA, MLA, KDA and a KDA:MLA hybrid, shared and unshared, in every KV format the model
accepts, the simulator's bytes per token (and so its pages per budget and bytes per request)
equal the engine pool's, with one stated difference: the engine's pages (like the model's cache)
quantize one token slice at a time and so store nvfp4's float32 tensor scale per token slice,
which the simulator leaves out as kv_quant.bytes_per_value does (amortised over a page). KDA
layers keep a per-sequence state, which the engine holds in one state slot per running request
beside its pages: its pool is pages of the layout's per-token bytes plus slots of its
per-sequence bytes (a model of KDA layers only has nothing to page and is refused by both), and
the KDA state is compared with the model's own cache.

Independent of the layout function: one hand-derived case per mixer and the hybrid, the entry
list of a small model, and the bytes of the arrays the engine and the model really allocate
(shapes only, jax.eval_shape).
"""

import dataclasses
import math

import jax
from absl.testing import absltest, parameterized

from configs import serve_sim
from looped import config_checks, kv_quant
from looped.engine import engine as engine_lib
from looped.engine import paged_cache
from looped.model import LoopedLM, ModelConfig, from_config, init_cache, mixer_registry, mixers
from looped.model.attention import Attention
from looped.model.cache_layout import KVLayout, cache_layout
from looped.model.kda import KDA
from looped.model.mixer_interface import SequenceMixer
from looped.model.mla import MLA
from looped.scheduler import scheduler
from looped.sim import hardware, shape, simulate

R = 3
_BASE = dict(
  vocab_size=64,
  d_model=64,
  num_heads=2,
  num_kv_heads=1,
  head_dim=32,
  mlp_dim=64,
  num_prelude_layers=1,
  num_core_layers=2,
  num_coda_layers=1,
  num_recurrences=R,
  mla_kv_rank=64,
  mla_rope_dim=32,
  kda_conv_size=4,
)
_ALL = lambda m: dict(prelude_mixers=(m,), core_mixers=(m,), coda_mixers=(m,))
MODELS = {
  "gqa": ModelConfig(**_BASE, **_ALL("gqa")),
  "mla": ModelConfig(**_BASE, **_ALL("mla")),
  "kda": ModelConfig(**_BASE, **_ALL("kda")),
  # Core layers alternate KDA and MLA; prelude and coda are MLA.
  "kda_mla": ModelConfig(
    **_BASE, prelude_mixers=("mla",), core_mixers=("kda", "mla"), coda_mixers=("mla",)
  ),
  # A KDA core between GQA prelude and coda.
  "kda_gqa": ModelConfig(
    **_BASE, prelude_mixers=("gqa",), core_mixers=("kda",), coda_mixers=("gqa",)
  ),
}
FORMATS = (None,) + kv_quant.FORMATS  # None: raw pages at the compute dtype (float32 here).
CASES = [(m, s, f) for m in MODELS for s in (True, False) for f in FORMATS]


def _sim_shape(cfg: ModelConfig) -> shape.ModelShape:
  return shape.ModelShape.from_config(dataclasses.asdict(cfg))


def _per_token_entries(cfg: ModelConfig, share_kv: bool) -> int:
  """Per-token entries (token slices) the cache keeps, by hand: GQA K and V, MLA latent and RoPE
  key, per cached layer copy; KDA none."""
  count = 0
  for stage in ("prelude", "core", "coda"):
    copies = R if stage == "core" and not share_kv else 1
    count += copies * sum(2 for m in cfg.mixers(stage) if m != "kda")
  return count


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class SimulatorMatchesEngineTest(parameterized.TestCase):
  @parameterized.parameters(*CASES)
  def test_bytes_per_token_pages_and_request_bytes(self, model, share_kv, fmt):
    cfg = MODELS[model]
    mixers.check_kv_format(cfg, fmt or "bf16")  # Every case here is a format the model accepts.
    sim = _sim_shape(cfg)
    raw = cfg.compute_dtype.itemsize
    sim_bytes = sim.kv_bytes_per_token(KVLayout(share_kv, fmt), raw_itemsize=raw)
    engine_bytes = KVLayout(share_kv, fmt).bytes_per_token(cfg)
    # The engine stores nvfp4's float32 tensor scale per token slice; the simulator does not.
    tensor_scales = 4 * _per_token_entries(cfg, share_kv) if fmt == "nvfp4" else 0
    self.assertEqual(engine_bytes, sim_bytes + tensor_scales)

    # Pages a budget holds, and bytes a request of a given length takes.
    page_size, length, budget = 16, 100, 3_000_000
    sim_page = page_size * sim.kv_bytes_per_token(KVLayout(share_kv, fmt), raw_itemsize=raw)
    if model == "kda":  # Nothing per token: nothing to page (the simulator refuses the model).
      self.assertEqual(sim_page, 0)
      return
    # The budget first holds a state slot per running request (KDA layers; none otherwise).
    seqs = 8
    layout = KVLayout(share_kv, fmt, page_size=page_size)
    engine_pages = engine_lib.pages_for_budget(LoopedLM(cfg), budget, layout, seqs)
    pages_budget = budget - seqs * sim.kv_bytes_per_sequence(KVLayout(share_kv))
    pages_per_request = math.ceil(length / page_size)  # The scheduler's pool, for both.
    if fmt != "nvfp4":
      self.assertEqual(engine_pages, int(pages_budget // sim_page))
    else:
      self.assertLessEqual(engine_pages, int(pages_budget // sim_page))
    self.assertEqual(
      pages_per_request * page_size * engine_bytes,
      pages_per_request * (sim_page + page_size * tensor_scales),
    )

  @parameterized.parameters(*[(m, s) for m in MODELS for s in (True, False)])
  def test_per_sequence_state_matches_the_models_cache(self, model, share_kv):
    cfg = MODELS[model]
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, 1, share_kv))  # One row, one slot.
    per_token = KVLayout(share_kv, None).bytes_per_token(cfg)  # Raw, compute dtype.
    sim = _sim_shape(cfg)
    self.assertEqual(
      _nbytes(cache.layers), per_token + sim.kv_bytes_per_sequence(KVLayout(share_kv))
    )

  def test_formats_refused_alike(self):
    cfg = dataclasses.replace(MODELS["kda_mla"], mla_rope_dim=8)  # Off nvfp4's 16-value block.
    with self.assertRaisesRegex(ValueError, "block size 16"):
      mixers.check_kv_format(cfg, "nvfp4")
    with self.assertRaisesRegex(ValueError, "block size 16"):
      _sim_shape(cfg).kv_bytes_per_token(KVLayout(True, "nvfp4"))
    self.assertGreater(_sim_shape(cfg).kv_bytes_per_token(KVLayout(True, "fp8")), 0)


class ArraysTest(parameterized.TestCase):
  """The layout's byte counts are what the engine's pages and the model's cache allocate."""

  @parameterized.parameters(*CASES)
  def test_engine_pages_and_model_cache(self, model, share_kv, fmt):
    cfg = MODELS[model]
    per_token = KVLayout(share_kv, fmt).bytes_per_token(cfg)
    state = _sim_shape(cfg).kv_bytes_per_sequence(KVLayout(share_kv))
    if model == "kda":  # Nothing per token: the engine has nothing to page.
      with self.assertRaisesRegex(ValueError, "kda"):
        paged_cache.init_pages(cfg, 1, KVLayout(share_kv, fmt, page_size=1), num_slots=1)
    else:  # One-token pages and state slots: a real one and the scratch one of each.
      pages = jax.eval_shape(
        lambda: paged_cache.init_pages(cfg, 1, KVLayout(share_kv, fmt, page_size=1), 1)
      )
      self.assertEqual(_nbytes(pages), 2 * per_token + 2 * state)
    slots = 4
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, slots, share_kv, kv_format=fmt))
    self.assertEqual(_nbytes(cache.layers), slots * per_token + state)

  @parameterized.parameters(
    *[
      (m, s, f) for m in ("gqa", "kda_gqa", "kda_mla") for s in (True, False) for f in (None, "fp8")
    ]
  )
  def test_engine_pool_bytes(self, model, share_kv, fmt):
    """The engine's pool: num_pages pages of the layout's per-token bytes plus max_num_seqs
    slots of its per-sequence bytes, what pages_for_budget fits and what is allocated."""
    cfg = MODELS[model]
    layout = cache_layout(cfg, share_kv)
    per_token = layout.bytes_per_token(fmt, raw_itemsize=4, tensor_scales=True)
    per_sequence = layout.bytes_per_sequence()
    self.assertEqual(per_sequence > 0, "kda" in model)
    num_pages, page_size, seqs = 5, 4, 3
    config = engine_lib.EngineConfig(
      share_kv=share_kv,
      kv_format=fmt,
      num_pages=num_pages,
      page_size=page_size,
      max_num_batched_tokens=8,
      max_num_seqs=seqs,
    )
    engine = engine_lib.Engine(LoopedLM(cfg), None, config)
    want = num_pages * page_size * per_token + seqs * per_sequence
    self.assertEqual(engine.pool_bytes, want)
    self.assertEqual(engine.num_slots, seqs if per_sequence else 0)
    # The arrays, with the scratch page (and the scratch slot when there are slots).
    scratch = page_size * per_token + per_sequence
    self.assertEqual(_nbytes(engine.executor.pages), want + scratch)
    args = (LoopedLM(cfg), engine.pool_bytes, KVLayout(share_kv, fmt, page_size=page_size), seqs)
    self.assertEqual(engine_lib.pages_for_budget(*args), num_pages)


class HandDerivedTest(absltest.TestCase):
  """One case per mixer, written out from the model's sizes (P = 1, B = 2, C = 1, R = 3)."""

  def test_gqa(self):
    cfg = MODELS["gqa"]
    k, h = cfg.num_kv_heads, cfg.head_dim
    sim = _sim_shape(cfg)
    for share, layers in ((True, 1 + 2 + 1), (False, 1 + 2 * R + 1)):
      self.assertEqual(sim.kv_bytes_per_token(KVLayout(share, "bf16")), layers * 2 * k * h * 2)
      self.assertEqual(sim.kv_bytes_per_token(KVLayout(share, "fp8")), layers * 2 * k * (h + 4))
      self.assertEqual(
        sim.kv_bytes_per_token(KVLayout(share, "nvfp4")), layers * 2 * k * (h // 2 + h // 16)
      )
      self.assertEqual(sim.kv_layers(KVLayout(share)), layers)
      self.assertEqual(sim.kv_bytes_per_sequence(KVLayout(share)), 0)
      # The engine: raw float32 pages; nvfp4 with a 4-byte tensor scale per K and V slice.
      self.assertEqual(KVLayout(share, None).bytes_per_token(cfg), layers * 2 * k * h * 4)
      self.assertEqual(
        KVLayout(share, "nvfp4").bytes_per_token(cfg), layers * 2 * (k * (h // 2 + h // 16) + 4)
      )
      self.assertEqual(cache_layout(cfg, share).vectors_per_token, layers * 2 * k)

  def test_mla(self):
    cfg = MODELS["mla"]
    lat, rope = cfg.mla_kv_rank, cfg.mla_rope_dim
    sim = _sim_shape(cfg)
    for share, layers in ((True, 4), (False, 8)):
      self.assertEqual(sim.kv_bytes_per_token(KVLayout(share, "bf16")), layers * (lat + rope) * 2)
      mx = (lat + lat // 32) + (rope + rope // 32)  # e4m3 bytes + one E8M0 per 32 values.
      self.assertEqual(sim.kv_bytes_per_token(KVLayout(share, "mxfp8")), layers * mx)
      self.assertEqual(KVLayout(share, "mxfp8").bytes_per_token(cfg), layers * mx)

  def test_kda(self):
    cfg = MODELS["kda"]
    n, h, w = cfg.num_heads, cfg.head_dim, cfg.kda_conv_size
    state = 4 * (n * h * h + (w - 1) * 3 * n * h)  # float32 state [N, H, H] and conv tail.
    sim = _sim_shape(cfg)
    for share, layers in ((True, 4), (False, 8)):
      self.assertEqual(sim.kv_bytes_per_sequence(KVLayout(share)), layers * state)
      for fmt in kv_quant.FORMATS:  # Never quantized; nothing per token.
        self.assertEqual(sim.kv_bytes_per_token(KVLayout(share, fmt)), 0)
      self.assertEqual(sim.kv_layers(KVLayout(share)), 0)

  def test_kda_mla_hybrid(self):
    cfg = MODELS["kda_mla"]  # prelude mla; core kda, mla; coda mla.
    n, h, w = cfg.num_heads, cfg.head_dim, cfg.kda_conv_size
    state = 4 * (n * h * h + (w - 1) * 3 * n * h)
    mla = (cfg.mla_kv_rank + cfg.mla_rope_dim) * 2
    sim = _sim_shape(cfg)
    self.assertEqual(sim.kv_bytes_per_token(KVLayout(True, "bf16")), (1 + 1 + 1) * mla)
    self.assertEqual(sim.kv_bytes_per_token(KVLayout(False, "bf16")), (1 + R + 1) * mla)
    self.assertEqual(sim.kv_bytes_per_sequence(KVLayout(True)), state)
    self.assertEqual(sim.kv_bytes_per_sequence(KVLayout(False)), R * state)
    # The evaluation's count (mixers.cache_bytes) reads the same layout.
    got = mixers.cache_bytes(cfg, "bf16")
    self.assertEqual(got["per_token"], {"shared": 3 * mla, "unshared": (2 + R) * mla})
    self.assertEqual(got["per_sequence"], {"shared": state, "unshared": R * state})

  def test_entries(self):
    cfg = MODELS["kda_mla"]
    self.assertEqual(
      cache_layout(cfg, True).entries(),
      [("prelude", 0, None, "mla"), ("core", 0, None, "kda"), ("core", 1, None, "mla")]
      + [("coda", 0, None, "mla")],
    )
    self.assertEqual(
      cache_layout(cfg, False).entries(),
      [("prelude", 0, None, "mla")]
      + [("core", 0, r, "kda") for r in range(R)]
      + [("core", 1, r, "mla") for r in range(R)]
      + [("coda", 0, None, "mla")],
    )

  def test_mixers_implement_the_interface(self):
    cfg = MODELS["gqa"]
    for module in (Attention, MLA, KDA):
      self.assertIsInstance(module(cfg, 0.02), SequenceMixer)
    for mixer in mixer_registry.REGISTRY.values():
      self.assertIs(mixer.module.mixer_cache, mixer.cache)


class SimulatorConfigTest(absltest.TestCase):
  """The serve_sim program sizes pages from the configured model's mixers."""

  def _config(self, **mixers_):
    config = serve_sim.get_config("smoke")
    for name, value in mixers_.items():
      config.model[name] = value
    return config

  def test_hybrid_model_pages_its_mla_layers_and_reports_kda_state(self):
    config = self._config(core_mixers=("kda", "mla"))
    config.sim.max_requests = 20
    simulate.validate(config)
    s = simulate.model_shape(config)
    requests = simulate.load_requests(config)
    sched = scheduler.SchedulerConfig(
      page_size=16, max_num_batched_tokens=256, max_num_seqs=8, max_model_len=8192
    )
    out = simulate.simulate_one(
      requests, s, hardware.PROFILES["h200"], budget=4e6, layout=KVLayout(True, "bf16"),
      config=sched,
    )  # fmt: skip
    cfg = from_config(config.model)
    self.assertEqual(out["kv_bytes_per_token"], KVLayout(True, "bf16").bytes_per_token(cfg))
    # The engine's pool for that budget: its 8 KDA state slots first, then pages.
    engine_pages = engine_lib.pages_for_budget(LoopedLM(cfg), 4e6, KVLayout(True, "bf16"), 8)
    self.assertEqual(out["num_pages"], engine_pages)
    self.assertLess(engine_pages, int(4e6 // (16 * out["kv_bytes_per_token"])))
    self.assertFalse(out["prefix_caching"])  # A state is not a function of a page.
    self.assertEqual(out["kv_state_bytes_per_sequence"], s.kv_bytes_per_sequence(KVLayout(True)))
    self.assertGreater(out["kv_state_bytes_per_sequence"], 0)

  def test_kda_only_model_and_off_block_formats_are_refused(self):
    config = self._config(prelude_mixers=("kda",), core_mixers=("kda",), coda_mixers=("kda",))
    with self.assertRaisesRegex(config_checks.ConfigError, "per-sequence state"):
      simulate.validate(config)
    config = self._config(core_mixers=("mla",))
    config.model.mla_rope_dim = 8
    config.sim.kv_format = ("nvfp4",)
    with self.assertRaisesRegex(config_checks.ConfigError, "sim.kv_format .* block size 16"):
      simulate.validate(config)


if __name__ == "__main__":
  absltest.main()
