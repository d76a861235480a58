"""Corpus inputs: the names ``prepare`` takes (files, globs, folders, ``stdlib``,
``stdlib-tests``, ``synthetic:TASK``) expanded into the files they stand for, and the synthetic
seq2seq digit tasks.

Input names:
  * a file, a glob (``**`` allowed), a directory (recursive; hidden entries and binary files
    skipped), a ``datasets`` folder, or an fsspec URL of one of these; each file is a document,
    except the record formats of ``data.files`` (JSON lines, Parquet, Arrow: one document a
    record, its text in ``text_field``) and, for the seq2seq task, ``.tsv`` (one
    ``source<TAB>target`` example per line).
  * ``stdlib-tests``: the same Python's own test suite (``Lib/test``), which ``stdlib`` leaves
    out: a second code corpus (for adapting a model trained on ``stdlib``).
  * ``stdlib``: the running Python's standard-library ``.py`` files
    (``sysconfig.get_paths()["stdlib"]``), excluding ``site-packages``/``dist-packages``, test
    directories (``test``, ``tests``, ``idle_test``), ``__pycache__``, ``config-*`` and the
    platform-specific ``_sysconfigdata*`` file: about 730 files, 12 MB for CPython 3.11, stable
    across machines with the same Python version.
  * ``synthetic:reverse``, ``synthetic:sort``, ``synthetic:add`` (optionally
    ``synthetic:add:50000``): seq2seq digit tasks generated deterministically from ``seed`` with the
    character tokenizer ``chars:0123456789+``.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from collections.abc import Sequence

import numpy as np

from transformer_jax.data.files import Source, describe, expand, files_under
from transformer_jax.data.tokenizer import CHARS_PREFIX

__all__ = ["Source", "files_under", "resolve_inputs", "parse_synthetic", "synthetic_examples"]

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_TASKS = ("reverse", "sort", "add")
SYNTHETIC_ALPHABET = "0123456789+"
SYNTHETIC_TOKENIZER = CHARS_PREFIX + SYNTHETIC_ALPHABET
DEFAULT_SYNTHETIC_EXAMPLES = 20_000
SYNTHETIC_MIN_DIGITS, SYNTHETIC_MAX_DIGITS = 3, 12
_STDLIB_EXCLUDED_DIRS = {
  "site-packages",
  "dist-packages",
  "test",
  "tests",
  "idle_test",
  "__pycache__",
}


def _stdlib_test_sources() -> list[Source]:
  """The standard library's own test suite (``Lib/test``): code the ``stdlib`` corpus leaves out."""
  root = sysconfig.get_paths()["stdlib"]
  sources = []
  for dirpath, dirnames, filenames in os.walk(os.path.join(root, "test")):
    dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
    for name in sorted(filenames):
      if name.endswith(".py"):
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        sources.append(Source(f"stdlib/{rel}", path, "text"))
  return sources


def _stdlib_sources() -> list[Source]:
  root = sysconfig.get_paths()["stdlib"]
  sources = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(
      d for d in dirnames if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith(("config-", "."))
    )
    for name in sorted(filenames):
      if name.endswith(".py") and not name.startswith("_sysconfigdata"):
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        sources.append(Source(f"stdlib/{rel}", path, "text"))
  return sources


def resolve_inputs(inputs: Sequence[str], task: str) -> tuple[list[Source], list[str]]:
  """Expands input names into files (sorted, deduplicated) and synthetic task specs."""
  if not inputs:
    raise ValueError("no inputs given")
  sources: dict[str, Source] = {}
  paths: list[str] = []
  synthetic: list[str] = []
  for name in inputs:
    if name.startswith(SYNTHETIC_PREFIX):
      parse_synthetic(name)  # validate early
      synthetic.append(name)
      continue
    if name in ("stdlib", "stdlib-tests") and not os.path.exists(name):
      found = _stdlib_sources() if name == "stdlib" else _stdlib_test_sources()
      if not found:
        raise FileNotFoundError(
          f"no .py files found in the stdlib {sysconfig.get_paths()['stdlib']!r}"
        )
      for s in found:
        sources.setdefault(s.key, s)
      continue
    files = expand(name)
    if not files:
      raise FileNotFoundError(f"no files found for input {name!r}")
    paths.extend(files)
  for s in describe(paths, task):
    sources.setdefault(s.key, s)
  if synthetic and task != "seq2seq":
    raise ValueError(f"synthetic inputs {synthetic} are seq2seq tasks; use task='seq2seq'")
  if synthetic and sources:
    raise ValueError(
      "synthetic inputs use their own character tokenizer and cannot be mixed with files"
    )
  return list(sources.values()), synthetic


def parse_synthetic(name: str) -> tuple[str, int]:
  """``synthetic:TASK[:COUNT]`` as ``(TASK, COUNT)``; raises ValueError naming a bad one."""
  parts = name[len(SYNTHETIC_PREFIX) :].split(":")
  if parts[0] not in SYNTHETIC_TASKS or len(parts) > 2:
    raise ValueError(
      f"unknown synthetic input {name!r}; expected synthetic:TASK[:COUNT] with TASK in "
      f"{SYNTHETIC_TASKS}"
    )
  try:
    count = int(parts[1]) if len(parts) == 2 else DEFAULT_SYNTHETIC_EXAMPLES
  except ValueError:
    raise ValueError(f"bad example count in {name!r}") from None
  if count <= 0:
    raise ValueError(f"example count must be positive in {name!r}")
  return parts[0], count


def synthetic_examples(task: str, count: int, seed: int) -> list[tuple[str, str]]:
  """Generates ``count`` deterministic (source, target) digit-string pairs.

  Args:
      task: ``"reverse"`` (target = reversed source), ``"sort"`` (target = sorted digits) or
          ``"add"`` (source ``"a+b"`` with operands of 1-6 digits, target the decimal sum).
      count: Number of examples.
      seed: Random seed; the same (task, count, seed) always gives the same examples.

  Returns:
      List of ``(source, target)`` strings over the alphabet ``"0123456789+"``.
  """
  rng = np.random.default_rng([seed, zlib.crc32(task.encode())])
  digits = rng.integers(0, 10, size=(count, SYNTHETIC_MAX_DIGITS))
  if task in ("reverse", "sort"):
    lengths = rng.integers(SYNTHETIC_MIN_DIGITS, SYNTHETIC_MAX_DIGITS + 1, size=count)
    out = []
    for row, n in zip(digits.tolist(), lengths.tolist()):
      src = "".join(map(str, row[:n]))
      out.append((src, src[::-1] if task == "reverse" else "".join(sorted(src))))
    return out
  if task == "add":
    half = SYNTHETIC_MAX_DIGITS // 2
    lengths = rng.integers(1, half + 1, size=(count, 2))
    out = []
    for row, (na, nb) in zip(digits.tolist(), lengths.tolist()):
      a = int("".join(map(str, row[:na])))
      b = int("".join(map(str, row[half : half + nb])))
      out.append((f"{a}+{b}", str(a + b)))
    return out
  raise ValueError(f"unknown synthetic task {task!r}; expected one of {SYNTHETIC_TASKS}")
