"""What every family module shares: reading config.json fields, one-line errors, checking the
checkpoint's tensor names and shapes against the config, and building the params tree; for
export, refusing a model field a family cannot express and checking the written shapes."""

from __future__ import annotations

from looped import config_checks as cc
from looped.model import mixers as mixers_lib

_MISSING = object()


def unsupported(name: str, value, why: str):
  raise cc.ConfigError(f"config.json {name} = {value!r} is not supported: {why}.")


def field(hf: dict, name: str, kind: type, *, alias: str | None = None, default=_MISSING):
  """config.json's `name` (or `alias`) as `kind`; ConfigError if absent without a default or
  of another type."""
  value = hf.get(name, hf.get(alias, default) if alias else default)
  if value is _MISSING:
    raise cc.ConfigError(f"config.json has no field {name!r}; it is needed to convert the model.")
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
    unsupported(name, value, f"must be {kind.__name__}")
  return value


def widths(s: dict) -> dict:
  """LoopedLM width fields from a family's sizes (V, D, N, K, H, F), with Huginn's and Ouro's
  SwiGLU MLP (Parcae replaces the MLP type)."""
  return {
    "vocab_size": s["V"],
    "d_model": s["D"],
    "num_heads": s["N"],
    "num_kv_heads": s["K"],
    "head_dim": s["H"],
    "mlp_dim": s["F"],
    "mlp_type": "swiglu",
  }


def check_tensors(shapes: dict, expected: dict, optional: tuple[str, ...]) -> None:
  """ConfigError naming the first tensor that is missing, unexpected, or whose shape differs
  from the one config.json implies (tensor, expected and found shape)."""
  for name in sorted(expected):
    if name not in shapes:
      raise cc.ConfigError(
        f"the checkpoint lacks tensor {name} (shape {expected[name]} for its config.json)."
      )
    if tuple(shapes[name]) != tuple(expected[name]):
      raise cc.ConfigError(
        f"tensor {name} has shape {tuple(shapes[name])}, but config.json implies "
        f"{tuple(expected[name])}."
      )
  unused = sorted(n for n in shapes if n not in expected and not n.endswith(optional))
  if unused:
    raise cc.ConfigError(
      f"the checkpoint holds tensor {unused[0]} that its architecture does not use "
      f"({len(unused)} such tensor(s)); it may be another variant of the family."
    )


def put(tree: dict, scope: str, value: dict) -> None:
  """tree[a][b]... = value for scope 'a/b/...'."""
  *parents, leaf = scope.split("/")
  for name in parents:
    tree = tree.setdefault(name, {})
  tree[leaf] = value


def refuse_export(family: str, name: str, value, why: str):
  raise cc.ConfigError(f"model.{name} = {value!r} cannot be exported to {family}: {why}.")


def require_fields(cfg, family: str, required: dict) -> None:
  """ConfigError naming the first model field of `cfg` whose value is not the one `required`
  ({field: (value, why)}) gives, then the first stage with a mixer other than attention."""
  for name, (value, why) in required.items():
    if getattr(cfg, name) != value:
      refuse_export(family, name, getattr(cfg, name), f"{why} (needs {value!r})")
  for stage in ("prelude", "core", "coda"):
    if mixers_lib.lacking(cfg, stage, "plain_attention"):
      mixers = getattr(cfg, f"{stage}_mixers")
      refuse_export(family, f"{stage}_mixers", mixers, f"{family}'s layers are all attention")


def torch_rows(kernel_DxMxH):
  """A LoopedLM [D, heads, H] projection kernel as a torch Linear's rows: [heads, H, D]."""
  return kernel_DxMxH.transpose(1, 2, 0)


def check_export_shapes(family: str, out: dict, expected: dict) -> None:
  """ValueError naming the first exported tensor whose shape is not the one the family's
  converter expects, or that is missing or extra: a mapping bug fails here, not in torch."""
  for name in sorted(expected.keys() | out.keys()):
    got = tuple(out[name].shape) if name in out else None
    if got != (tuple(expected[name]) if name in expected else None):
      raise ValueError(f"exported {name}: shape {got}, {family}'s {expected.get(name)}")
