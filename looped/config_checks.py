"""Validation helpers for ml_collections configs.

Every program validates its whole config before any compute starts, so a typo in the 40th field
fails in a second instead of after compilation. Each helper names the dotted field and the allowed
values in its message.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

_MISSING = object()


class ConfigError(ValueError):
  """A config field holds a value the program cannot run with, or a flag names no field.

  `str(error)` is the one line the command line prints. The parts are kept for callers that
  want them: `field` (dotted, e.g. 'config.train.num_steps' or '--workdir'), `value` (absent:
  `ConfigError.NO_VALUE`), `requirement` (what is allowed) and `suggestion` (the closest field
  name, for a misspelled one).
  """

  NO_VALUE = _MISSING

  def __init__(
    self,
    message: str,
    *,
    field: str | None = None,
    value: Any = _MISSING,
    requirement: str | None = None,
    suggestion: str | None = None,
  ):
    super().__init__(message)
    self.field = field
    self.value = value
    self.requirement = requirement
    self.suggestion = suggestion


def get(config: Any, path: str) -> Any:
  """Returns config.<path> (dotted), raising ConfigError if a field is missing."""
  node = config
  for part in path.split("."):
    try:
      node = node[part] if isinstance(node, dict) else getattr(node, part)
    except (AttributeError, KeyError):
      raise ConfigError(
        f"config.{path} is missing (no field {part!r}).", field=f"config.{path}"
      ) from None
  return node


def fail(path: str, value: Any, requirement: str) -> None:
  raise ConfigError(
    f"config.{path} = {value!r} is invalid: {requirement}.",
    field=f"config.{path}",
    value=value,
    requirement=requirement,
  )


def choice(config: Any, path: str, allowed: Iterable[Any]) -> Any:
  value = get(config, path)
  allowed = tuple(allowed)
  if value not in allowed:
    fail(path, value, "must be one of " + ", ".join(repr(a) for a in allowed))
  return value


def boolean(config: Any, path: str) -> bool:
  value = get(config, path)
  if not isinstance(value, bool):
    fail(path, value, "must be True or False")
  return value


def integer(
  config: Any, path: str, *, min_value: int | None = None, max_value: int | None = None
) -> int:
  value = get(config, path)
  if isinstance(value, bool) or not isinstance(value, int):
    fail(path, value, "must be an integer")
  _check_range(path, value, min_value, max_value)
  return value


def number(
  config: Any,
  path: str,
  *,
  min_value: float | None = None,
  max_value: float | None = None,
  min_exclusive: bool = False,
  max_exclusive: bool = False,
) -> float:
  value = get(config, path)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    fail(path, value, "must be a finite number")
  if min_exclusive and min_value is not None and value <= min_value:
    fail(path, value, f"must be > {min_value}")
  if max_exclusive and max_value is not None and value >= max_value:
    fail(path, value, f"must be < {max_value}")
  _check_range(
    path, value, None if min_exclusive else min_value, None if max_exclusive else max_value
  )
  return float(value)


def string(config: Any, path: str, *, allow_empty: bool = False) -> str:
  value = get(config, path)
  if not isinstance(value, str) or (not allow_empty and not value):
    fail(path, value, "must be a non-empty string")
  return value


def divides(config: Any, path: str, divisor: int, divisor_name: str) -> None:
  value = get(config, path)
  if divisor <= 0 or value % divisor:
    fail(path, value, f"must be a multiple of {divisor_name} = {divisor}")


def _check_range(path: str, value: float, lo: float | None, hi: float | None) -> None:
  if lo is not None and value < lo:
    fail(path, value, f"must be >= {lo}")
  if hi is not None and value > hi:
    fail(path, value, f"must be <= {hi}")
