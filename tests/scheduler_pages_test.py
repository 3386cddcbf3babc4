"""PagePool: reference counts, keyless-first reuse, LRU eviction order, prefix lookups."""

from absl.testing import absltest

from looped.scheduler import pages


class PagePoolTest(absltest.TestCase):
  def test_allocate_fresh_then_release_makes_pages_free(self):
    pool = pages.PagePool(4, debug=True)
    got = pool.allocate(3)
    self.assertEqual(got, [0, 1, 2])
    self.assertEqual((pool.num_in_use, pool.num_free), (3, 1))
    pool.release(got)
    self.assertEqual((pool.num_in_use, pool.num_free, pool.peak_in_use), (0, 4, 3))
    pool.check()

  def test_out_of_pages(self):
    pool = pages.PagePool(2)
    pool.allocate(2)
    with self.assertRaises(pages.OutOfPagesError):
      pool.allocate(1)

  def test_released_keyed_pages_stay_cached_and_are_evicted_tail_first(self):
    pool = pages.PagePool(4, debug=True)
    a = pool.allocate(3)
    pool.register(a, ["a0", "a1", "a2"])
    pool.release(a)  # Tail first: a2 is the least recently released.
    self.assertEqual(pool.cached_free_pages(), [a[2], a[1], a[0]])
    self.assertEqual(pool.lookup(["a0", "a1", "a2"]), a)
    # One fresh page remains: taken before any eviction.
    b = pool.allocate(1)
    self.assertEqual(b, [3])
    self.assertEqual(pool.num_evictions, 0)
    c = pool.allocate(1)  # Now the LRU cached page, a2, is evicted.
    self.assertEqual(c, [a[2]])
    self.assertEqual(pool.lookup(["a0", "a1", "a2"]), [a[0], a[1]])
    self.assertIsNone(pool.key_of(a[2]))
    self.assertEqual(pool.drain_evictions(), [a[2]])
    self.assertEqual(pool.drain_evictions(), [])
    pool.check()

  def test_keyless_free_pages_are_reused_before_evicting(self):
    pool = pages.PagePool(3, debug=True)
    a = pool.allocate(3)
    pool.register(a[:2], ["k0", "k1"])  # a[2] is a partial page: no key.
    pool.release(a)
    self.assertEqual(pool.allocate(1), [a[2]])
    self.assertEqual(pool.num_evictions, 0)
    self.assertEqual(pool.num_cached, 2)

  def test_acquire_hit_adds_reference_and_leaves_free_list(self):
    pool = pages.PagePool(4, debug=True)
    a = pool.allocate(2)
    pool.register(a, ["x", "y"])
    hits = pool.lookup(["x", "y", "z"])
    self.assertEqual(hits, a)
    pool.acquire(hits)  # Held by two requests now.
    self.assertEqual([pool.ref_count(p) for p in a], [2, 2])
    self.assertEqual(pool.num_in_use, 2)
    pool.release(a)
    self.assertEqual(pool.num_unreferenced(a), 0)
    pool.release(a)
    self.assertEqual(pool.num_unreferenced(a), 2)
    pool.acquire(pool.lookup(["x"]))  # A hit on a free cached page takes it off the free list.
    self.assertEqual(pool.cached_free_pages(), [a[1]])
    self.assertEqual(pool.num_free, 3)
    pool.check()

  def test_duplicate_key_is_not_registered_twice(self):
    pool = pages.PagePool(4, debug=True)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a, ["same"])
    pool.register(b, ["same"])
    self.assertEqual(pool.lookup(["same"]), a)
    self.assertIsNone(pool.key_of(b[0]))
    pool.release(a + b)
    pool.check()

  def test_allocatable_sparing_stops_before_a_spared_page(self):
    pool = pages.PagePool(5)
    a = pool.allocate(4)
    pool.register(a, ["0", "1", "2", "3"])
    pool.release(a)  # LRU order: a3, a2, a1, a0; one fresh page.
    self.assertEqual(pool.allocatable_sparing({a[1]}, limit=10), 3)  # fresh, a3, a2.
    self.assertEqual(pool.allocatable_sparing({a[1]}, limit=2), 2)
    self.assertEqual(pool.allocatable_sparing(set(), limit=2), 5)

  def test_unbounded_pool_never_evicts(self):
    pool = pages.PagePool(None, debug=True)
    for i in range(50):
      got = pool.allocate(7)
      pool.register(got, [(i, j) for j in range(7)])
      pool.release(got)
    self.assertEqual((pool.num_evictions, pool.num_cached, pool.num_in_use), (0, 350, 0))
    pool.check()


if __name__ == "__main__":
  absltest.main()
