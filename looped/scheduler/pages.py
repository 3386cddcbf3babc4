"""A pool of fixed-size KV pages with reference counts and an LRU prefix cache.

Semantics follow vLLM's automatic prefix caching:
- a page holding a full page of computed tokens can be *registered* under a key (its hash-chain
  identity, see page_keys.py); the key -> page map is the prefix cache;
- a released page keeps its key and contents: it stays a cache hit until it is evicted, which
  happens only when a new page is needed and no keyless free page is left;
- keyed free pages are evicted least recently released first, and a request releases its pages
  tail first, so a prefix's head (more likely shared) outlives its tail;
- a hit on a page another request holds only adds a reference.

The pool is unbounded when num_pages is None: pages are created on demand and nothing is evicted.
Pages are small ints; all bookkeeping is Python lists and dicts, so bulk operations stay cheap.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
from collections.abc import Hashable, Iterable, Iterator, Sequence


def _consume(iterator: Iterator) -> None:
  """Runs a map() for its side effects at C speed (the bulk paths below)."""
  collections.deque(iterator, maxlen=0)


_IS_PAGE = functools.partial(operator.is_not, None)  # Page 0 is falsy, so test against None.


class OutOfPagesError(RuntimeError):
  """More pages were asked for than are free (callers check num_free first)."""


class _FreeCachedQueue:
  """Unreferenced cached pages, least recently released first.

  Pages join in runs (one release each) and leave from the front (eviction) or from anywhere (a
  prefix hit). A hit only clears the page's mark; its stale entry is skipped when the front
  reaches it. Every operation is a bulk, C-level one, where an OrderedDict costs a node per page.
  """

  def __init__(self):
    self._runs: collections.deque[tuple[int, list[int]]] = collections.deque()  # (id, pages).
    self._front = 0  # Entries of the first run already consumed.
    self._mark: list[int] = []  # Page -> id of the run it is queued in, or -1.
    self._next_id = 0
    self._len = 0  # Queued pages.
    self._entries = 0  # Entries in the runs, stale ones included.

  def __len__(self) -> int:
    return self._len

  def __iter__(self) -> Iterator[int]:
    mark = self._mark
    for i, (run_id, run) in enumerate(self._runs):
      for page in run[self._front :] if i == 0 else run:
        if mark[page] == run_id:
          yield page

  def add_pages(self, n: int) -> None:
    """Makes room for n more page ids."""
    self._mark.extend([-1] * n)

  def push(self, pages: list[int]) -> None:
    if pages:
      run_id = self._next_id
      self._next_id += 1
      self._runs.append((run_id, pages))
      _consume(map(self._mark.__setitem__, pages, itertools.repeat(run_id)))
      self._len += len(pages)
      self._entries += len(pages)

  def remove(self, pages: list[int]) -> None:
    """Takes queued pages out, wherever they are."""
    _consume(map(self._mark.__setitem__, pages, itertools.repeat(-1)))
    self._len -= len(pages)
    if self._entries > 2 * self._len + 4096:  # Mostly stale entries: rebuild the runs.
      mark, runs = self._mark, collections.deque()
      for i, (run_id, run) in enumerate(self._runs):
        live = [p for p in (run[self._front :] if i == 0 else run) if mark[p] == run_id]
        if live:
          runs.append((run_id, live))
      self._runs, self._front, self._entries = runs, 0, self._len

  def pop(self, n: int) -> list[int]:
    """Takes the n least recently queued pages (n <= len)."""
    mark, out = self._mark, []
    while len(out) < n:
      run_id, run = self._runs[0]
      chunk = run[self._front : self._front + n - len(out)]
      self._front += len(chunk)
      out.extend(itertools.compress(chunk, map(run_id.__eq__, map(mark.__getitem__, chunk))))
      if self._front == len(run):
        self._runs.popleft()
        self._entries -= len(run)
        self._front = 0
    _consume(map(mark.__setitem__, out, itertools.repeat(-1)))
    self._len -= n
    return out


class PagePool:
  """Page allocator plus the key -> page map of cached pages."""

  def __init__(self, num_pages: int | None, *, debug: bool = False):
    if num_pages is not None and num_pages < 1:
      raise ValueError(f"num_pages must be >= 1 or None (unbounded), got {num_pages}.")
    self.num_pages = num_pages
    self._capacity = math.inf if num_pages is None else num_pages
    self._debug = debug
    self._num_created = 0  # Pages 0..n-1 exist; higher ids are fresh (never used).
    self._ref: list[int] = []  # Page -> number of requests holding it.
    self._key: list[Hashable | None] = []  # Page -> registered key.
    self._free_plain: list[int] = []  # Released pages without a key: reused first.
    self._free_cached = _FreeCachedQueue()  # Released pages with a key, LRU first.
    self._cache: dict[Hashable, int] = {}  # Key -> page holding that content.
    self.num_in_use = 0
    self.peak_in_use = 0
    self.num_evictions = 0
    self._evicted_since_drain: list[int] = []

  @property
  def num_free(self) -> float:
    """Pages an allocation can take: fresh, keyless free and cached-but-unreferenced."""
    return self._capacity - self._num_created + len(self._free_plain) + len(self._free_cached)

  @property
  def num_cached(self) -> int:
    return len(self._cache)

  def cached_free_pages(self) -> list[int]:
    """Unreferenced cached pages in eviction order (next victim first)."""
    return list(self._free_cached)

  def key_of(self, page: int) -> Hashable | None:
    return self._key[page]

  def ref_count(self, page: int) -> int:
    return self._ref[page]

  def lookup(self, keys: Iterable[Hashable]) -> list[int]:
    """Pages of the longest run of leading keys that are cached. No side effects."""
    return list(itertools.takewhile(_IS_PAGE, map(self._cache.get, keys)))

  def num_unreferenced(self, pages: Sequence[int]) -> int:
    """How many of these cached pages are free (acquiring them shrinks num_free)."""
    return list(map(self._ref.__getitem__, pages)).count(0)

  def acquire(self, pages: Sequence[int]) -> None:
    """Adds a reference to each cached page (a prefix-cache hit)."""
    ref = self._ref
    refs = list(map(ref.__getitem__, pages))
    was_free = list(itertools.compress(pages, map(operator.not_, refs)))
    self._free_cached.remove(was_free)
    _consume(map(ref.__setitem__, pages, map(operator.add, refs, itertools.repeat(1))))
    self.num_in_use += len(was_free)
    self.peak_in_use = max(self.peak_in_use, self.num_in_use)

  def allocate(self, n: int) -> list[int]:
    """Returns n pages with one reference each: keyless free ones, fresh ones, then evictions."""
    if n <= 0:
      return []
    if n > self.num_free:
      raise OutOfPagesError(f"Asked for {n} pages, {self.num_free} free.")
    plain = self._free_plain
    take = min(n, len(plain))
    pages = plain[len(plain) - take :]
    del plain[len(plain) - take :]
    ref = self._ref
    missing = n - take
    fresh = min(missing, self._capacity - self._num_created)
    if fresh:
      start = self._num_created
      pages.extend(range(start, start + fresh))
      ref.extend([0] * fresh)
      self._key.extend([None] * fresh)
      self._free_cached.add_pages(fresh)
      self._num_created += fresh
      missing -= fresh
    if missing:
      pages.extend(self._evict(missing))
    if self._debug:  # No page may be handed out while someone holds it.
      assert len(set(pages)) == n, "allocate returned a page twice"
      assert not any(map(ref.__getitem__, pages)), "allocate returned a page in use"
    _consume(map(ref.__setitem__, pages, itertools.repeat(1)))
    self.num_in_use += n
    self.peak_in_use = max(self.peak_in_use, self.num_in_use)
    return pages

  def _evict(self, n: int) -> list[int]:
    """Takes the n least recently released cached pages out of the cache."""
    pages = self._free_cached.pop(n)
    key = self._key
    _consume(map(self._cache.__delitem__, map(key.__getitem__, pages)))
    _consume(map(key.__setitem__, pages, itertools.repeat(None)))
    self.num_evictions += n
    self._evicted_since_drain.extend(pages)
    return pages

  def drain_evictions(self) -> list[int]:
    """Pages evicted since the last call (lets a caller keep lookups valid cheaply)."""
    evicted, self._evicted_since_drain = self._evicted_since_drain, []
    return evicted

  def release(self, pages: Sequence[int]) -> None:
    """Drops one reference per page, tail first; unreferenced pages become free."""
    ref, key = self._ref, self._key
    tail_first = pages[::-1]
    if all(map((1).__eq__, map(ref.__getitem__, tail_first))):  # Held by no one else.
      _consume(map(ref.__setitem__, tail_first, itertools.repeat(0)))
      freed = tail_first
    else:
      freed = []
      for page in tail_first:
        ref[page] -= 1
        if not ref[page]:
          freed.append(page)
    keys = list(map(key.__getitem__, freed))
    keyless = list(map(operator.is_, keys, itertools.repeat(None)))
    self._free_plain.extend(itertools.compress(freed, keyless))
    self._free_cached.push(list(itertools.compress(freed, map(operator.not_, keyless))))
    self.num_in_use -= len(freed)
    if self._debug:
      assert min((ref[p] for p in pages), default=0) >= 0, "page released more than held"

  def allocatable_sparing(self, spared: set[int], limit: int) -> float:
    """Pages allocatable (counting up to `limit`) before a page in `spared` would be evicted."""
    if not spared:
      return self.num_free
    room = self._capacity - self._num_created + len(self._free_plain)
    for page in self._free_cached:
      if page in spared or room >= limit:
        break
      room += 1
    return room

  def register(self, pages: Sequence[int], keys: Sequence[Hashable]) -> None:
    """Caches each (keyless) page under its key, unless that key is already cached: then the
    page stays keyless (a duplicate of a cached page, reused first once free)."""
    cache, key_of = self._cache, self._key
    if self._debug:
      assert all(key_of[p] is None for p in pages), "registering a page that has a key"
    if cache.keys().isdisjoint(keys):
      cache.update(zip(keys, pages))
      _consume(map(key_of.__setitem__, pages, keys))
      return
    for page, key in zip(pages, keys):
      if key not in cache:
        cache[key] = page
        key_of[page] = key

  def check(self) -> None:
    """Verifies every page is in exactly one state and the cache map is consistent."""
    n = self._num_created
    plain, cached = set(self._free_plain), set(self._free_cached)
    assert len(plain) == len(self._free_plain), "a page is twice in the free list"
    assert not plain & cached, "a page is free twice"
    in_use = {p for p in range(n) if self._ref[p] > 0}
    assert all(self._ref[p] >= 0 for p in range(n)), "negative reference count"
    assert not in_use & (plain | cached), "a referenced page is on a free list"
    assert len(in_use) + len(plain) + len(cached) == n, "a page is lost"
    assert len(in_use) == self.num_in_use, "num_in_use is off"
    assert all(self._key[p] is None for p in plain), "a keyed page is on the keyless list"
    assert all(self._key[p] is not None for p in cached), "a keyless page is on the cached list"
    assert all(self._key[p] == k for k, p in self._cache.items()), "cache map disagrees"
    assert sum(k is not None for k in self._key) == len(self._cache), "orphan key"
