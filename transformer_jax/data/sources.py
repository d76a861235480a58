"""Corpus inputs: the names ``prepare`` takes (files, globs, folders, ``stdlib``,
``stdlib-tests``, ``synthetic:TASK``) expanded into the files they stand for, and the synthetic
seq2seq digit tasks.

Input names:
  * a file, a glob (``**`` allowed) or a directory (recursive; hidden entries and binary files
    skipped); each file is a document, except ``.jsonl`` (one document per line, field
    ``text_field``) and, for the seq2seq task, ``.tsv`` (one ``source<TAB>target`` example per
    line).
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

import dataclasses
import glob
import os
import sysconfig
import zlib
from collections.abc import Sequence

import numpy as np

from transformer_jax.data.tokenizer import CHARS_PREFIX

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
_BINARY_SNIFF_BYTES = 8192
# Leading bytes of the compressed, columnar and archive formats a corpus comes in: such a file is
# refused by name (its bytes are not the text), never tokenized.
_MAGIC = (
  (b"\x1f\x8b", "gzip"),
  (b"\x28\xb5\x2f\xfd", "zstd"),
  (b"PAR1", "Parquet"),
  (b"ARROW1", "Arrow"),
  (b"\xff\xff\xff\xff", "Arrow stream"),
  (b"BZh", "bzip2"),
  (b"\xfd7zXZ\x00", "xz"),
  (b"PK\x03\x04", "zip"),
)
# The files ``datasets.save_to_disk`` writes next to its Arrow shards.
_DATASETS_MARKERS = ("state.json", "dataset_dict.json")


@dataclasses.dataclass(frozen=True)
class Source:
  """One input file."""

  # Stable name for the train/val hash and content hash: path relative to the inputs' common folder.
  key: str
  path: str
  kind: str  # "text" | "jsonl" | "tsv"


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


def binary_format(path: str) -> str | None:
  """The name of the non-text format of the file ``path`` (``"gzip"``, ``"Parquet"``, ...,
  ``"binary"`` for NUL bytes near the start), or None for a file that may be text."""
  with open(path, "rb") as f:
    head = f.read(_BINARY_SNIFF_BYTES)
  for magic, name in _MAGIC:
    if head.startswith(magic):
      return name
  return "binary" if b"\0" in head else None


def _refuse_binary(path: str, fmt: str) -> None:
  raise ValueError(
    f"{path}: a {fmt} file, not text; give text, .jsonl or .tsv files (decompress or export "
    "the corpus first)"
  )


def _is_datasets_folder(directory: str) -> bool:
  return any(os.path.isfile(os.path.join(directory, m)) for m in _DATASETS_MARKERS)


def _kind_of(path: str, task: str) -> str:
  if path.endswith(".jsonl"):
    return "jsonl"
  if task == "seq2seq":
    if not path.endswith(".tsv"):
      raise ValueError(
        f"seq2seq inputs must be .tsv files (source<TAB>target) or synthetic:TASK, got {path!r}"
      )
    return "tsv"
  return "text"


def files_under(directory: str) -> list[str]:
  """The text files under ``directory``, recursively and sorted; hidden entries and binary files
  (a NUL byte near the start) are skipped.

  Raises:
      ValueError: naming a ``datasets`` folder, or a compressed or columnar file (gzip, zstd,
          Parquet, Arrow, ...) under ``directory``: such bytes are never read as text.
  """
  out = []
  for dirpath, dirnames, filenames in os.walk(directory):
    if _is_datasets_folder(dirpath):
      raise ValueError(
        f"{dirpath}: a `datasets` folder (Arrow files), not text; export its text column to "
        ".jsonl first"
      )
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith("."))
  kept = []
  for path in out:
    fmt = binary_format(path)
    if fmt is None:
      kept.append(path)
    elif fmt != "binary":
      _refuse_binary(path, fmt)
  return kept


def resolve_inputs(inputs: Sequence[str], task: str) -> tuple[list[Source], list[str]]:
  """Expands input names into files (sorted, deduplicated) and synthetic task specs."""
  if not inputs:
    raise ValueError("no inputs given")
  sources: dict[str, Source] = {}
  files_found: dict[str, str] = {}  # absolute path -> kind
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
    matches = (
      sorted(glob.glob(name, recursive=True))
      if glob.has_magic(name)
      else ([name] if os.path.exists(name) else [])
    )
    files = []
    for m in matches:
      if not os.path.isdir(m) and (fmt := binary_format(m)) is not None:
        _refuse_binary(m, fmt)  # a file named (or matched) on its own is meant to be read
      files.extend(files_under(m) if os.path.isdir(m) else [m])
    if not files:
      raise FileNotFoundError(f"no files found for input {name!r}")
    for path in files:
      files_found.setdefault(os.path.abspath(path), _kind_of(path, task))
  if files_found:
    # Keys are relative to the files' common folder, so the split and content hash survive moving
    # the corpus.
    root = os.path.commonpath(list(files_found))
    if len(files_found) == 1:
      root = os.path.dirname(root)
    for path, kind in files_found.items():
      key = os.path.relpath(path, root).replace(os.sep, "/")
      sources.setdefault(key, Source(key, path, kind))
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
