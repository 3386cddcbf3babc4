"""Which packages may import which (docs/design.md §1, "Layers").

The packages form layers (`_LAYERS`): a module imports only from lower layers and its own package,
at module level or inside a function alike, so a reader can place any module by its layer, and no
two modules need each other (no import cycle, function-level imports included).

Training is the one heavy dependency (Orbax managers, Grain, optimizers): generation, the
server, conversion and the simulator read checkpoints through looped.checkpoints and must not
load looped.train, so they start fast and a reader can tell a program's reach from its imports.
"""

import ast
import os
import subprocess
import sys

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGE = os.path.join(_REPO, "looped")

# Modules outside looped/train that train, and so may import it: the BeNice! post-training
# pipeline (its stages, objectives and the report of its training metrics) and the dispatcher's
# loader of the 'train' program.
_TRAINING_PROGRAMS = {
  "looped/benice/pipeline.py",
  "looped/benice/stages.py",
  "looped/benice/objectives.py",
  "looped/benice/report.py",
  "looped/programs.py",
}


# Lowest first. A module may import its own package and the layers below its own.
_LAYERS = (
  # Leaves: the package's docstring, validation helpers, KV formats, the loss.
  ("looped", "looped.config_checks", "looped.kv_quant", "looped.losses"),
  ("looped.schema",),  # Config sections declared once.
  ("looped.model", "looped.sharding", "looped.data"),  # The model, the mesh, the data.
  ("looped.checkpoints", "looped.scheduler"),  # What a workdir keeps; pure-Python batching.
  ("looped.train", "looped.engine"),  # Training; generation on the scheduler.
  ("looped.sim", "looped.convert", "looped.benice", "looped.server"),  # Built on those.
  ("looped.startup", "looped.cli"),  # Process start-up, usage text.
  ("looped.programs",),  # config.program -> its module.
  ("looped.main",),  # Flag parsing.
)


def _unit(module: str) -> str:
  """The layered unit a module belongs to: its package under looped, or itself."""
  units = sorted((u for layer in _LAYERS for u in layer), key=len, reverse=True)
  for unit in units:
    if module == unit or (unit != "looped" and module.startswith(unit + ".")):
      return unit
  raise KeyError(f"{module} is in no layer of _LAYERS: add it")


def _layer(unit: str) -> int:
  return next(i for i, layer in enumerate(_LAYERS) if unit in layer)


def _modules():
  for root, _, files in os.walk(_PACKAGE):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(root, name)
        yield os.path.relpath(path, _REPO), path


def _imports(path: str, top_level_only: bool = False) -> set[str]:
  """Dotted names of the looped modules `path` imports (anywhere, or at module level only).
  Imports under `if TYPE_CHECKING:` are left out: annotations only, never run (how a layer names
  the config type that imports the mixer registry, which imports the layer)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  typing_only = {
    id(n)
    for node in ast.walk(tree)
    if isinstance(node, ast.If)
    and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    for n in ast.walk(node)
  }
  nodes = tree.body if top_level_only else ast.walk(tree)
  names = set()
  for node in nodes:
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return {n for n in names if n == "looped" or n.startswith("looped.")}


def _module_name(relpath: str) -> str:
  name = relpath[: -len(".py")].replace(os.sep, ".")
  return name[: -len(".__init__")] if name.endswith(".__init__") else name


class ModuleDependenciesTest(absltest.TestCase):
  def test_only_training_programs_import_train(self):
    offenders = []
    for relpath, path in _modules():
      if relpath.startswith("looped/train/") or relpath in _TRAINING_PROGRAMS:
        continue
      if any(n == "looped.train" or n.startswith("looped.train.") for n in _imports(path)):
        offenders.append(relpath)
    self.assertEqual(offenders, [], f"modules importing looped.train: {offenders}")

  def test_inference_programs_do_not_load_train(self):
    # The train section's schema (looped/train/config.py, plain dataclasses) is read by every
    # config file; the trainer, its objectives and optimizer are what must not load.
    code = (
      "import sys\n"
      "import looped.engine.generate, looped.server.program, looped.convert.program\n"
      "import looped.convert.export\n"
      "import looped.sim.simulate, looped.programs\n"
      "schema = ('looped.train', 'looped.train.config')\n"
      "print(sorted(m for m in sys.modules if m.startswith('looped.train') and m not in schema))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
      [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    self.assertEqual(out.stdout.strip(), "[]")

  def test_layers(self):
    """Every import, module level or inside a function, goes down the layers or stays in its
    own package."""
    known = {_module_name(r) for r, _ in _modules()}
    offenders = []
    for relpath, path in _modules():
      me = _unit(_module_name(relpath))
      for name in sorted(n for n in _imports(path) if n in known and n != "looped"):
        other = _unit(name)
        if other != me and _layer(other) >= _layer(me):
          offenders.append(f"{relpath} imports {name} (layer {_layer(other)} >= {_layer(me)})")
    self.assertEqual(offenders, [], "\n".join(offenders))

  def test_no_import_cycles(self):
    """A cycle of imports (inside functions too) means two modules each need the other: one of
    them holds something both use (how the mixer interface used to live in the GQA file)."""
    graph = {}
    known = {_module_name(r) for r, _ in _modules()}
    for relpath, path in _modules():
      graph[_module_name(relpath)] = {n for n in _imports(path) if n in known}
    cycles = []
    for start in sorted(graph):
      stack, seen = [(start, [start])], set()
      while stack:
        node, trail = stack.pop()
        for nxt in graph.get(node, ()):
          if nxt == start and len(trail) > 1:
            cycles.append(" -> ".join(trail + [start]))
          elif nxt not in seen and not start.startswith(nxt + ".") and nxt != start:
            seen.add(nxt)
            stack.append((nxt, trail + [nxt]))
    # A package's __init__ importing its own modules is how packages export; not a cycle.
    cycles = [
      c for c in cycles if not all(p.startswith(c.split(" -> ")[0]) for p in c.split(" -> "))
    ]
    self.assertEqual(cycles, [], "\n".join(sorted(set(cycles))[:10]))


if __name__ == "__main__":
  absltest.main()
