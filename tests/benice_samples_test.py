"""The report's greedy samples: each layout's tokens are the greedy continuation of that layout's
own decoding (unshared decode vs exact shared decode), checked against decode_forward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import looped_testing as testing
from looped.benice import samples
from looped.model import init_params
from looped.model.looped_lm import LoopedLM
from looped.model.sharing import decode_forward

PROMPT, NEW = 5, 8


def _decode(ids) -> str:
  return "".join(chr(ord("a") + int(t) % 26) for t in ids)


class SamplesTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    # Random weights at a large init: recurrences disagree, so sharing changes the greedy text.
    cls.model = LoopedLM(testing.TINY_MODEL)
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, 16), 0, 61)
    cls.rows_BxT = np.asarray(tokens)
    cls.params = init_params(cls.model, jax.random.PRNGKey(0), tokens)
    batches = [{"inputs": np.asarray(tokens[:2])}, {"inputs": np.asarray(tokens[2:])}]
    cls.prompts = samples.prompts(batches, 3, PROMPT)
    cls.rows = samples.generate(cls.model, cls.params, cls.prompts, NEW, _decode)

  def test_prompts_are_the_first_tokens_of_the_first_rows(self):
    self.assertLen(self.prompts, 3)
    for row, prompt in zip(self.rows_BxT, self.prompts):
      self.assertEqual(prompt, tuple(int(t) for t in row[:PROMPT]))

  def test_each_layout_is_greedy_under_its_own_decoding(self):
    for prompt, row in zip(self.prompts, self.rows):
      self.assertEqual(row["prompt"], _decode(prompt))
      for layout, share_kv in (("unshared", False), ("shared", True)):
        generated = row[f"{layout}_tokens"]
        self.assertLen(generated, NEW)
        self.assertEqual(row[layout], _decode(generated))
        ids = jnp.asarray([list(prompt) + generated])
        logits, _ = decode_forward(self.model, self.params, ids, share_kv=share_kv)
        greedy = np.argmax(np.asarray(logits[0, PROMPT - 1 : -1]), axis=-1)
        np.testing.assert_array_equal(greedy, generated, err_msg=f"{layout}: {prompt}")
      same = np.asarray(row["unshared_tokens"]) == np.asarray(row["shared_tokens"])
      expected = NEW if same.all() else int(np.argmin(same))
      self.assertEqual(row["agree_tokens"], expected)
    # The layouts differ on this model: the check above could not pass with them swapped.
    self.assertTrue(any(r["agree_tokens"] < NEW for r in self.rows), self.rows)

  def test_markdown_shows_both_layouts_escaped(self):
    rows = [{**self.rows[0], "prompt": "a`b\nc"}]
    text = samples.markdown({"benice": {"samples": rows}, "zero_shot": {}})
    self.assertIn("- **benice**, eval row 0: prompt `a'b\\nc`", text)
    self.assertIn(f"  - unshared: `{self.rows[0]['unshared']}`", text)
    self.assertIn(f"  - shared (exact): `{self.rows[0]['shared']}` (first ", text)
    self.assertEqual(samples.markdown({"zero_shot": {}}), "")

  def test_kda_models_get_none(self):
    cfg = dataclasses.replace(testing.TINY_MODEL, core_mixers=("kda",))
    self.assertFalse(samples.supported(LoopedLM(cfg)))
    self.assertTrue(samples.supported(self.model))


if __name__ == "__main__":
  absltest.main()
