"""Config sections declared once: each field's type, default, one-line doc and valid range.

A section (config.model, config.train, ...) is a frozen dataclass whose fields are made by
`field(default, doc, ...)`. Everything else about the section derives from it, so that a field
exists in one place: `defaults` is the ConfigDict a config file starts from, `validate` checks
every field's type and range with the config_checks helpers (the same one-line ConfigError
messages) and refuses unknown fields, and `describe` is the doc and valid values that
`--config=... --help` prints beside each field.
Rules that relate several fields stay short hand-written functions beside the section.

Types come from the annotations: bool, int, float, str, `float | None` (None allowed) and
`tuple[str, ...]` (with `items`: each element one of them). A field whose value takes more than
a range to check says so with `by_hand` (its rule, as help shows it); the section's validator
checks it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable
from typing import Any

import ml_collections

from looped import config_checks as cc


@dataclasses.dataclass(frozen=True)
class Rule:
  """What a field's value may be (see `field`)."""

  doc: str
  min: float | None = None
  max: float | None = None
  gt: float | None = None
  lt: float | None = None
  choices: tuple | None = None
  items: tuple | None = None
  noun: str = "values"
  nonempty: bool = False
  by_hand: str = ""


def field(
  default: Any,
  doc: str,
  *,
  min: float | None = None,  # noqa: A002  The words a reader expects.
  max: float | None = None,  # noqa: A002
  gt: float | None = None,
  lt: float | None = None,
  choices: Iterable | None = None,
  items: Iterable | None = None,
  noun: str = "values",
  nonempty: bool = False,
  by_hand: str = "",
) -> Any:
  """A section field: its default, one-line doc and valid values.

  min/max: inclusive bounds; gt/lt: exclusive ones (numbers). choices: the allowed values.
  items: the allowed elements of a tuple (`noun` names them in messages). nonempty: a string or
  tuple may not be empty. by_hand: the rule, in words, of a field the section's own validator
  checks (a value the range words cannot say).
  """
  if (min is not None and gt is not None) or (max is not None and lt is not None):
    raise TypeError(f"{doc!r}: give min or gt, and max or lt, not both")
  rule = Rule(
    doc=doc,
    min=min,
    max=max,
    gt=gt,
    lt=lt,
    choices=None if choices is None else tuple(choices),
    items=None if items is None else tuple(items),
    noun=noun,
    nonempty=nonempty,
    by_hand=by_hand,
  )
  return dataclasses.field(default=default, metadata={"rule": rule})


def redefault(section: type, name: str, default: Any) -> Any:
  """A field of `section` with another default, for a section that extends it: the doc and
  range stay declared once, where `section` declares them (e.g. the simulator's larger batch)."""
  rule = fields(section)[name][2]
  return dataclasses.field(default=default, metadata={"rule": rule})


@functools.cache
def fields(section: type) -> dict[str, tuple[Any, Any, Rule]]:
  """{name: (type, default, rule)} of a section dataclass, in declaration order."""
  hints = typing.get_type_hints(section)
  out = {}
  for f in dataclasses.fields(section):
    if "rule" not in f.metadata:
      raise TypeError(f"{section.__name__}.{f.name} is not a schema.field (no doc, no range)")
    out[f.name] = (hints[f.name], f.default, f.metadata["rule"])
  return out


def names(section: type) -> tuple[str, ...]:
  return tuple(fields(section))


def defaults(section: type, only: Iterable[str] | None = None) -> ml_collections.ConfigDict:
  """The ConfigDict of the section's defaults, as config files return it; `only`: those fields
  (a config whose program reads part of a section)."""
  values = {name: default for name, (_, default, _) in fields(section).items()}
  if only is not None:
    only = tuple(only)
    unknown = sorted(set(only) - set(values))
    if unknown:
      raise TypeError(f"{section.__name__} has no field(s) {unknown}")
    values = {name: values[name] for name in only}
  return ml_collections.ConfigDict(values)


def check_unknown(section: type, node: Any, prefix: str) -> None:
  """ConfigError naming the fields of config.<prefix> that the section does not declare."""
  known = names(section)
  unknown = sorted(set(node.keys()) - set(known))
  if not unknown:
    return
  close = difflib.get_close_matches(unknown[0], known, n=1)
  hint = f" (did you mean '{close[0]}'?)" if close else ""
  raise cc.ConfigError(
    f"config.{prefix} has unknown field(s) {unknown}{hint}; known fields: {', '.join(known)}.",
    field=f"config.{prefix}.{unknown[0]}",
    suggestion=close[0] if close else None,
  )


def validate(section: type, config: Any, prefix: str) -> None:
  """Checks every field of config.<prefix> against the section: unknown fields, then each
  field's type and range in declaration order. Raises ConfigError naming the field."""
  check_unknown(section, cc.get(config, prefix), prefix)
  for name, (kind, _, rule) in fields(section).items():
    check_field(config, f"{prefix}.{name}", kind, rule)


def load(section: type, config: Any, prefix: str) -> Any:
  """The typed, frozen section object of config.<prefix> (validated first): what programs hand
  to library code instead of the ConfigDict. Lists become tuples."""
  validate(section, config, prefix)
  node = cc.get(config, prefix)
  return section(**{name: _frozen(node[name]) for name in names(section)})


def _frozen(value: Any) -> Any:
  return tuple(value) if isinstance(value, list) else value


def check_field(config: Any, path: str, kind: Any, rule: Rule) -> None:
  """One field's type and range, by the config_checks helper of its type."""
  value = cc.get(config, path)
  if rule.by_hand:
    return
  optional = _optional(kind)
  if optional is not None:
    if value is None:
      return
    kind = optional
  if rule.choices is not None:
    cc.choice(config, path, rule.choices)
  elif kind is bool:
    cc.boolean(config, path)
  elif kind is int:
    cc.integer(config, path, min_value=rule.min, max_value=rule.max)
  elif kind is float:
    _number(config, path, rule)
  elif kind is str:
    cc.string(config, path, allow_empty=not rule.nonempty)
  elif typing.get_origin(kind) is tuple:
    _sequence(path, value, rule)
  else:
    raise TypeError(f"config.{path}: no check for type {kind}; declare it by_hand")


def _optional(kind: Any) -> Any:
  """T of `T | None`, else None."""
  if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if len(args) == 1 and len(typing.get_args(kind)) == 2:
      return args[0]
  return None


def _number(config: Any, path: str, rule: Rule) -> None:
  lo, hi = (rule.gt, rule.lt)
  cc.number(
    config,
    path,
    min_value=rule.min if lo is None else lo,
    max_value=rule.max if hi is None else hi,
    min_exclusive=lo is not None,
    max_exclusive=hi is not None,
  )


def _sequence(path: str, value: Any, rule: Rule) -> None:
  allowed = rule.items
  if (
    isinstance(value, str) or not isinstance(value, (tuple, list)) or (rule.nonempty and not value)
  ):
    what = "non-empty tuple" if rule.nonempty else "tuple"
    cc.fail(
      path, value, f"must be a {what} of {rule.noun}" + (f" from {allowed}" if allowed else "")
    )
  if allowed is not None:
    bad = [v for v in value if v not in allowed]
    if bad:
      cc.fail(path, value, f"unknown {rule.noun} {bad}; allowed: {allowed}")


def allowed(kind: Any, rule: Rule) -> str:
  """The field's valid values in words, e.g. '>= 1', 'in (0.0, 1.0)', "one of 'a', 'b'"."""
  if rule.by_hand:
    return rule.by_hand
  optional = _optional(kind)
  suffix = ", or None" if optional is not None else ""
  kind = kind if optional is None else optional
  if rule.choices is not None:
    return "one of " + ", ".join(repr(c) for c in rule.choices) + suffix
  if kind is bool:
    return "True or False"
  if typing.get_origin(kind) is tuple:
    what = "non-empty tuple" if rule.nonempty else "tuple"
    items = f" from {', '.join(repr(i) for i in rule.items)}" if rule.items else ""
    return f"{what} of {rule.noun}{items}"
  if kind is str:
    return "non-empty string" if rule.nonempty else "string"
  name = "integer" if kind is int else "number"
  lo = f"> {rule.gt}" if rule.gt is not None else None if rule.min is None else f">= {rule.min}"
  hi = f"< {rule.lt}" if rule.lt is not None else None if rule.max is None else f"<= {rule.max}"
  return " ".join(x for x in (name, ", ".join(b for b in (lo, hi) if b)) if x) + suffix


def describe(section: type, name: str) -> str | None:
  """'doc [valid values]' of one field, or None if the section has no such field."""
  entry = fields(section).get(name)
  if entry is None:
    return None
  kind, _, rule = entry
  return f"{rule.doc} [{allowed(kind, rule)}]"
