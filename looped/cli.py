"""What `looped.main` shows a person: the usage text and one-line errors for bad flags.

A bad config value or a misspelled field is the most common mistake; it gets one line on
stderr (field, value, what is allowed or the closest name) and exit status 2, never the whole
config and a traceback.
"""

from __future__ import annotations

import contextlib
import difflib
import glob
import importlib
import importlib.util
import os
import pkgutil
import re
import sys

from absl import flags, logging

import configs
from looped import schema
from looped.config_checks import ConfigError

EXIT_USAGE = 2


def _config_modules():
  for info in sorted(pkgutil.iter_modules(configs.__path__), key=lambda m: m.name):
    yield info.name, importlib.import_module(f"configs.{info.name}")


def usage() -> str:
  """The config files, their variants and one example command each."""
  lines = [
    "Usage: python -m looped.main --config=configs/FILE.py[:VARIANT[,VARIANT]] --workdir=DIR "
    "[--config.FIELD=VALUE ...]",
    "",
    "Config files (--config=FILE --help lists every field with its doc and valid values):",
  ]
  for name, module in _config_modules():
    summary = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
    lines.append(f"  configs/{name}.py  {summary}")
    for variant, description in getattr(module, "VARIANTS", {}).items():
      lines.append(f"      :{variant:<10} {description}")
    lines.append(
      f"      e.g. python -m looped.main --config=configs/{name}.py --workdir=/tmp/{name}"
    )
  lines += ["", "Flags: --helpfull lists every flag."]
  return "\n".join(lines)


@contextlib.contextmanager
def quiet_logs():
  """Only warnings and errors are logged inside (absl verbosity restored after)."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(verbosity)


def fail(message: str, *, distributed: bool = False) -> None:
  """Prints `error: message` on stderr and exits with status 2.

  distributed: skip jax.distributed's exit handler, which waits for every process to shut
  down, so a process failing alone (e.g. process 0 finding the workdir busy) would hang there,
  unseen by its launcher, while the others wait for it.
  """
  print(f"error: {message}", file=sys.stderr, flush=True)
  if distributed:
    sys.stdout.flush()
    os._exit(EXIT_USAGE)
  sys.exit(EXIT_USAGE)


_HELP = ("--help", "-h", "--helpshort", "-?")
# `  c.train.num_steps = 1500  # Optimizer steps.` or `  t.num_steps = 1500  # ...`.
_FIELD_LINE = re.compile(r"^\s*[\w.]*?\.?(\w+)\s*=\s*[^#]*?#\s*(.+)$")


def _field_comments(path: str) -> dict[str, str]:
  """{field name: its comment} from a config file's `x.name = value  # comment` lines."""
  out: dict[str, str] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      m = _FIELD_LINE.match(line)
      if m and "." in line.split("=", 1)[0]:
        out.setdefault(m[1], m[2].strip())
  return out


def _leaves(tree, prefix: str = "config"):
  for key, value in tree.items():
    if hasattr(value, "items"):
      yield from _leaves(value, f"{prefix}.{key}")
    else:
      yield f"{prefix}.{key}", key, value


def load_config(spec: str):
  """(module, config) of `--config=FILE[:ARGS]`; ConfigError for a missing file or variant."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"--config: No such file: {path}", field="--config", value=spec)
  name = "_looped_config_" + re.sub(r"\W", "_", os.path.abspath(path))
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  sys.modules[name] = module  # Dataclasses in a config file look their module up by name.
  module_spec.loader.exec_module(module)
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except ValueError as e:  # configs.parse_args: an unknown variant.
    raise ConfigError(f"--config={spec}: {e}", field="--config", value=spec) from None
  return module, config


def _parses_as(kind: type, text: str) -> bool:
  try:
    kind(text)
    return True
  except ValueError:
    return False


def check_overrides(config, argv: list[str]) -> None:
  """ConfigError for a `--config.FIELD=VALUE` flag naming no field of `config` (with the closest
  name), or giving a number field a value that is not a number. Runs before absl parses them."""
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    flag, _, text = arg.partition("=")
    path = flag[len("--config.") :]
    node = config
    for key in path.split("."):
      keys = list(node.keys()) if hasattr(node, "keys") else []
      if key not in keys:
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
          f"{flag}{'=' + text if '=' in arg else ''}: the config has no field '{key}'{hint}.",
          field=f"config.{path}",
          value=text,
          suggestion=close[0] if close else None,
        )
      node = node[key]
    kind = type(node)
    if "=" in arg and kind in (int, float) and not _parses_as(kind, text):
      requirement = "must be an integer" if kind is int else "must be a number"
      raise ConfigError(
        f"{arg}: config.{path} {requirement}.",
        field=f"config.{path}",
        value=text,
        requirement=requirement,
      )


def field_doc(path: str, comments: dict[str, str]) -> str:
  """The doc of config field `path` ('config.model.d_model'): its section schema's doc and
  valid values (configs.SECTIONS), else the field's comment in the config file."""
  section, _, name = path.removeprefix("config.").rpartition(".")
  schema_cls = configs.SECTIONS.get(section)
  described = schema.describe(schema_cls, name) if schema_cls is not None else None
  return described or comments.get(name, "")


def config_help(spec: str) -> str:
  """`--config=FILE[:ARGS] --help`: every field of that config with its default, doc and valid
  values (from its section's schema; the file's comment for a field outside the sections)."""
  module, config = load_config(spec)
  path = spec.partition(":")[0]
  # Comments of the fields outside the sections; one that another config file sets (seed, which
  # configs/benice.py takes from configs/pretrain.py) keeps its comment there.
  comments = {}
  for other in sorted(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.py"))):
    comments.update(_field_comments(other))
  comments.update(_field_comments(path))
  doc = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
  lines = [f"{spec}: {doc}", "", "Fields (override with --config.FIELD=VALUE):"]
  for name, _, value in _leaves(config):
    comment = field_doc(name, comments)
    lines.append(f"  {name} = {value!r}" + (f"  # {comment}" if comment else ""))
  variants = getattr(module, "VARIANTS", {})
  if variants:
    lines += ["", "Variants (after a colon, comma-separated):"]
    lines += [f"  :{k:<10} {v}" for k, v in variants.items()]
  return "\n".join(lines)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors; no flags at all prints the usage text, and
  `--config=X --help` the fields of config X. The config file, its variants and every
  `--config.FIELD=VALUE` are checked first (ConfigError), so absl's own messages are only the
  fallback for what those checks do not cover."""
  if len(argv) == 1:
    print(usage(), file=sys.stderr)
    sys.exit(EXIT_USAGE)
  specs = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")]
  try:
    if specs:
      _, config = load_config(specs[-1])
      if any(a in _HELP for a in argv[1:]):
        print(config_help(specs[-1]))
        sys.exit(0)
      check_overrides(config, argv[1:])
  except ConfigError as e:
    fail(str(e))
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    fail(f"{lines[0]}  (python -m looped.main: usage and config files)")
  return []
