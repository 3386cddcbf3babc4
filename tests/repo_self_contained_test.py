"""The repo stands alone: no tracked file names a path outside it (a user clones it alone)."""

import os
import re

from absl.testing import absltest

import looped_testing as testing

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A parent-directory reference to the workplace's reference folder, or to its design brief.
_OUTSIDE = re.compile(r"\.\./shared|shared/data/|DESIGN\.md")


def _tracked_text_files():
  out = testing.tracked_files(_REPO)
  for path in out:
    if path.endswith((".py", ".md", ".sh", ".toml", ".cfg", ".txt", ".ipynb", ".sbatch")) or (
      path.startswith(".ci/")
    ):
      yield path


class SelfContainedTest(absltest.TestCase):
  def test_no_file_points_outside_the_repo(self):
    offenders = []
    for path in _tracked_text_files():
      with open(os.path.join(_REPO, path), encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
          if _OUTSIDE.search(line) and path != "tests/repo_self_contained_test.py":
            offenders.append(f"{path}:{lineno}: {line.strip()[:80]}")
    self.assertEqual(offenders, [], "files reach outside the repo:\n" + "\n".join(offenders))

  def test_design_document_is_in_the_repo(self):
    self.assertTrue(os.path.isfile(os.path.join(_REPO, "docs", "design.md")))


if __name__ == "__main__":
  absltest.main()
