"""The speculative-decoding reference (tests/speculative_reference.py) against Huginn's own
`generate_speculative` on the converted tiny Huginn: the same tokens and the same tokens
accepted per round for every recorded case (tests/testdata/huginn_tiny/speculative.json,
written by tests/make_speculative_references.py from the public modeling code: zero initial
state, float32, greedy, its default 'full' cache), and the tokens of plain greedy decoding at
the verifier's depth, Huginn's and the model's.

Unshared, every exit lookup reproduces Huginn's 'full' cache: a draft token runs fewer
recurrences, but only later drafts at the same depth read it, and the verifier rewrites its
entries at full depth before anyone reads a deeper recurrence, so no token ever reads a
recurrence an earlier token did not run (the only place the lookups differ).
"""

import dataclasses
import json
import os
import tempfile

import convert_golden_test as golden_lib
import speculative_reference as spec
from absl.testing import absltest

from looped.engine.engine import Engine, EngineConfig
from looped.engine.requests import DepthParams, GenRequest
from looped.engine.sampling import SamplingParams
from looped.engine.speculative import SpeculativeParams
from looped.model import adaptive
from looped.model.looped_lm import LoopedLM

_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
MAX_RECURRENCES = 8  # The golden cases' largest num_steps (the tiny model's R is 4).


def run_case(model, params, prompt, settings: dict, new_tokens: int, **kw):
  """The reference on one recorded case's generate_speculative arguments."""
  return spec.speculative(
    model,
    params,
    prompt,
    draft_recurrences=settings["draft_steps"],
    lookahead=settings["lookahead_for_draft"],
    recurrences=settings["num_steps"],
    new_tokens=new_tokens,
    **kw,
  )


class SpeculativeHuginnTest(absltest.TestCase):
  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    with tempfile.TemporaryDirectory() as tmp:
      cfg, cls.params, _ = golden_lib.convert("huginn_tiny", os.path.join(tmp, "w"))
    cls.model = LoopedLM(dataclasses.replace(cfg, num_recurrences=MAX_RECURRENCES))
    with open(os.path.join(_DATA, "huginn_tiny", "speculative.json")) as f:
      cls.golden = json.load(f)
    cls.new_tokens = cls.golden["meta"]["max_new_tokens"]

  def _check_cases(self, exit_lookup: str, cases: int | None = None):
    for name, case in list(self.golden["cases"].items())[:cases]:
      runs = zip(self.golden["prompts"], case["tokens"], case["accepted"])
      for i, (prompt, tokens, accepted) in enumerate(runs):
        with self.subTest(case=name, prompt=i, exit_lookup=exit_lookup):
          got = run_case(
            self.model,
            self.params,
            prompt,
            case["settings"],
            self.new_tokens,
            exit_lookup=exit_lookup,
          )
          self.assertEqual(got, (tokens, accepted))

  def test_goldens_vary(self):
    """The recorded rounds accept from one token up to every draft (both branches)."""
    cases = self.golden["cases"].values()
    full = [
      a == c["settings"]["lookahead_for_draft"] for c in cases for r in c["accepted"] for a in r
    ]
    counts = {a for c in cases for r in c["accepted"] for a in r}
    self.assertTrue(any(full) and not all(full))
    self.assertEqual(counts, {1, 2, 3})

  def test_reference_reproduces_huginn(self):
    self._check_cases("skip")  # What Huginn's 'full' cache does where a token has holes.

  def test_every_exit_lookup_reproduces_huginn(self):
    for lookup in adaptive.LOOKUPS:  # The first cases (their drafts differ at once).
      if lookup != "skip":
        self._check_cases(lookup, cases=2)

  def test_greedy_equals_huginn_greedy(self):
    """The model's plain greedy decoding gives Huginn's `generate` tokens at each depth."""
    for steps, runs in self.golden["greedy"].items():
      for prompt, tokens in zip(self.golden["prompts"], runs):
        got = spec.greedy(
          self.model, self.params, prompt, recurrences=int(steps), new_tokens=len(tokens)
        )
        self.assertEqual(got, tokens, steps)

  def test_speculation_equals_greedy(self):
    """Huginn's speculative tokens are its greedy ones at the verifier's depth (so the
    reference's are too, by the tests above): speculation changes the cost only."""
    for name, case in self.golden["cases"].items():
      greedy = self.golden["greedy"][str(case["settings"]["num_steps"])]
      for tokens, want in zip(case["tokens"], greedy):
        self.assertEqual(tokens, want[: len(tokens)], name)
        self.assertGreaterEqual(len(tokens), self.new_tokens)

  def test_shared_single_draft_equals_shared_greedy(self):
    """Shared, one draft per round verifies one token per call: exact shared decoding."""
    prompt = self.golden["prompts"][1]
    settings = dict(draft_steps=2, lookahead_for_draft=1, num_steps=4)
    got, accepted = run_case(self.model, self.params, prompt, settings, 12, share_kv=True)
    want = spec.greedy(self.model, self.params, prompt, recurrences=4, new_tokens=12, share_kv=True)
    self.assertEqual(got, want)
    self.assertEqual(accepted, [1] * 11)


class SpeculativeEngineHuginnTest(SpeculativeHuginnTest):
  """The engine's speculative rounds (looped/engine/speculative.py), every case's requests
  batched in one run and each alone: Huginn's tokens, and its tokens per round until the
  engine's last round, which drafts no further than the tokens left (Huginn's overshoots)."""

  def _engine(self) -> Engine:
    config = EngineConfig(
      share_kv=False,
      num_pages=128,
      page_size=4,
      max_num_seqs=16,
      max_num_batched_tokens=64,
      prefill_block=8,
      max_recurrences=MAX_RECURRENCES,
      check_invariants=True,
    )
    base = LoopedLM(dataclasses.replace(self.model.cfg, num_recurrences=4))
    return Engine(base, self.params, config)

  def _requests(self) -> list[tuple[GenRequest, list[int], list[int]]]:
    out = []
    for case in self.golden["cases"].values():
      settings = case["settings"]
      depth = DepthParams(recurrences=settings["num_steps"], init_scale=0.0)
      spec = SpeculativeParams(settings["draft_steps"], settings["lookahead_for_draft"])
      runs = zip(self.golden["prompts"], case["tokens"], case["accepted"])
      for prompt, tokens, accepted in runs:
        sp = SamplingParams(max_new_tokens=self.new_tokens)
        request = GenRequest(len(out), tuple(prompt), sp, depth=depth, speculative=spec)
        out.append((request, tokens[: self.new_tokens], accepted))
    return out

  def _check(self, generation, tokens, accepted):
    self.assertEqual(generation.tokens, tokens)
    rounds = generation.speculative_rounds
    self.assertEqual(rounds[:-1], accepted[: len(rounds) - 1])
    self.assertLessEqual(rounds[-1], accepted[len(rounds) - 1])
    # The prompt's call gives the first token; a last one left alone is decoded plainly.
    self.assertIn(self.new_tokens - 1 - sum(rounds), (0, 1))

  def test_engine_batched_equals_huginn(self):
    cases = self._requests()
    engine = self._engine()
    out = engine.generate([r for r, _, _ in cases])
    for g, (_, tokens, accepted) in zip(out, cases):
      with self.subTest(request=g.request_id):
        self._check(g, tokens, accepted)
    self.assertEqual(engine.pages_in_use(), 0)

  def test_engine_alone_equals_huginn(self):
    engine = self._engine()
    for request, tokens, accepted in self._requests()[::5]:
      with self.subTest(request=request.request_id):
        self._check(engine.generate([request])[0], tokens, accepted)

  # The reference's own tests run in SpeculativeHuginnTest once.
  test_goldens_vary = test_reference_reproduces_huginn = None
  test_every_exit_lookup_reproduces_huginn = test_greedy_equals_huginn_greedy = None
  test_speculation_equals_greedy = test_shared_single_draft_equals_shared_greedy = None


class AcceptTest(absltest.TestCase):
  def test_accept(self):
    self.assertEqual(spec.accept([5, 6, 7], [5, 6, 7]), [5, 6, 7])
    self.assertEqual(spec.accept([5, 6, 7], [5, 9, 7]), [5, 9])
    self.assertEqual(spec.accept([5, 6, 7], [8, 6, 7]), [8])
    self.assertEqual(spec.accept([5, 6, 7], [5, 6, 1]), [5, 6, 1])


if __name__ == "__main__":
  absltest.main()
