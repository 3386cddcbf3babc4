"""The engine's compiled steps: one executable per padded call shape, a bounded number alive.

Each XLA:CPU executable maps its own code pages. On the default model one compiled step shape
adds 285-485 memory mappings and ~20 MB (benchmarks/executable_maps.py, jax 0.10.2), and the
kernel refuses a process more than `vm.max_map_count` mappings (65,530 by default): past ~170
shapes the next allocation fails and LLVM aborts the whole process ("Unable to allocate section
memory"), wherever the compile happens (a server's warm-up thread, a test worker). So:

- at most MAX_LIVE_STEPS step executables live in a process, over all engines: a table that
  compiles a shape beyond the bound first frees the least recently used shape of any table
  (a later call of it compiles again);
- an engine whose buckets reach more shapes than the bound is refused before anything compiles
  (looped.engine.engine), so an engine never evicts its own shapes;
- a compile that would take the process within MAP_HEADROOM mappings of the limit (counted in
  /proc/self/maps) evicts first, and raises a clear error if nothing is left to evict.

Shapes are compiled ahead of time (`jax.jit(...).lower(...).compile()`, through the persistent
compilation cache when one is set) and called as executables, so a step runs only what was
compiled: `lookup` in strict mode never compiles, it returns the smallest compiled shape that
holds the call (the server serves from the largest shapes while the rest compile in the
background, looped.engine.engine.Engine.start_warmup).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable

import jax

# Live step executables per process (all engines). 128 x ~285 steady-state mappings per shape
# is ~37k of the 65,530 default limit, headroom for the rest of the process.
MAX_LIVE_STEPS = 128
# Mappings kept free below vm.max_map_count when a compile starts (one compile maps < 1k).
MAP_HEADROOM = 4096

Shape = tuple[int, int, int]  # (rows, tokens, page-table columns) of one padded call.


def _max_map_count() -> int | None:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return None


def _mappings() -> int | None:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:
    return None


class _Live:
  """The process's live step executables, least recently used first."""

  def __init__(self):
    self.lock = threading.RLock()
    self.order: collections.OrderedDict[tuple[int, Shape], StepTable] = collections.OrderedDict()

  def touch(self, table: StepTable, shape: Shape) -> None:
    with self.lock:
      self.order.move_to_end((id(table), shape))

  def add(self, table: StepTable, shape: Shape) -> None:
    with self.lock:
      self.order[(id(table), shape)] = table
      while len(self.order) > MAX_LIVE_STEPS:
        self._evict_one(keep=table)

  def make_room(self, table: StepTable) -> None:
    """Evicts until a compile leaves MAP_HEADROOM mappings free (or the table's own remain)."""
    limit = _max_map_count()
    with self.lock:
      while limit and (_mappings() or 0) > limit - MAP_HEADROOM:
        if not self._evict_one(keep=table):
          raise MemoryError(
            f"the process holds {_mappings()} memory mappings, within {MAP_HEADROOM} of "
            f"vm.max_map_count = {limit}, and no other engine's step can be freed; compiling "
            "another step shape could abort the process (use fewer buckets)."
          )

  def _evict_one(self, keep: StepTable) -> bool:
    for key, owner in self.order.items():
      if owner is not keep:
        del self.order[key]
        owner.evict(key[1])
        return True
    return False

  def count(self) -> int:
    return len(self.order)


LIVE = _Live()


class StepTable:
  """The compiled executables of one step function, one per call shape.

  `abstract(shape)` gives the arguments to lower a shape with (arrays or ShapeDtypeStructs);
  they are lowered inside `mesh.context()`.
  Several engines with the same model and layout share a table (`shared`), so a shape compiles
  once per process while it lives.
  """

  def __init__(self, fn: Callable, abstract: Callable[[Shape], tuple], mesh, donate=(1,)):
    self._fn = fn
    self._abstract = abstract
    self._mesh = mesh  # Lowered inside its context (the step's sharding constraints).
    self._donate = donate
    self._lock = threading.Lock()
    self._compiled: dict[Shape, tuple[Callable, object]] = {}  # shape -> (jitted, executable)
    self.num_compiles = 0  # Compilations (or cache loads) by this table, evicted ones included.

  def shapes(self) -> set[Shape]:
    with self._lock:
      return set(self._compiled)

  def compile(self, shape: Shape) -> object:
    """The shape's executable, compiled now if it is not alive (thread-safe)."""
    with self._lock:
      entry = self._compiled.get(shape)
    if entry is not None:
      LIVE.touch(self, shape)
      return entry[1]
    LIVE.make_room(self)
    jitted = jax.jit(self._fn, donate_argnums=self._donate)  # Its own cache: freed alone.
    with self._mesh.context():
      executable = jitted.lower(*self._abstract(shape)).compile()
    with self._lock:
      if shape in self._compiled:  # Another thread compiled it meanwhile.
        return self._compiled[shape][1]
      self._compiled[shape] = (jitted, executable)
      self.num_compiles += 1
    LIVE.add(self, shape)
    return executable

  def lookup(self, shape: Shape, strict: bool) -> tuple[Shape, object]:
    """(shape run, executable) for a call of `shape`: itself, compiled now unless strict;
    strict: the smallest compiled shape that holds it (as many or more rows and columns, and
    tokens, a one-token call only in a one-token shape), never compiling."""
    if not strict:
      return shape, self.compile(shape)
    with self._lock:
      if shape in self._compiled:
        fit = shape
      else:
        rows, tokens, columns = shape
        holds = [
          s
          for s in self._compiled
          if s[0] >= rows
          and s[2] >= columns
          and (s[1] == tokens == 1 or min(s[1], tokens) > 1)
          and s[1] >= tokens
        ]
        if not holds:
          raise RuntimeError(f"no compiled step shape holds the call {shape} (strict).")
        fit = min(holds, key=lambda s: (s[0] * s[1] * s[2], s))
      executable = self._compiled[fit][1]
    LIVE.touch(self, fit)
    return fit, executable

  def evict(self, shape: Shape) -> None:
    """Frees a shape's executable (its jitted function's cache holds the only reference)."""
    with self._lock:
      entry = self._compiled.pop(shape, None)
    if entry is not None:
      entry[0].clear_cache()

  def clear(self) -> None:
    for shape in list(self.shapes()):
      with LIVE.lock:
        LIVE.order.pop((id(self), shape), None)
      self.evict(shape)


_TABLES: dict[Hashable, StepTable] = {}
_TABLES_LOCK = threading.Lock()


def shared(key: Hashable, make: Callable[[], StepTable]) -> StepTable:
  """The process's table for `key` (a step function's static configuration), made once."""
  with _TABLES_LOCK:
    table = _TABLES.get(key)
    if table is None:
      table = _TABLES[key] = make()
    return table
