"""Multi-turn session traces: a hand-built example, the prefix property on random lengths, the
seed, one-line errors naming the field, the 1,024-position variant through the program."""

import dataclasses
import os
import tempfile

import numpy as np
from absl.testing import absltest

from configs import serve_sim
from looped import config_checks
from looped.sim import sessions, simulate, traces
from looped.sim.config import SessionsConfig


def _tempdir(test) -> str:
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


# Every length fixed: shared system 8, context 5, input 3, output 2, think 1.5 s, blocks of 4.
_FIXED = SessionsConfig(
  num_sessions=2, min_turns=3, max_turns=3, shared_system_tokens=8,
  min_context_tokens=5, max_context_tokens=5, min_input_tokens=3, max_input_tokens=3,
  min_output_tokens=2, max_output_tokens=2, min_think_s=1.5, max_think_s=1.5, block_size=4,
)  # fmt: skip


def _by_session(requests):
  """Requests grouped by their first block after the shared system prompt (block 2), in order."""
  groups = {}
  for r in requests:
    groups.setdefault(r.block_hashes[2], []).append(r)
  return list(groups.values())


class HandExampleTest(absltest.TestCase):
  def test_two_sessions_of_three_turns(self):
    requests = sessions.generate(_FIXED)
    self.assertLen(requests, 6)
    self.assertEqual([r.request_id for r in requests], list(range(6)))
    arrivals = [r.arrival_s for r in requests]
    self.assertEqual(arrivals, sorted(arrivals))
    first, second = _by_session(requests)
    # Prompts: 8 + 5 + 3 = 16; then + 2 (output) + 3 (input) = 21; then 26.
    for session in (first, second):
      self.assertEqual([r.prompt_len for r in session], [16, 21, 26])
      self.assertEqual([r.output_len for r in session], [2, 2, 2])
      self.assertEqual([r.block_size for r in session], [4, 4, 4])
      gaps = [b.arrival_s - a.arrival_s for a, b in zip(session, session[1:])]
      np.testing.assert_allclose(gaps, [1.5, 1.5], rtol=1e-12)
    # Ids in order of first use. The first session: system blocks 0, 1; its blocks 2, 3 (tokens
    # 8-15); turn 2 adds block 4 (16-19) and a 1-token block 5 (20); turn 3's block 5 is 4
    # tokens (20-23), a new id, and block 6 (24-25). The second shares the system blocks only.
    self.assertEqual(
      [r.block_hashes for r in first], [(0, 1, 2, 3), (0, 1, 2, 3, 4, 5), (0, 1, 2, 3, 4, 6, 7)]
    )
    self.assertEqual(
      [r.block_hashes for r in second],
      [(0, 1, 8, 9), (0, 1, 8, 9, 10, 11), (0, 1, 8, 9, 10, 12, 13)],
    )

  def test_no_shared_system_prompt(self):
    requests = sessions.generate(dataclasses.replace(_FIXED, shared_system_tokens=0))
    firsts = [r for r in requests if r.prompt_len == 8]  # 5 + 3 tokens: two 4-token blocks.
    self.assertLen(firsts, 2)
    self.assertNotEqual(firsts[0].block_hashes[0], firsts[1].block_hashes[0])


class RandomLengthsTest(absltest.TestCase):
  cfg = SessionsConfig(
    num_sessions=30, min_turns=1, max_turns=6, shared_system_tokens=40, max_context_tokens=90,
    min_input_tokens=5, max_input_tokens=70, min_output_tokens=3, max_output_tokens=50,
    min_think_s=2.0, max_think_s=9.0, block_size=16, max_prompt_tokens=500, seed=3,
  )  # fmt: skip

  def test_later_turns_resend_the_history(self):
    requests = sessions.generate(self.cfg)
    arrivals = [r.arrival_s for r in requests]
    self.assertEqual(arrivals, sorted(arrivals))
    groups = {}  # A session's turns: each turn's prompt extends the previous turn's.
    for r in requests:
      owner = next((g for g in groups.values() if _extends(g[-1], r, 16)), None)
      if owner is None:
        groups[r.request_id] = [r]
      else:
        owner.append(r)
    self.assertLen(groups, 30)  # One per session: the first turns fit 40 + 90 + 70 + 50 = 250.
    for turns in groups.values():
      self.assertBetween(turns[0].prompt_len - 40, 5, 90 + 70)  # Context + input.
      for a, b in zip(turns, turns[1:]):
        self.assertBetween(b.prompt_len - a.prompt_len - a.output_len, 5, 70)  # The input.
        self.assertBetween(b.arrival_s - a.arrival_s, 2.0, 9.0)
      self.assertLessEqual(turns[-1].prompt_len + turns[-1].output_len, 500)
    self.assertGreater(max(len(t) for t in groups.values()), 3)

  def test_same_seed_same_file_and_read_back_with_its_blocks(self):
    tmp = _tempdir(self)
    paths = [os.path.join(tmp, f"{name}.jsonl") for name in ("a", "b", "c")]
    for path, seed in zip(paths, (3, 3, 4)):
      traces.write_mooncake(sessions.generate(dataclasses.replace(self.cfg, seed=seed)), path)
    read = lambda p: open(p, "rb").read()
    self.assertEqual(read(paths[0]), read(paths[1]))
    self.assertNotEqual(read(paths[0]), read(paths[2]))
    loaded = traces.load_mooncake(paths[0], block_size=16)  # Checks the chain of every id.
    self.assertEqual(
      [(r.prompt_len, r.output_len, r.block_hashes) for r in loaded],
      [(r.prompt_len, r.output_len, r.block_hashes) for r in sessions.generate(self.cfg)],
    )
    with self.assertRaisesRegex(traces.TraceError, "ceil\\(input_length / 512\\)"):
      traces.load_mooncake(paths[0])  # Read as Mooncake's 512-token blocks: refused.


def _extends(a, b, block: int) -> bool:
  """b is a later turn of a's session: its prompt holds a's prompt and output, and its ids
  start with a's full blocks."""
  full = a.prompt_len // block
  longer = b.prompt_len > a.prompt_len + a.output_len
  return longer and b.block_hashes[:full] == a.block_hashes[:full] and b.arrival_s > a.arrival_s


class BadParametersTest(absltest.TestCase):
  def test_one_line_naming_the_field(self):
    cases = [
      (dict(min_turns=4, max_turns=2), "config.sessions.max_turns = 2 .* >= sessions.min_turns"),
      (dict(min_think_s=9.0, max_think_s=1.0), "config.sessions.max_think_s"),
      (dict(session_rate_per_s=0.0), "config.sessions.session_rate_per_s = 0.0 .* > 0"),
      (dict(block_size=0), "config.sessions.block_size = 0 .* >= 1"),
      (
        dict(max_prompt_tokens=17),
        "config.sessions.max_prompt_tokens = 17 .* first turn.* 18 tokens",
      ),
      (dict(num_sessions=1.5), "config.sessions.num_sessions"),
    ]
    for fields, message in cases:
      with self.subTest(fields=fields):
        with self.assertRaisesRegex(config_checks.ConfigError, message) as e:
          sessions.generate(dataclasses.replace(_FIXED, **fields))
        self.assertNotIn("\n", str(e.exception))

  def test_the_program_validates_the_section(self):
    config = serve_sim.get_config("smoke,sessions_1k")
    config.sessions.max_output_tokens = 8  # Below min_output_tokens 16.
    with self.assertRaisesRegex(config_checks.ConfigError, "config.sessions.max_output_tokens"):
      simulate.validate(config)


class ScaledVariantTest(absltest.TestCase):
  def test_sessions_1k_fits_the_model_and_replays(self):
    config = serve_sim.get_config("smoke,sessions_1k")
    config.sessions.num_sessions = 12
    config.sim.kv_budget_bytes = (2e5, None)
    config.sim.share_kv = (True,)
    workdir = _tempdir(self)
    results = simulate.run(config, workdir)
    requests = sessions.generate(SessionsConfig(**config.sessions))
    self.assertEqual(results["trace"]["num_requests"], len(requests))
    self.assertTrue(all(r.prompt_len + r.output_len <= 1024 for r in requests))
    self.assertGreater(max(r.prompt_len for r in requests), 700)  # Histories near the limit.
    written = traces.load_mooncake(os.path.join(workdir, "sim", "trace.jsonl"), block_size=16)
    self.assertEqual([r.block_hashes for r in written], [r.block_hashes for r in requests])
    self.assertGreater(results["runs"][-1]["hit_rate"], 0.5)  # The resent histories hit.


if __name__ == "__main__":
  absltest.main()
