"""The house's size limits: a module a reader can hold in mind, reference docs a reader can finish.

README.md has its own, tighter limit (tests/test_readme.py)."""

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE_LINES = 550
MARKDOWN_LINES = 500


def _tracked(suffix: str) -> list[str]:
  """Files of the repository ending in ``suffix`` (git's list; the folder walk outside a clone)."""
  try:
    out = subprocess.run(
      ["git", "ls-files", "--cached", "--others", "--exclude-standard", f"*{suffix}"],
      cwd=REPO,
      capture_output=True,
      text=True,
      check=True,
    ).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    skip = {".git", ".venv", "runs", "report", "data"}
    out = []
    for root, dirs, files in os.walk(REPO):
      dirs[:] = [d for d in dirs if d not in skip or root != REPO]
      out += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith(suffix)]
  return sorted(p for p in out if os.path.exists(os.path.join(REPO, p)))


def _too_long(paths: list[str], limit: int, root: str = REPO) -> list[str]:
  out = []
  for path in paths:
    with open(os.path.join(root, path), encoding="utf-8") as f:
      n = sum(1 for _ in f)
    if n > limit:
      out.append(f"{path}: {n} lines")
  return out


def test_no_module_of_the_package_is_over_550_lines():
  modules = [p for p in _tracked(".py") if p.startswith("transformer_jax/")]
  assert len(modules) > 50
  assert not _too_long(modules, MODULE_LINES)


def test_no_markdown_document_but_the_readme_is_over_500_lines():
  docs = [p for p in _tracked(".md") if p != "README.md"]
  assert "CHANGELOG.md" in docs
  assert not _too_long(docs, MARKDOWN_LINES)


@pytest.mark.parametrize("limit,expect", [(3, ["x.py: 4 lines"]), (4, [])])
def test_the_count_is_of_lines(tmp_path, limit, expect):
  (tmp_path / "x.py").write_text("a\nb\nc\nd\n")
  assert _too_long(["x.py"], limit, str(tmp_path)) == expect
