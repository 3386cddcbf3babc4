"""FLOP counts from the config against the model's own program and a hand-derived case."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

import looped_testing as testing
from looped.model import LoopedLM, ModelConfig, flops, init_params, kda


def _dot_flops(jaxpr) -> float:
  """2 x multiply-adds of every dot_general in a jaxpr, scan bodies times their length."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
      lhs, rhs = (v.aval.shape for v in eqn.invars)
      out = eqn.outvars[0].aval.shape
      contracted = np.prod([lhs[i] for i in lhs_contract])
      total += 2.0 * np.prod(out) * contracted
      del rhs, lhs_batch
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          sub = sub.jaxpr
        if isinstance(sub, jax.extend.core.Jaxpr):
          total += times * _dot_flops(sub)
  return total


class FlopsTest(parameterized.TestCase):
  def test_hand_derived(self):
    cfg = ModelConfig(
      vocab_size=10, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=16,
      num_prelude_layers=1, num_core_layers=1, num_coda_layers=1, num_recurrences=3,
      injection="linear",
    )  # fmt: skip
    # Per layer: Q, O 8x(2x4) each, K, V 8x4 each = 192; SwiGLU 3 x 8x16 = 384. Layers applied:
    # 1 + 1 + 3 = 5. Injection [h; e] W: 16x8 per recurrence = 3 x 128. Head 8x10 = 80.
    # Weights 5 x 576 + 384 + 80 = 3344; scores 5 layers x 2 heads x 4 x 6 keys x 2 = 480.
    self.assertEqual(flops.forward_flops_per_token(cfg, 6), 2 * (3344 + 480))
    self.assertEqual(flops.train_flops_per_token(cfg, 6), 6 * (3344 + 480))
    self.assertEqual(flops.benice_flops_per_token(cfg, 6, 2), 12 * 3824 + 2 * 2 * 3824)

  # Scanned only with the additive injection: flax traces a scanned body's first layer once
  # more outside the scan (dead code XLA removes), which would count a dead injection matmul.
  @parameterized.parameters(
    ("diagonal", False, 1), ("linear", False, 1), ("additive", True, 1), ("additive", True, 2)
  )  # fmt: skip
  def test_equals_the_dots_the_model_runs(self, injection, scan, unroll):
    cfg = dataclasses.replace(
      testing.TINY_MODEL, injection=injection, scan_recurrences=scan, scan_unroll=unroll
    )
    self._assert_counts_the_dots(cfg)

  # MLA with low-rank queries beside GQA; MLA with full-rank queries in Ouro's shape (no
  # injection, no coda, an exit gate each recurrence).
  @parameterized.parameters(
    dict(
      prelude_mixers=("mla",), core_mixers=("gqa", "mla"), mla_q_rank=12, mla_kv_rank=10,
      mla_rope_dim=6,
    ),
    dict(core_mixers=("mla",), injection="none", exit_gate=True, num_coda_layers=0),
    dict(value_embed_layers=(0, 2), value_embed_gate_dim=5, core_out_proj=True),
  )  # fmt: skip
  def test_mla_exit_gate_and_parcae_parts_equal_the_dots_the_model_runs(self, **fields):
    cfg = dataclasses.replace(testing.TINY_MODEL, scan_recurrences=False, **fields)
    self._assert_counts_the_dots(cfg)

  def _assert_counts_the_dots(self, cfg):
    model = LoopedLM(cfg)
    tokens_BxT = jnp.zeros((2, 12), jnp.int32)
    params = init_params(model, jax.random.PRNGKey(0), tokens_BxT)
    jaxpr = jax.make_jaxpr(lambda p, x: model.apply(p, x)[0])(params, tokens_BxT).jaxpr
    self.assertEqual(_dot_flops(jaxpr), flops.forward_flops_per_token(cfg, 12) * 2 * 12)

  def test_kda_state_is_the_dots_of_the_recurrent_form(self):
    # kda_recurrent is the delta rule token by token (decode): its only dots are k^T S, the
    # rank-1 update and q^T S, which mixer_macs counts as `state` per token.
    cfg = dataclasses.replace(testing.TINY_MODEL, core_mixers=("kda",))
    b, t, n, h = 2, 5, cfg.num_heads, cfg.head_dim
    args = [jnp.zeros((b, t, n, h))] * 3 + [jnp.zeros((b, t, n, h)), jnp.zeros((b, t, n))]
    jaxpr = jax.make_jaxpr(kda.kda_recurrent)(*args).jaxpr
    self.assertEqual(_dot_flops(jaxpr), 2 * flops.mixer_macs(cfg, "kda").state * b * t)

  def test_unknown_mixer_is_refused(self):
    with self.assertRaisesRegex(ValueError, "GQA, MLA and KDA layers; this model has rnn layers"):
      flops.mixer_macs(testing.TINY_MODEL, "rnn")


if __name__ == "__main__":
  absltest.main()
