"""The TPU variants' fetch schedules: which block each grid step's BlockSpec makes Mosaic DMA.

Mosaic copies a block only when its index changes from the previous grid step, so the distinct
consecutive indices are the DMAs issued. Values are checked in interpret mode by
pallas_paged_decode_test / pallas_shared_attention_test; these check that skipped steps cost
no copy: a sequence fetches exactly its own pages, in order, and a query block exactly the past
blocks up to its diagonal (and a past block the query blocks from its diagonal on); in block
prefill, the past and own key blocks its masks reach.
"""

import itertools

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from pallas_kernels import paged_decode_tpu, shared_attention_tpu


def _dmas(indices):
  """The indices that differ from their predecessor: the copies a pipeline issues."""
  return [x for x, prev in zip(indices, [None, *indices[:-1]]) if x != prev]


class PagedFetchTest(absltest.TestCase):
  def test_each_sequence_fetches_its_pages_once(self):
    page_size, num_pages = 16, 12
    lengths = jnp.asarray([0, 1, 16, 37], jnp.int32)
    table = jnp.asarray([[5, 7, 9, 11], [3, 0, 0, 0], [8, 6, 4, 2], [10, 1, 2, 99]], jnp.int32)
    leaf = jnp.zeros((num_pages, page_size, 2, 32))
    index_map = paged_decode_tpu._page_spec(leaf, page_size, num_pages).index_map
    expected = {0: [5], 1: [3], 2: [8], 3: [10, 1, 2]}  # Length 0 still reads one (unused) page.
    for b, pages in expected.items():
      steps = [int(index_map(b, i, lengths, table)[0]) for i in range(table.shape[1])]
      self.assertEqual(_dmas(steps), pages, f"sequence {b}: {steps}")

  def test_page_ids_outside_the_pool_are_clipped(self):
    index_map = paged_decode_tpu._page_spec(jnp.zeros((4, 8, 1, 32)), 8, 4).index_map
    table = jnp.asarray([[-1, 7]], jnp.int32)
    self.assertEqual(int(index_map(0, 0, jnp.asarray([0]), table)[0]), 0)
    self.assertEqual(int(index_map(0, 1, jnp.asarray([16]), table)[0]), 3)


class FlashFetchTest(absltest.TestCase):
  def _check(self, block_q, block_k, t=64):
    nq, nk = t // block_q, t // block_k
    specs = shared_attention_tpu._past_specs([jnp.zeros((1, 1, t, 8))], None, 1, block_q, block_k)
    for i in range(nq):
      steps = [specs[0].index_map(0, 0, i, j)[2] for j in range(nk)]
      needed = [j for j in range(nk) if j * block_k < i * block_q + block_q - 1]
      self.assertEqual(_dmas([int(s) for s in steps]), needed or [0], f"query block {i}")
    for j in range(nk):
      steps = [
        int(shared_attention_tpu._dkv_query_block(j, i, block_q, block_k, nq)) for i in range(nq)
      ]
      needed = [i for i in range(nq) if j * block_k < i * block_q + block_q - 1]
      self.assertEqual(_dmas(steps), needed, f"past block {j}")

  def test_schedules(self):
    for block_q, block_k in itertools.product((8, 16), (8, 16)):
      self._check(block_q, block_k)


class BlockPrefillFetchTest(absltest.TestCase):
  """Block prefill (C > 1): past blocks up to the last row's block start, own key blocks inside
  the query block's blocks; each fetched once, and a grid step runs a part (pl.when) exactly
  when its masks hold some pair."""

  def _check(self, block_q, block_k, c, t=64):
    nq, nk = t // block_q, t // block_k
    pos = np.arange(t)
    start = pos // c * c
    past_pairs = pos[None, :] < start[:, None]  # [t, s]
    own_pairs = (pos[None, :] >= start[:, None]) & (pos[None, :] < pos[:, None])

    def tiles(pairs):  # [i, j]: query block i and key block j share a true pair.
      return pairs.reshape(nq, block_q, nk, block_k).any(axis=(1, 3))

    past_needed, own_needed = tiles(past_pairs), tiles(own_pairs)
    leaf = [jnp.zeros((1, 1, t, 8))]
    past_spec = shared_attention_tpu._past_specs(leaf, None, 1, block_q, block_k, c)[0]
    own_spec = shared_attention_tpu._own_specs(8, 1, block_q, block_k, c)[0]
    for i in range(nq):
      q_start = i * block_q
      for j in range(nk):
        past_on = bool(shared_attention_tpu._needed(q_start, j * block_k, block_q, c))
        own_on = bool(shared_attention_tpu._own_needed(i, j, block_q, block_k, c))
        self.assertEqual((past_on, own_on), (past_needed[i, j], own_needed[i, j]), (i, j))
      past_steps = [int(past_spec.index_map(0, 0, i, j)[2]) for j in range(nk)]
      own_steps = [int(own_spec.index_map(0, 0, i, j)[2]) for j in range(nk)]
      want_past = [int(j) for j in np.flatnonzero(past_needed[i])]
      want_own = [int(j) for j in np.flatnonzero(own_needed[i])]
      self.assertEqual(_dmas(past_steps), want_past or [0], f"query block {i}: past")
      self.assertEqual(_dmas(own_steps), want_own or own_steps[:1], f"query block {i}: own")
    for j in range(nk):
      steps = [
        int(shared_attention_tpu._dkv_query_block(j, i, block_q, block_k, nq)) for i in range(nq)
      ]
      readers = np.flatnonzero(past_needed[:, j] | own_needed[:, j])
      want = [int(i) for i in readers] or steps[:1]
      self.assertEqual(_dmas(steps), want, f"key block {j}")

  def test_schedules(self):
    for block_q, block_k in itertools.product((8, 16), (8, 16)):
      for c in (2, 3, 8, 12, 64):
        with self.subTest(block_q=block_q, block_k=block_k, c=c):
          self._check(block_q, block_k, c)


if __name__ == "__main__":
  absltest.main()
