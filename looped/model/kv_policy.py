"""KV-sharing policies (docs/design.md §3): which cached recurrence each recurrence reads.

Under sharing, recurrence r of token t reads, for earlier tokens s < t, the K/V that recurrence
c(r) wrote for them; a policy is the map r -> c(r), r = 1..R (1-based). The cache keeps one copy
per core layer for each distinct c(r) (the policy's `cached` recurrences), so its bytes per
token are len(cached) core copies instead of R. Every form below is parsed here once and read by
the model's parallel forward (Jacobi passes), its decode path (exact decode, block prefill), the
cache layout (looped/model/cache_layout.py) and the evaluation:

  final            c(r) = R                 BeNice!: every recurrence reads the final one.
  first            c(r) = 1                 Mixture-of-Recursions: recurrence 1's cache.
  full             c(r) = r                 no sharing (Huginn's default 'full'): R copies.
  keep_first<k>    c(r) = min(r, k)         recurrences 1..k keep their own; later ones read k.
  keep_last<k>     c(r) = max(r, R - k + 1) recurrences R-k+1..R keep their own; earlier ones
                                            read R - k + 1, the nearest kept one above them.
  stride<s>        c(r) = min(s ceil(r / s), R)  groups of s consecutive recurrences; each reads
                                            its group's last (the last group may be shorter).
  boundaries:b1-..-bm  c(r) = min{b_i >= r}  groups ending at the listed recurrences (strictly
                                            increasing, bm = R); final, stride and keep_last are
                                            special cases.
  huginn_mod<m>    c(r) = max{r' <= R : r' = r mod m}  Huginn's 'compress-s(4m)' cache
                                            (4 core layers): recurrence r writes slot r mod m,
                                            so earlier tokens hold that slot's last writer.
  huginn_anchor<k> c(r) = r for r <= k, else R  Huginn's 'compress-anchor' (k = 8 there): the
                                            first k keep their own, the rest share one slot.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from looped.config_checks import ConfigError

__all__ = ["FINAL", "FORMS", "KVPolicy", "check", "parse"]

FINAL = "final"
FORMS = (
  "final",
  "first",
  "full",
  "keep_first<k>",
  "keep_last<k>",
  "stride<s>",
  "boundaries:b1-..-bm",
  "huginn_mod<m>",
  "huginn_anchor<k>",
)


@dataclasses.dataclass(frozen=True)
class KVPolicy:
  """A parsed policy for R recurrences: `reads[r - 1]` = c(r)."""

  name: str
  reads: tuple[int, ...]

  @property
  def cached(self) -> tuple[int, ...]:
    """The recurrences the cache keeps (ascending): one copy per core layer each."""
    return tuple(sorted(set(self.reads)))

  @property
  def copies(self) -> int:
    return len(self.cached)

  @property
  def slots(self) -> tuple[int, ...]:
    """For each recurrence r, the index in `cached` of the copy it reads."""
    return tuple(self.cached.index(c) for c in self.reads)

  @property
  def writes(self) -> tuple[tuple[bool, ...], ...]:
    """[R][copies]: recurrence r may write copy i (r <= cached[i]); the copy ends holding the
    last active recurrence up to its own, as 'final' holds the last active one."""
    return tuple(tuple(r <= c for c in self.cached) for r in range(1, len(self.reads) + 1))


def _reads(name: str, big_r: int) -> tuple[int, ...] | str:
  """c(1..R), or the reason `name` is not a policy for R recurrences."""
  rs = range(1, big_r + 1)
  fixed = {"final": [big_r] * big_r, "first": [1] * big_r, "full": list(rs)}
  if name in fixed:
    return tuple(fixed[name])
  if name.startswith("boundaries:"):
    try:
      ends = [int(x) for x in name[len("boundaries:") :].split("-")]
    except ValueError:
      return "boundaries need integers joined by '-', e.g. 'boundaries:2-5-8'"
    if any(b <= a for a, b in zip(ends, ends[1:])) or ends[0] < 1 or ends[-1] != big_r:
      return f"boundaries must increase strictly from >= 1 and end at R = {big_r}"
    return tuple(min(b for b in ends if b >= r) for r in rs)
  match = re.fullmatch(r"(keep_first|keep_last|stride|huginn_mod|huginn_anchor)(\d+)", name)
  if not match:
    return "must be one of " + ", ".join(FORMS)
  form, n = match.group(1), int(match.group(2))
  if not 1 <= n <= big_r:
    return f"{form}'s number must be in [1, R = {big_r}]"
  if form == "keep_first":
    return tuple(min(r, n) for r in rs)
  if form == "keep_last":
    return tuple(max(r, big_r - n + 1) for r in rs)
  if form == "stride":
    return tuple(min(n * -(-r // n), big_r) for r in rs)
  if form == "huginn_mod":
    return tuple(max(q for q in rs if q % n == r % n) for r in rs)
  return tuple(r if r <= n else big_r for r in rs)  # huginn_anchor


@functools.lru_cache(maxsize=256)
def parse(name: str, num_recurrences: int, field: str = "kv_policy") -> KVPolicy:
  """The policy `name` for R = num_recurrences; ConfigError naming `field` if it is none."""
  reads = _reads(name, num_recurrences) if isinstance(name, str) else "must be a string"
  if isinstance(reads, str):
    raise ConfigError(
      f"{field} = {name!r} is invalid: {reads}.", field=field, value=name, requirement=reads
    )
  return KVPolicy(name, reads)


def check(name: str, num_recurrences: int, field: str) -> None:
  """Raises ConfigError naming `field` unless `name` is a policy for R recurrences."""
  parse(name, num_recurrences, field)
