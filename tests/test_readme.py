"""The README's contract: its examples run as written.

- Every ```python block runs, each in a fresh interpreter in a temporary folder with the repository
  on PYTHONPATH, except those named in ``PYTHON_NEEDS`` with the reason (a block that needs the
  demo run runs when that run exists, and is skipped with the reason otherwise).
- Every line of a block tagged ```bash quick (commands that finish in seconds: ``tjax info``, a
  ``--dry-run`` of a small config) runs from the repository root and must exit 0. Other ```bash
  blocks train, need a cluster or a GPU, and are only checked for their form (below).
- Every command line in a code block calls ``.venv/bin/tjax`` / ``.venv/bin/python`` (the README's
  one form: a bare ``tjax`` is not on a new shell's PATH), names a ``tjax`` subcommand that exists
  and only experiment files that exist.
"""

import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
TJAX_SUBCOMMANDS = {
  "info",
  "prepare",
  "data",
  "train",
  "eval",
  "generate",
  "fill-mask",
  "convert",
  "bench",
  "report",
}

# Python blocks that do not run everywhere, by the README section they sit in: the reason, and a
# path (relative to the repository) whose presence lets the block run from the repository root.
PYTHON_NEEDS = {
  "Loading a trained run in Python": (
    "needs the demo run runs/gpt_tiny (`make demo`, ~4 min on 2 cores)",
    "runs/gpt_tiny/final.json",
  ),
}


def _blocks():
  """``(info, text, line, section)`` for every fenced code block of the README."""
  blocks, section, fence = [], "", None
  with open(README) as f:
    lines = f.read().split("\n")
  for i, line in enumerate(lines, 1):
    if fence is None:
      if line.startswith("## "):
        section = line[3:].strip()
      elif line.startswith("```"):
        fence, info, start, body = line, line[3:].strip(), i, []
    elif line.startswith("```"):
      blocks.append((info, "\n".join(body) + "\n", start, section))
      fence = None
    else:
      body.append(line)
  assert fence is None, f"README.md: the code block opened at line {start} is never closed"
  return blocks


def _commands(text, transcript=False):
  """The command lines of a shell block (continuations joined, comments and blank lines dropped),
  or of a transcript (an untagged block: the lines after ``$ ``; the rest is output)."""
  out, pending = [], ""
  for line in text.split("\n"):
    line = pending + line
    if line.endswith("\\"):
      pending = line[:-1] + " "
      continue
    pending = ""
    if transcript:
      line = line[2:] if line.startswith("$ ") else ""
    line = "" if line.lstrip().startswith("#") else line.split(" #")[0].strip()
    if line:
      out.append(line)
  return out


BLOCKS = _blocks()
PYTHON = [
  (f"{section}:{line}", text, section)
  for info, text, line, section in BLOCKS
  if info.split()[:1] == ["python"]
]
QUICK = [
  (f"{section}:{line}", cmd)
  for info, text, line, section in BLOCKS
  if info.split() == ["bash", "quick"]
  for cmd in _commands(text)
]


def test_the_readme_has_what_this_test_runs():
  assert len(PYTHON) >= 4 and len(QUICK) >= 3
  sections = {section for _, _, section in PYTHON}
  assert set(PYTHON_NEEDS) <= sections, "an exemption names a section without a python block"
  assert len(open(README).read().splitlines()) <= 450


def _tjax():
  """The ``tjax`` of the interpreter running the tests (``.venv/bin/tjax`` under ``make test``)."""
  launcher = os.path.join(os.path.dirname(sys.executable), "tjax")
  return [launcher] if os.path.exists(launcher) else [sys.executable, "-m", "transformer_jax.cli"]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


@pytest.mark.long
@pytest.mark.parametrize("name, text, section", PYTHON, ids=[p[0] for p in PYTHON])
def test_python_block_runs(name, text, section, tmp_path):
  cwd = str(tmp_path)
  if section in PYTHON_NEEDS:
    reason, needed = PYTHON_NEEDS[section]
    if not os.path.exists(os.path.join(REPO, needed)):
      pytest.skip(reason)
    cwd = REPO
  script = tmp_path / "block.py"
  script.write_text(text)
  res = subprocess.run(
    [sys.executable, str(script)], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300
  )
  assert res.returncode == 0, f"README {name}:\n{res.stderr[-3000:]}"
  # Text a block prints is text: no special tokens a model should not write ([UNK], [PAD]).
  assert not re.search(r"\[(UNK|PAD|MASK|CLS|SEP)\]", res.stdout), f"README {name}:\n{res.stdout}"


@pytest.mark.parametrize("name, command", QUICK, ids=[f"{n}:{c[:40]}" for n, c in QUICK])
def test_quick_command_runs(name, command):
  argv = shlex.split(command)
  assert argv[0] == ".venv/bin/tjax", f"README {name}: a quick line runs .venv/bin/tjax: {command}"
  res = subprocess.run(
    _tjax() + argv[1:], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300
  )
  assert res.returncode == 0, f"README {name}: {command}\n{res.stderr[-3000:]}"
  assert res.stdout.strip(), f"README {name}: {command} printed nothing"


def test_every_command_line_has_the_one_form():
  for info, text, line, section in BLOCKS:
    if info.split()[:1] == ["python"]:
      continue
    for cmd in _commands(text, transcript=not info):
      words = shlex.split(cmd)
      for i, word in enumerate(words):
        if word in ("tjax", "python", "python3") and (i == 0 or "=" in words[i - 1]):
          pytest.fail(
            f"README line {line} ({section}): {cmd!r} calls a bare {word}; write .venv/bin/{word}"
          )
        if word == ".venv/bin/tjax":
          assert words[i + 1] in TJAX_SUBCOMMANDS, f"README line {line}: {cmd!r}"
        if re.fullmatch(r"experiments/[\w./-]+\.(yaml|py|sh|sbatch)", word):
          assert os.path.exists(os.path.join(REPO, word)), f"README line {line}: no {word}"
