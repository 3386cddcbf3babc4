"""README.md and docs/: short README, generated tables equal to their scripts, links that
resolve, a layout in docs/design.md that matches the tree, no project-history wording, and the
README's quick commands run from a fresh copy of the repository."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest

import looped_testing as testing

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(_REPO, "experiments"))

import results_tables  # noqa: E402

# One page per subsystem, the design and the results.
_PAGES = (
  "design.md",
  "index.md",
  "model.md",
  "training.md",
  "benice.md",
  "mixers.md",
  "kv_formats.md",
  "kernels.md",
  "scaling.md",
  "engine.md",
  "serving_sim.md",
  "colabs.md",
  "results.md",
)
# Pages linked from the manual that other parts of the project write (the server, the BeNice!
# recipe study); a link to them may point at a page not in this checkout yet.
_LINKED_ELSEWHERE = ("docs/server.md", "docs/benice_recipe.md")
# Wording that dates a text by the project's own work history instead of a date or version.
_HISTORY = re.compile(r"[Ss]ession[ -][0-9]|[Ii]ssue #?[0-9]")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_QUICK = re.compile(r"^<!-- quick -->\n```bash\n(?P<body>.*?)^```$", re.M | re.S)


def _tracked_files() -> list[str]:
  return testing.tracked_files(_REPO)


def _read(path: str) -> str:
  with open(os.path.join(_REPO, path), encoding="utf-8") as f:
    return f.read()


def _markdown_pages() -> list[str]:
  docs = sorted(f"docs/{p}" for p in os.listdir(os.path.join(_REPO, "docs")) if p.endswith(".md"))
  return ["README.md", *docs]


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
  text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # Headings, not code comments.
  return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def quick_commands(readme: str) -> list[str]:
  """The commands of the README's fences marked `<!-- quick -->`, continuation lines joined."""
  out = []
  for block in _QUICK.finditer(readme):
    for command in block["body"].replace("\\\n", " ").splitlines():
      if command.strip():
        out.append(command.strip())
  return out


class DocsTest(absltest.TestCase):
  def test_readme_is_short(self):
    lines = _read("README.md").count("\n")
    self.assertLessEqual(lines, 250, f"README.md has {lines} lines; move detail into docs/.")

  def test_manual_has_a_page_per_subsystem(self):
    missing = [p for p in _PAGES if not os.path.isfile(os.path.join(_REPO, "docs", p))]
    self.assertEqual(missing, [], f"docs/ lacks {missing}")

  def test_generated_tables_equal_their_scripts(self):
    names = [name for page in _markdown_pages() for name, _ in results_tables.blocks(_read(page))]
    # The README's headline and the results page's experiment tables are all generated.
    for name in ("headline", "gap_sweep", "fixed_regime", "composition", "default_command"):
      self.assertIn(name, names)
    problems = results_tables.check(_REPO)
    self.assertEqual(problems, [], "\n".join(problems))

  def test_hand_tables_in_results_say_when_they_were_measured(self):
    text = re.sub(
      r"^<!-- table: .*?^<!-- end table -->$", "", _read("docs/results.md"), flags=re.M | re.S
    )
    undated = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
      has_table = re.search(r"^\|.*\|$", section, re.M)
      if has_table and not re.search(r"\b20\d\d-\d\d-\d\d\b", section):
        undated.append(section.splitlines()[0])
    self.assertEqual(undated, [], "results sections with a hand table but no date")

  def test_no_project_history_wording(self):
    offenders = []
    for path in _tracked_files():
      with open(os.path.join(_REPO, path), "rb") as f:
        data = f.read()
      if b"\0" in data:  # Binary (test vectors).
        continue
      for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), start=1):
        if _HISTORY.search(line):
          offenders.append(f"{path}:{lineno}: {line.strip()[:100]}")
    self.assertEqual(
      offenders,
      [],
      "say where a number comes from with a date, a version or a command:\n" + "\n".join(offenders),
    )

  def test_links_resolve(self):
    broken = []
    for page in _markdown_pages():
      text = _read(page)
      for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
          continue
        path, _, anchor = target.partition("#")
        resolved = (
          page
          if not path
          else os.path.normpath(os.path.join(os.path.dirname(page), path)).replace(os.sep, "/")
        )
        if resolved in _LINKED_ELSEWHERE and not os.path.exists(os.path.join(_REPO, resolved)):
          continue
        if not os.path.exists(os.path.join(_REPO, resolved)):
          broken.append(f"{page}: {target} (no {resolved})")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(_read(resolved)):
          broken.append(f"{page}: {target} (no heading #{anchor} in {resolved})")
    self.assertEqual(broken, [], "\n".join(broken))

  def test_design_layout_matches_the_tree(self):
    design = _read("docs/design.md")
    block = design.split("## 1. Layout", 1)[1].split("\n## ", 1)[0]
    paths, parent = [], ""
    for line in block.splitlines():
      m = re.match(r"^    ( *)(\S+)", line)
      if not m:
        continue
      for name in m[2].rstrip(",").split(","):
        name = name.strip()
        if not re.search(r"/$|\.\w+$", name):
          continue
        if m[1] and not name.startswith(parent):  # Indented: a child of the last directory.
          name = parent + name
        paths.append(name)
        if not m[1] and name.endswith("/"):
          parent = name
    self.assertGreater(len(paths), 20)
    missing = [p for p in paths if not os.path.exists(os.path.join(_REPO, p))]
    self.assertEqual(missing, [], f"docs/design.md §1 names paths not in the tree: {missing}")
    self.assertNotRegex(
      design, r"(?i)not built yet|are planned", "design.md calls built parts planned"
    )

  def test_shape_suffixes_use_the_key_in_design(self):
    design = _read("docs/design.md")
    key = set(re.findall(r"^\| ([A-Z]) \|", design.split("### Shape suffixes", 1)[1], re.M))
    self.assertGreater(len(key), 15)
    suffix = re.compile(r"\b[a-z][a-z0-9_]*_((?:[A-Z0-9]x)*[A-Z0-9])\b")
    unknown = []
    for path in _tracked_files():
      if path.endswith(".py") and path.startswith(("looped/model/", "pallas_kernels/")):
        for lineno, line in enumerate(_read(path).splitlines(), start=1):
          for m in suffix.finditer(line):
            letters = set(m[1].split("x")) - key
            if {x for x in letters if not x.isdigit()}:
              unknown.append(f"{path}:{lineno}: {m[0]}")
    self.assertEqual(unknown, [], "shape letters missing from docs/design.md's key")

  def test_quick_commands_run_from_a_fresh_copy(self):
    commands = quick_commands(_read("README.md"))
    self.assertNotEmpty(commands)
    for command in commands:  # Quick means bounded: a smoke variant or a --help.
      self.assertRegex(command, r":smoke\b|--help\b", f"not a quick command: {command}")
    with tempfile.TemporaryDirectory() as tmp:
      clone = os.path.join(tmp, "looped")
      for path in _tracked_files():
        os.makedirs(os.path.dirname(os.path.join(clone, path)), exist_ok=True)
        shutil.copy2(os.path.join(_REPO, path), os.path.join(clone, path))
      env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
      env["PYTHONPATH"] = clone  # The copy's code, not the installed checkout's.
      for command in commands:
        command = command.replace("/tmp/", os.path.join(tmp, "out") + "/")
        result = subprocess.run(
          ["bash", "-c", command],
          cwd=clone,
          env=env,
          capture_output=True,
          text=True,
          timeout=900,
        )
        self.assertEqual(
          result.returncode,
          0,
          f"`{command}` failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}",
        )


if __name__ == "__main__":
  absltest.main()
