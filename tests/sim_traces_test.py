"""Mooncake traces: validation with line numbers, time scale, synthetic sessions, page keys."""

import json
import os
import tempfile

from absl.testing import absltest

from looped.scheduler import page_keys
from looped.sim import traces


def _line(ts=0, n=600, out=5, hashes=(0, 1)):
  return json.dumps(
    {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(hashes)}
  )


def _tempdir(test: absltest.TestCase) -> str:
  tmp = tempfile.TemporaryDirectory()
  test.addCleanup(tmp.cleanup)
  return tmp.name


class LoadMooncakeTest(absltest.TestCase):
  def _write(self, lines):
    path = os.path.join(_tempdir(self), "trace.jsonl")
    with open(path, "w") as f:
      f.write("\n".join(lines) + "\n")
    return path

  def test_loads_and_scales_time(self):
    path = self._write([_line(0), _line(1500, n=1030, hashes=(0, 1, 2)), ""])
    reqs = traces.load_mooncake(path, time_scale=0.5)
    self.assertLen(reqs, 2)
    self.assertEqual([r.arrival_s for r in reqs], [0.0, 0.75])
    self.assertEqual((reqs[1].prompt_len, reqs[1].output_len), (1030, 5))
    self.assertEqual(reqs[1].block_hashes, (0, 1, 2))
    self.assertLen(traces.load_mooncake(path, max_requests=1), 1)

  def test_malformed_lines_fail_with_their_line_number(self):
    cases = {
      "not valid JSON": "{oops",
      "missing field": json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}),
      "input_length = 0": _line(n=0, hashes=()),
      "output_length = -1": _line(out=-1),
      "len\\(hash_ids\\) = 1": _line(hashes=(0,)),
      "list of integers": _line(hashes=(0, "a")),
      "timestamp = -1": _line(ts=-1),
      "non-decreasing": _line(ts=0),
      "chained by prefix": _line(ts=20, hashes=(7, 1)),
    }
    for message, bad in cases.items():
      with self.subTest(message):
        path = self._write([_line(ts=10), bad])
        with self.assertRaisesRegex(traces.TraceError, f"trace.jsonl:2: .*{message}"):
          traces.load_mooncake(path)

  def test_non_utf8_line_fails_with_its_line_number(self):
    path = self._write([_line(ts=10), _line(ts=20)])
    with open(path, "ab") as f:
      f.write(b'{"timestamp": 30, "input_length": 5\xff}\n')
    with self.assertRaisesRegex(traces.TraceError, "trace.jsonl:3: not UTF-8"):
      traces.load_mooncake(path)

  def test_bundled_mooncake_trace_by_alias(self):
    reqs = traces.load_mooncake("mooncake_conversation")
    self.assertLen(reqs, 12031)  # The README of traces_data: 12,031 requests.
    self.assertTrue(os.path.isfile(traces.resolve("mooncake_conversation")))
    self.assertEqual(traces.resolve("/some/file.jsonl"), "/some/file.jsonl")

  def test_empty_trace_fails(self):
    with self.assertRaisesRegex(traces.TraceError, "no requests"):
      traces.load_mooncake(self._write([""]))

  def test_write_then_load_round_trips(self):
    reqs = traces.synthetic(traces.SyntheticSpec(num_requests=50, seed=3))
    path = os.path.join(_tempdir(self), "syn.jsonl")
    traces.write_mooncake(reqs, path)
    loaded = traces.load_mooncake(path)  # Also checks the chain property.
    self.assertEqual(
      [(r.prompt_len, r.output_len, r.block_hashes) for r in loaded],
      [(r.prompt_len, r.output_len, r.block_hashes) for r in reqs],
    )
    for a, b in zip(loaded, reqs):
      self.assertAlmostEqual(a.arrival_s, b.arrival_s, places=5)


class SyntheticTest(absltest.TestCase):
  def test_sessions_share_the_system_prompt_and_extend_their_history(self):
    spec = traces.SyntheticSpec(
      num_requests=200, num_sessions=4, system_prompt_tokens=1024, max_prompt_tokens=1 << 20
    )
    reqs = traces.synthetic(spec)
    self.assertEqual(reqs, sorted(reqs, key=lambda r: r.arrival_s))
    self.assertLen({r.block_hashes[:2] for r in reqs}, 1)  # 2 blocks of system prompt.
    # Each request's prompt extends the previous prompt of its conversation: some request has
    # an earlier one whose blocks (but maybe its partial last) are its own prefix.
    extended = 0
    for i, r in enumerate(reqs):
      for prev in reqs[:i]:
        full = prev.prompt_len // traces.MOONCAKE_BLOCK_SIZE
        if full > 2 and r.block_hashes[:full] == prev.block_hashes[:full]:
          extended += 1
          break
    self.assertGreater(extended, 100)

  def test_deterministic_given_seed(self):
    a = traces.synthetic(traces.SyntheticSpec(num_requests=30, seed=1))
    b = traces.synthetic(traces.SyntheticSpec(num_requests=30, seed=1))
    self.assertEqual(
      [(r.arrival_s, r.block_hashes) for r in a], [(r.arrival_s, r.block_hashes) for r in b]
    )


class IdealHitRateTest(absltest.TestCase):
  def test_lru_of_whole_blocks(self):
    r = lambda i, n, hashes: traces.Request(i, float(i), n, 1, tuple(hashes), block_size=4)
    reqs = [r(0, 8, [1, 2]), r(1, 8, [3, 4]), r(2, 10, [1, 2, 5])]
    self.assertEqual(traces.ideal_hit_rate(reqs), 8 / 26)  # C reuses A's 2 blocks.
    self.assertEqual(traces.ideal_hit_rate(reqs, capacity_tokens=16), 8 / 26)
    self.assertEqual(traces.ideal_hit_rate(reqs, capacity_tokens=8), 0.0)  # B evicted A.
    last_token = [r(0, 8, [1, 2]), r(1, 8, [1, 2])]
    self.assertEqual(traces.ideal_hit_rate(last_token), 4 / 16)


class PageKeysTest(absltest.TestCase):
  def test_keys_for_pages_aligned_nested_and_straddling(self):
    hashes = (10, 11, 12)  # 3 blocks of 512: tokens 0..1299.
    self.assertLen(page_keys.prompt_page_keys(hashes, 512, 1300, 512), 2)
    keys16 = page_keys.prompt_page_keys(hashes, 512, 1300, 16)
    self.assertLen(keys16, 81)
    self.assertEqual(keys16[31], (10 << 32) | 31)  # Last page of block 0.
    self.assertEqual(keys16[32], (11 << 32) | 32)
    self.assertEqual(keys16[80], (12 << 32) | 80)  # Tokens 1280..1295 lie in the partial block.
    keys48 = page_keys.prompt_page_keys(hashes, 512, 1300, 48)  # Page 10: tokens 480..527.
    self.assertEqual(keys48[9], (10 << 32) | 9)
    self.assertEqual(keys48[10], (11 << 32) | 10)  # Straddles: identified by its last block.

  def test_two_requests_share_a_page_iff_they_share_every_block_up_to_its_end(self):
    a = page_keys.prompt_page_keys((1, 2, 3), 512, 1536, 48)
    b = page_keys.prompt_page_keys((1, 2, 4), 512, 1536, 48)
    shared = [i for i, (x, y) in enumerate(zip(a, b)) if x == y]
    # Block 2 starts at token 1024 = page 21 (1008..1055) straddles blocks 1 and 2.
    self.assertEqual(shared, list(range(21)))

  def test_private_keys_are_unique_and_never_prompt_keys(self):
    keys = {page_keys.private_page_key(r, k) for r in range(5) for k in range(100)}
    self.assertLen(keys, 500)
    self.assertTrue(all(k < 0 for k in keys))


if __name__ == "__main__":
  absltest.main()
