"""What `looped.main` shows a person: the usage text and one-line errors for bad flags.

A bad config value or a misspelled field is the most common mistake; it gets one line on
stderr (field, value, what is allowed or the closest name) and exit status 2, never the whole
config and a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pkgutil
import re
import sys

from absl import flags, logging

import configs

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
    "Config files (every field is commented in its file):",
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


def fail(message: str) -> None:
  """Prints `error: message` on stderr and exits with status 2."""
  print(f"error: {message}", file=sys.stderr, flush=True)
  sys.exit(EXIT_USAGE)


def _override_error(argv: list[str], error: Exception) -> str:
  """A one-line message for an exception raised while applying --config.* flags."""
  text = str(error).strip().strip("'\"").replace("\\n", "\n").replace("\\'", "'")
  missing = re.match(r"'?([A-Za-z0-9_]+)'?\s*(?:\n|$)", text)
  suggestion = re.search(r'Did you mean "([^"]+)"', text)
  overrides = [a for a in argv if a.startswith("--config.")]
  if missing:
    key = missing.group(1)
    flag = next((a for a in overrides if re.search(rf"\.{re.escape(key)}(=|\.|$)", a)), None)
    if flag is not None:
      hint = f" (did you mean '{suggestion.group(1)}'?)" if suggestion else ""
      return f"{flag}: the config has no field '{key}'{hint}."
  first = text.splitlines()[-1] if text else type(error).__name__
  return f"bad config flag ({' '.join(overrides) or 'none'}): {first}"


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


def config_help(spec: str) -> str:
  """`--config=FILE[:ARGS] --help`: every field of that config with its default and comment."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--config: no config file {path}")
  module_spec = importlib.util.spec_from_file_location("_looped_config_help", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg) if arg else module.get_config()
  comments = _field_comments(path)
  doc = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
  lines = [f"{spec}: {doc}", "", "Fields (override with --config.FIELD=VALUE):"]
  for name, leaf, value in _leaves(config):
    comment = comments.get(leaf, "")
    lines.append(f"  {name} = {value!r}" + (f"  # {comment}" if comment else ""))
  variants = getattr(module, "VARIANTS", {})
  if variants:
    lines += ["", "Variants (after a colon, comma-separated):"]
    lines += [f"  :{k:<10} {v}" for k, v in variants.items()]
  return "\n".join(lines)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors; no flags at all prints the usage text, and
  `--config=X --help` the fields of config X."""
  if len(argv) == 1:
    print(usage(), file=sys.stderr)
    sys.exit(EXIT_USAGE)
  config = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")]
  if config and any(a in _HELP for a in argv[1:]):
    try:
      print(config_help(config[-1]))
    except (OSError, ValueError, KeyError) as e:
      fail(str(e))
    sys.exit(0)
  try:
    rest = flags.FLAGS(argv)
    flags.FLAGS["config"].value.keys()  # A missing config file only raises when read.
    return rest
  except OSError as e:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    fail(f"--config: {lines[-1]}")
  except flags.IllegalFlagValueError as e:
    # Loading the config file (e.g. an unknown variant) or parsing an override's value: the
    # message is "flag --X=V: ..." with the cause's traceback; keep the flag and the cause.
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    cause = re.sub(r"^[\w.]*(Error|Exception): ", "", lines[-1])
    fail(f"{lines[0].split(': ', 1)[0]}: {cause}" if len(lines) > 1 else lines[0])
  except flags.Error as e:
    fail(str(e).strip().splitlines()[0] + "  (python -m looped.main: usage and config files)")
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    fail(_override_error(argv, e))
  return []
