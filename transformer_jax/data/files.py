"""Corpus files: local paths or fsspec URLs (``memory://``, ``file://``, ``s3://``, ...), opened
as byte streams, their format told by their leading bytes and name, and the names ``prepare``
takes (files, globs, folders, ``datasets`` folders) expanded into them.

Formats (``Source.kind``; gzip and zstd compression are told by their leading bytes):
  * ``text``: the file is one document (any name not below).
  * ``jsonl``: one JSON object a line, its text in ``text_field`` (``.jsonl``, ``.jsonl.gz``,
    ``.json.gz``, ``.jsonl.zst``, ``.json.zst``).
  * ``tsv``: ``source<TAB>target`` pairs a line (the seq2seq task).
  * ``parquet``: the column ``text_field``, read a row group at a time.
  * ``arrow``: Arrow IPC files or streams (what ``datasets.save_to_disk`` writes), a record batch
    at a time; a ``datasets`` folder (``state.json``, or ``dataset_dict.json`` and one folder a
    split) stands for its Arrow files, in its own order.
"""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
from collections.abc import Callable
from typing import IO

_SNIFF_BYTES = 8192
# Leading bytes of the formats a corpus comes in. The ones read are in _READ; the others (archives,
# other compressions) are refused by name: their bytes are not the text.
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
_COMPRESSIONS = {"gzip": ".gz", "zstd": ".zst"}
_DATASET_STATE, _DATASET_DICT = "state.json", "dataset_dict.json"
# The extra each format needs beyond the core dependencies.
_EXTRA = {"zstd": "zstandard", "parquet": "pyarrow", "arrow": "pyarrow", "url": "fsspec"}


@dataclasses.dataclass(frozen=True)
class Source:
  """One input file."""

  # Stable name for the content hash: path relative to the inputs' common folder.
  key: str
  path: str  # a local path or an fsspec URL
  kind: str  # "text" | "jsonl" | "tsv" | "parquet" | "arrow"
  compression: str | None = None  # "gzip" | "zstd"


def is_url(name: str) -> bool:
  return "://" in name


def need(module: str, what: str):
  """Imports the optional ``module`` that reading ``what`` needs, or raises naming the extra."""
  import importlib  # noqa: PLC0415  (an optional dependency, imported by name)

  try:
    return importlib.import_module(module)
  except ImportError:
    raise ValueError(
      f"{what}: reading it needs the optional package {module!r} "
      "(pip install 'transformer-jax[data]')"
    ) from None


def _filesystem(url: str):
  fsspec = need("fsspec", url)
  return fsspec.core.url_to_fs(url)


def open_binary(path: str, random_access: bool = False) -> IO[bytes]:
  """Opens a local path or an fsspec URL for reading bytes: from the start to the end unless
  ``random_access`` (Parquet, Arrow IPC files). An ``http(s)://`` file read from the start is one
  streamed response (``block_size=0``), which any server gives; seeking takes range requests,
  which not every server answers."""
  if not is_url(path):
    return open(path, "rb")
  fs, inner = _filesystem(path)
  if not random_access and path.split("://", 1)[0].lower() in ("http", "https"):
    return io.BufferedReader(_Streamed(fs.open(inner, "rb", block_size=0)), 1 << 20)
  return fs.open(inner, "rb")


class _Streamed(io.RawIOBase):
  """A streamed HTTP response as a raw byte stream: buffered, it reads lines without seeking
  back (fsspec's own line reading seeks, which a streamed response cannot)."""

  def __init__(self, response: IO[bytes]):
    self._response, self._at = response, 0

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    data = self._response.read(len(buffer))
    buffer[: len(data)] = data
    self._at += len(data)
    return len(data)

  def tell(self) -> int:
    return self._at

  def close(self) -> None:
    if not self.closed:
      self._response.close()
    super().close()


def size_of(path: str) -> int | None:
  if not is_url(path):
    return os.path.getsize(path)
  fs, inner = _filesystem(path)
  return fs.size(inner)


def sniff(path: str) -> str | None:
  """The format named by the leading bytes of ``path`` (``"gzip"``, ``"Parquet"``, ...,
  ``"binary"`` for a NUL byte near the start), or None for a file that may be text."""
  with open_binary(path) as f:
    head = f.read(_SNIFF_BYTES)
  for magic, name in _MAGIC:
    if head.startswith(magic):
      return name
  return "binary" if b"\0" in head else None


def _refuse(path: str, fmt: str) -> None:
  raise ValueError(
    f"{path}: a {fmt} file, not text nor a corpus format prepare reads (.jsonl, .tsv, gzip or zstd "
    "compressed, Parquet, Arrow)"
  )


def kind_of(path: str, task: str, fmt: str | None) -> tuple[str, str | None]:
  """``(kind, compression)`` of the file ``path`` whose leading bytes say ``fmt`` (``sniff``).

  Raises:
      ValueError: a format that is not read (binary, archives, bzip2, xz), or a seq2seq input
          that is not ``.tsv``.
  """
  name = path.rstrip("/").rsplit("/", 1)[-1].lower()
  compression = fmt if fmt in _COMPRESSIONS else None
  if compression:
    name = name.removesuffix(_COMPRESSIONS[compression])
  if fmt == "Parquet":
    kind = "parquet"
  elif fmt in ("Arrow", "Arrow stream"):
    kind = "arrow"
  elif fmt is not None and compression is None:
    _refuse(path, fmt)
  elif name.endswith((".jsonl", ".json")) and (compression or name.endswith(".jsonl")):
    kind = "jsonl"
  elif name.endswith(".tsv"):
    kind = "tsv"
  else:
    kind = "text"
  if task == "seq2seq" and kind != "tsv":
    raise ValueError(
      f"seq2seq inputs must be .tsv files (source<TAB>target) or synthetic:TASK, got {path!r}"
    )
  if task != "seq2seq" and kind == "tsv":
    kind = "text"  # a .tsv file is a text document outside the seq2seq task
  return kind, compression


def _dataset_folder_files(
  folder: str, join: Callable[..., str], read: Callable[[str], bytes]
) -> list[str] | None:
  """The Arrow files of a ``datasets.save_to_disk`` folder, in its order; None for another
  folder."""
  try:
    state = json.loads(read(join(folder, _DATASET_STATE)))
    return [join(folder, f["filename"]) for f in state["_data_files"]]
  except FileNotFoundError:
    pass
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{join(folder, _DATASET_STATE)}: not a datasets state file ({e})") from None
  try:
    splits = json.loads(read(join(folder, _DATASET_DICT)))["splits"]
  except FileNotFoundError:
    return None
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"{join(folder, _DATASET_DICT)}: not a datasets split list ({e})") from None
  files = []
  for split in splits:
    found = _dataset_folder_files(join(folder, split), join, read)
    if found is None:
      raise ValueError(
        f"{join(folder, split)}: split {split!r} of {folder} has no {_DATASET_STATE}"
      )
    files.extend(found)
  return files


def _local_files(name: str) -> list[str]:
  matches = (
    sorted(glob.glob(name, recursive=True))
    if glob.has_magic(name)
    else ([name] if os.path.exists(name) else [])
  )
  files = []
  for m in matches:
    files.extend(files_under(m) if os.path.isdir(m) else [m])
  return files


def _read_local(path: str) -> bytes:
  with open(path, "rb") as f:
    return f.read()


def files_under(directory: str) -> list[str]:
  """The corpus files under ``directory``, recursively and sorted: a ``datasets`` folder's Arrow
  files, else every file but hidden entries and binary files (a NUL byte near the start, not a
  format ``prepare`` reads)."""
  dataset = _dataset_folder_files(directory, os.path.join, _read_local)
  if dataset is not None:
    return dataset
  out = []
  for dirpath, dirnames, filenames in os.walk(directory):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith("."))
  return [p for p in out if sniff(p) != "binary"]


def _url_files(name: str) -> list[str]:
  fs, inner = _filesystem(name)
  protocol = name.split("://", 1)[0]

  def url(p: str) -> str:
    return f"{protocol}://{p.split('://', 1)[-1]}"

  def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts)

  def read(path: str) -> bytes:
    with open_binary(path) as f:
      return f.read()

  paths = sorted(fs.glob(inner)) if glob.has_magic(inner) else ([inner] if fs.exists(inner) else [])
  files = []
  for p in paths:
    if not fs.isdir(p):
      files.append(url(p))
      continue
    dataset = _dataset_folder_files(url(p), join, read)
    if dataset is not None:
      files.extend(dataset)
      continue
    for f in sorted(fs.find(p)):
      rel = f[len(p.rstrip("/")) :]
      if not any(part.startswith(".") for part in rel.split("/")) and sniff(url(f)) != "binary":
        files.append(url(f))
  return files


def expand(name: str) -> list[str]:
  """The files an input name (a path, glob, folder, or fsspec URL of one) stands for, sorted.

  Raises:
      OSError: a URL whose file system cannot be reached (one line naming the URL and the cause);
      ImportError: the package its protocol needs is missing."""
  if not is_url(name):
    return _local_files(name)
  try:
    files = _url_files(name)
  except (ImportError, ValueError, FileNotFoundError):
    raise
  except Exception as e:  # noqa: BLE001 - each file system raises its own network errors
    raise OSError(f"{name}: cannot be listed ({type(e).__name__}: {e}){_hub_hint(name)}") from None
  if not files and name.startswith("hf://") and _hub_offline():
    raise FileNotFoundError(f"no files found for input {name!r}: HF_HUB_OFFLINE is set")
  return files


def _hub_offline() -> bool:
  return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hub_hint(name: str) -> str:
  if not name.startswith("hf://datasets/"):
    return ""
  repo = "/".join(name[len("hf://datasets/") :].split("/")[:2])
  return (
    "; the Hugging Face Hub is not reachable from here: download the dataset where it is "
    f"(hf download {repo} --repo-type dataset --local-dir DIR) and prepare DIR"
  )


def _common_folder(names: list[str]) -> str:
  """``os.path.commonpath(names)`` ("" for absolute and relative names together), a name at a
  time: commonpath splits every name at once, a list of parts a file."""
  if not names or len({os.path.isabs(n) for n in names}) > 1:
    return ""
  common = os.path.normpath(names[0]).split(os.sep)
  for name in names[1:]:
    parts = os.path.normpath(name).split(os.sep)
    n = 0
    while n < min(len(common), len(parts)) and common[n] == parts[n]:
      n += 1
    del common[n:]
  root = os.sep.join(common)
  return root or (os.sep if os.path.isabs(names[0]) else "")


def describe(paths: list[str], task: str) -> list[Source]:
  """Sources for ``paths`` (deduplicated), keyed relative to their common folder so that the
  content hash survives moving the corpus.

  Raises:
      ValueError: naming a file whose format is not read (``kind_of``).
  """
  found: dict[str, tuple[str, str | None]] = {}
  for path in paths:
    full = path if is_url(path) else os.path.abspath(path)
    if full not in found:
      found[full] = kind_of(path, task, sniff(path))
  if not found:
    return []
  names = [p.split("://", 1)[-1] for p in found]
  root = _common_folder(names)
  if len(found) == 1 or root in names:
    root = os.path.dirname(root)
  sources = []
  for (full, (kind, compression)), name in zip(found.items(), names):
    key = os.path.relpath(name, root).replace(os.sep, "/") if root else name
    sources.append(Source(key, full, kind, compression))
  return sources
