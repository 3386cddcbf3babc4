"""The simulator's model shape, layer by layer with each layer's mixer: multiply-adds counted
by hand for tiny GQA, MLA, KDA and hybrid models, and parameters against the arrays the model
itself initializes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from looped.engine import padding
from looped.model import LoopedLM, ModelConfig, flops, init_params, mla
from looped.model.cache_layout import KVLayout
from looped.scheduler import scheduler
from looped.sim import cost_model, engine_cost, hardware, shape, simulate, traces

# d 8, 2 query heads and 1 KV head of 4, SwiGLU 16, vocabulary 10, one layer per stage, R 3:
# 1 + 3 + 1 = 5 layer executions per token. MLA latent 6, RoPE 2, full-rank queries. KDA conv 4.
_TINY = ModelConfig(
  vocab_size=10, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=16,
  num_prelude_layers=1, num_core_layers=1, num_coda_layers=1, num_recurrences=3,
  mla_kv_rank=6, mla_rope_dim=2, mla_q_rank=0, kda_conv_size=4, injection="linear",
)  # fmt: skip

MLP = 3 * 8 * 16  # up, gate, down: 384.
# GQA: q 8x(2x4), k 8x4, v 8x4, o (2x4)x8 = 64 + 32 + 32 + 64 = 192; per key read: Q.K and
# P.V over 2 heads of 4 = 16.
GQA = 192
GQA_KEY = 2 * 2 * 4
# MLA: query 8x(2x(4+2)) = 96; kv_down 8x(6+2) = 64; key_up and value_up 6x(2x4) = 48 each
# (absorbed: applied to the query and the output instead, the same count); out 8x8 = 64: 320.
# Per key, absorbed (the engine's form): scores over the latent and the RoPE key 2x(6+2) = 16,
# P times the latent 2x6 = 12.
MLA = 96 + 64 + 2 * 48 + 64
MLA_KEY = 16 + 12
# KDA: qkv 8x24 = 192; decay 8x4 + 4x(2x4) = 64; gate the same 64; beta 8x2 = 16; out 8x8 = 64;
# the depthwise conv 4 taps x 24 channels = 96: 496. The delta rule per head: k^T S, the
# rank-1 update and q^T S on a 4x4 state: 3 x 16, 2 heads: 96.
KDA = 192 + 64 + 64 + 16 + 64 + 96
KDA_STATE = 3 * 16 * 2


def _cfg(**fields) -> ModelConfig:
  return dataclasses.replace(_TINY, **fields)


_HYBRID = dict(
  prelude_mixers=("kda",), core_mixers=("kda", "mla"), num_core_layers=2, coda_mixers=("gqa",)
)


class ShapeCountsTest(absltest.TestCase):
  def test_gqa(self):
    s = shape.ModelShape.from_config(_cfg())
    self.assertEqual(s.weight_macs_per_token, 5 * (GQA + MLP))
    self.assertEqual(s.macs_per_key, 5 * GQA_KEY)
    self.assertEqual((s.state_macs_per_token, s.attention_heads_executed), (0, 5 * 2))
    # Layer: matrices, q/k norms (2 x 4), attention and MLP norms (2 x 8). Model: 3 layers,
    # embedding 10x8, prelude and final norms 2 x 8, linear injection (8+8)x8.
    self.assertEqual(s.num_params, 3 * (GQA + MLP + 8 + 16) + 80 + 16 + 128)

  def test_mla(self):
    s = shape.ModelShape.from_config(_cfg(prelude_mixers=("mla",), core_mixers=("mla",)))
    self.assertEqual(s.weight_macs_per_token, 4 * (MLA + MLP) + (GQA + MLP))  # Coda: GQA.
    self.assertEqual(s.macs_per_key, 4 * MLA_KEY + GQA_KEY)
    mla_layer = MLA + 6 + MLP + 16  # kv_norm over the latent.
    self.assertEqual(s.num_params, 2 * mla_layer + (GQA + MLP + 24) + 80 + 16 + 128)

  def test_kda(self):
    s = shape.ModelShape.from_config(_cfg(**{f"{st}_mixers": ("kda",) for st in _STAGES}))
    self.assertEqual(s.weight_macs_per_token, 5 * (KDA + MLP))
    self.assertEqual(s.state_macs_per_token, 5 * KDA_STATE)
    self.assertEqual((s.macs_per_key, s.attention_heads_executed), (0, 0))
    # A_log 2, dt_bias 2x4, output gate bias 2x4, output norm 4.
    kda_layer = KDA + 2 + 8 + 8 + 4 + MLP + 16
    self.assertEqual(s.num_params, 3 * kda_layer + 80 + 16 + 128)

  def test_hybrid(self):
    # Prelude KDA (once), core KDA then MLA (3 times each), coda GQA (once).
    s = shape.ModelShape.from_config(_cfg(**_HYBRID))
    self.assertEqual(s.weight_macs_per_token, 4 * (KDA + MLP) + 3 * (MLA + MLP) + (GQA + MLP))
    self.assertEqual(s.state_macs_per_token, 4 * KDA_STATE)
    self.assertEqual(s.macs_per_key, 3 * MLA_KEY + GQA_KEY)
    self.assertEqual(s.attention_heads_executed, 4 * 2)
    kda_layer, mla_layer, gqa_layer = KDA + 22 + MLP + 16, MLA + 6 + MLP + 16, GQA + MLP + 24
    self.assertEqual(s.num_params, 2 * kda_layer + mla_layer + gqa_layer + 80 + 16 + 128)
    # A step's FLOPs: 3 new tokens after 5 cached (3 x 5 + 3 x 4 / 2 = 21 pairs), one sampled:
    # 2 x (layers' weights + KDA state) x 3 + 2 x (per key) x 21 + the LM head 2 x 10 x 8.
    hw = hardware.Hardware("t", 1e15, 1e12, 1e9, 0.0, "test")
    ex = cost_model.CostModelExecutor(s, hw, KVLayout(True, "bf16"))
    batch = scheduler.StepBatch([None], [3], [5], num_sampled=1)
    weights = 4 * (KDA + MLP) + 3 * (MLA + MLP) + (GQA + MLP) + 4 * KDA_STATE
    self.assertEqual(ex.terms(batch)[0], 2 * weights * 3 + 2 * (3 * MLA_KEY + GQA_KEY) * 21 + 160)


_STAGES = ("prelude", "core", "coda")


class MlaFormsTest(absltest.TestCase):
  def test_the_forms_count_the_dots_they_run(self):
    # T queries over S latents: the expanded form projects all S latents up, then attends;
    # the absorbed form projects the T queries and outputs, then attends over the latents.
    cfg = _cfg(core_mixers=("mla",))
    b, t, k = 2, 3, 7
    n, h, lat, y = 2, 4, 6, 2
    args = (
      jnp.zeros((b, t, n, h)), jnp.zeros((b, t, n, y)), jnp.zeros((b, k, 1, lat)),
      jnp.zeros((b, k, 1, y)), jnp.zeros((lat, n, h)), jnp.zeros((lat, n, h)),
      jnp.ones((b, t, k), bool),
    )  # fmt: skip
    ups = 2 * lat * n * h  # key_up and value_up.
    for form, absorbed, up_rows in ((mla.mla_expanded, False, k), (mla.mla_absorbed, True, t)):
      with self.subTest(absorbed=absorbed):
        per_key = flops.mixer_macs(cfg, "mla", absorbed=absorbed).per_key
        self.assertEqual(per_key, MLA_KEY if absorbed else 12 + 8)
        self.assertEqual(
          _dots(jax.make_jaxpr(form)(*args).jaxpr), b * (up_rows * ups + t * k * per_key)
        )


def _dots(jaxpr) -> int:
  """Multiply-adds of the dot_generals of a flat jaxpr."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      total += int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[i] for i in contract]))
  return total


class ParamsAgainstTheModelTest(parameterized.TestCase):
  @parameterized.named_parameters(
    ("gqa_diagonal_bias_sandwich", dict(injection="diagonal", qk_bias=True, block_norm="sandwich",
                                        tie_embeddings=False)),
    ("mla_low_rank_exit_gate", dict(core_mixers=("mla",), mla_q_rank=5, exit_gate=True,
                                    injection="none", num_coda_layers=0, core_out_norm="every")),
    ("hybrid_post_no_qk_norm", dict(**_HYBRID, block_norm="post", qk_norm=False,
                                    prelude_norm=False, core_out_norm="final")),
    ("kda_additive", dict(**{f"{st}_mixers": ("kda",) for st in _STAGES}, injection="additive")),
  )  # fmt: skip
  def test_num_params_is_the_initialized_tree(self, fields):
    cfg = _cfg(**fields)
    model = LoopedLM(cfg)
    init = lambda key: init_params(model, key, jnp.zeros((1, 4), jnp.int32))
    tree = jax.eval_shape(init, jax.random.PRNGKey(0))
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))
    self.assertEqual(shape.ModelShape.from_config(cfg).num_params, count)


class KdaServingTest(absltest.TestCase):
  def test_state_is_read_and_written_per_row(self):
    s = shape.ModelShape.from_config(_cfg(**_HYBRID))
    hw = hardware.Hardware("t", 1e15, 1e12, 1e9, 0.0, "test")
    ex = cost_model.CostModelExecutor(s, hw, KVLayout(True, "bf16"))
    # One KDA layer's state: float32 2x4x4 plus a conv tail of 3 x 24: 416 bytes. Read by
    # every KDA execution (prelude 1, core 3), written for each cached copy (shared: 1 + 1).
    per_row = (4 + 2) * (2 * 4 * 4 + 3 * 24) * 4
    self.assertEqual(ex.step_terms(1, 1, 1, 0, 3)[1] - ex.step_terms(1, 1, 1, 0, 1)[1], 2 * per_row)

  def test_engine_pricing_moves_each_rows_state(self):
    s = shape.ModelShape.from_config(_cfg(**_HYBRID))
    hw = hardware.Hardware("t", 1e15, 1e12, 1e9, 0.0, "test", pricing="engine")
    pad = padding.Padding.create(4, (1, 2), (1,), (4,), max_model_len=16)
    ex = engine_cost.EngineCostExecutor(s, hw, pad, KVLayout(True, None))
    # One more row of 1 token over 16 slots (fp32): its K/V read by every layer execution (the
    # unshared layout's bytes), its float32 scores (4 attention executions x 2 heads x 17
    # positions, written and read), its gather of the stored pages (read and written), and its
    # KDA states: 6 copies (4 executions read, 2 cached copies written) of 416 bytes.
    raw = s.kv_bytes_per_token(KVLayout(False, None), raw_itemsize=4)
    stored = s.kv_bytes_per_token(KVLayout(True, None), raw_itemsize=4)
    per_row = 17 * raw + 2 * 4 * 8 * 17 + 2 * stored * 16 + 6 * 416
    self.assertEqual(ex.padded_terms(2, 1, 16)[1] - ex.padded_terms(1, 1, 16)[1], per_row)

  def test_kda_models_get_state_slots_and_no_prefix_hits(self):
    # The same 600-token prompt twice, far apart: GQA hits its full 16-token pages up to the last
    # 32-token block boundary, 576 tokens; a model with KDA layers (as the engine) caches no
    # prefix, and its 4 state slots use up budget.
    requests = [traces.Request(i, 100.0 * i, 600, 4, (0, 1)) for i in range(2)]
    config = scheduler.SchedulerConfig(16, 256, 4, prefill_block=32)
    for fields, hits in ((dict(), True), (_HYBRID, False)):
      s = shape.ModelShape.from_config(_cfg(**fields))
      slots = 4 * s.kv_bytes_per_sequence(KVLayout(True))
      self.assertEqual(slots > 0, not hits)
      budget = slots + 100 * 16 * s.kv_bytes_per_token(KVLayout(True, "bf16"))
      run = simulate.simulate_one(
        requests, s, hardware.load("h200"), budget=budget, layout=KVLayout(True, "bf16"),
        config=config,
      )  # fmt: skip
      self.assertEqual((run["num_pages"], run["prefix_caching"]), (100, hits))
      self.assertEqual(run["hit_rate"], 576 / 1200 if hits else 0.0)


if __name__ == "__main__":
  absltest.main()
