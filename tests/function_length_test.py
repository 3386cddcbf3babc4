"""No function in looped/ is longer than MAX_LINES: a long function is split into named steps a
reader can take one at a time (and test alone).

A function's length is from its `def` line to its last line (decorators excluded), docstring and
comments included: what a reader scrolls through.
"""

import ast
import os

from absl.testing import absltest

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 80


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[str, int, int]]:
  """(name, first line, length) of each function in `source` over max_lines, nested ones too."""
  return [
    (node.name, node.lineno, node.end_lineno - node.lineno + 1)
    for node in ast.walk(ast.parse(source))
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    and node.end_lineno - node.lineno + 1 > max_lines
  ]


class FunctionLengthTest(absltest.TestCase):
  def test_no_function_in_looped_is_over_the_limit(self):
    found, files = [], 0
    for root, _, names in os.walk(os.path.join(_REPO, "looped")):
      for name in sorted(n for n in names if n.endswith(".py")):
        path = os.path.join(root, name)
        with open(path, encoding="utf-8") as f:
          source = f.read()
        files += 1
        relative = os.path.relpath(path, _REPO)
        found += [f"{relative}:{line} {fn} ({n} lines)" for fn, line, n in long_functions(source)]
    self.assertGreater(files, 50)  # The walk saw the package.
    self.assertEqual(found, [], f"functions over {MAX_LINES} lines: split them")

  def test_the_measure(self):
    body = "".join(f"  x{i} = {i}\n" for i in range(4))
    source = f"@decorator\ndef five():\n{body}\nclass C:\n  async def method(self):\n    pass\n"
    self.assertEqual(long_functions(source, max_lines=4), [("five", 2, 5)])
    self.assertEqual(long_functions(source, max_lines=5), [])
    nested = "def outer():\n  def inner():\n" + "".join(f"    y{i} = {i}\n" for i in range(3))
    self.assertEqual(long_functions(nested, max_lines=3), [("outer", 1, 5), ("inner", 2, 4)])


if __name__ == "__main__":
  absltest.main()
