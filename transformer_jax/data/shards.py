"""Writing token shards in bounded memory: documents are appended to pending files as they are
tokenized (``PendingDocs``), then copied into the train and val streams a chunk at a time
(``write_split``), re-numbered by a compact vocabulary on the way.

What is held in memory is 8 bytes a document and stream (its length) and 8 for its split hash,
plus one chunk of tokens: never the corpus.
"""

from __future__ import annotations

import array
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

CHUNK_TOKENS = 1 << 20  # tokens read at a time (4 MiB of uint32)


def document_hash(texts: Sequence[str], seed: int) -> int:
  """The seeded 64-bit hash of a document's content (the texts of a pair joined by NUL): what
  puts it in train or val, whatever file or format it came from."""
  h = hashlib.blake2b(digest_size=8, key=str(seed).encode())
  h.update("\0".join(texts).encode("utf-8", errors="surrogatepass"))
  return int.from_bytes(h.digest(), "little")


def pending_file(out: str, stream: str) -> str:
  return os.path.join(out, "all_000.bin.tmp" if stream == "tokens" else f"all_{stream}_000.bin.tmp")


INDEX_FILE = "all_index.bin.tmp"  # uint64 a document and stream (its length), then its hash


class FileTokens:
  """A uint32 token file whose slices are read when asked for: unlike a memory map, the pages
  read do not stay in the process's memory, so copying a file a chunk at a time holds one
  chunk."""

  def __init__(self, path: str):
    self.path = path
    self.size = os.path.getsize(path) // 4

  def __getitem__(self, key: slice) -> np.ndarray:
    start, stop, step = key.indices(self.size)
    if step != 1:
      raise ValueError("FileTokens reads contiguous slices")
    with open(self.path, "rb") as f:
      f.seek(4 * start)
      return np.fromfile(f, np.uint32, max(stop - start, 0))


class PendingDocs:
  """Documents in arrival order, one pending token file per stream (``tokens``, or ``src`` and
  ``tgt``) in ``out``, and their lengths and split hashes both in compact arrays and in an index
  file beside them: ``resume`` reopens the files an interrupted run left."""

  def __init__(self, out: str, streams: Sequence[str], resume_docs: int | None = None):
    self.out, self.streams = out, tuple(streams)
    self.lengths = {s: array.array("q") for s in self.streams}
    self.hashes = array.array("Q")
    index_path = os.path.join(out, INDEX_FILE)
    if resume_docs is None:
      self.files = {s: open(pending_file(out, s), "wb") for s in self.streams}
      self.index = open(index_path, "wb")
      return
    width = len(self.streams) + 1
    rows = np.fromfile(index_path, np.uint64)[: resume_docs * width].reshape(-1, width)
    if len(rows) != resume_docs:
      raise ValueError(f"{index_path}: {len(rows)} documents, the checkpoint says {resume_docs}")
    self.files = {s: open(pending_file(out, s), "r+b") for s in self.streams}
    self.index = open(index_path, "r+b")
    for k, stream in enumerate(self.streams):
      self.lengths[stream].frombytes(rows[:, k].astype(np.int64).tobytes())
    self.hashes.frombytes(rows[:, -1].tobytes())
    self.truncate(resume_docs)

  @property
  def num_docs(self) -> int:
    return len(self.hashes)

  @property
  def num_tokens(self) -> int:
    return sum(f.tell() for f in self.files.values()) // 4

  def extend(self, docs: Sequence[tuple[Sequence[np.ndarray], int]]) -> None:
    """Appends ``(arrays, doc_hash)`` documents with one write a stream."""
    if not docs:
      return
    rows = np.empty((len(docs), len(self.streams) + 1), np.uint64)
    for k, stream in enumerate(self.streams):
      arrays = [d[0][k] for d in docs]
      np.concatenate(arrays).astype(np.uint32, copy=False).tofile(self.files[stream])
      rows[:, k] = [len(a) for a in arrays]
      self.lengths[stream].frombytes(rows[:, k].astype(np.int64).tobytes())
    rows[:, -1] = [h for _, h in docs]
    self.hashes.frombytes(rows[:, -1].tobytes())
    rows.tofile(self.index)

  def flush(self) -> None:
    for f in (*self.files.values(), self.index):
      f.flush()

  def truncate(self, num_docs: int) -> None:
    """Drops the documents after the first ``num_docs`` (those of a file found spoilt, or
    written after the checkpoint a run resumes from)."""
    for stream in self.streams:
      keep = int(np.frombuffer(self.lengths[stream], np.int64)[:num_docs].sum())
      del self.lengths[stream][num_docs:]
      f = self.files[stream]
      f.flush()
      if os.fstat(f.fileno()).st_size < 4 * keep:
        raise ValueError(f"{f.name}: shorter than the {keep} tokens its index lists")
      f.truncate(4 * keep)
      f.seek(4 * keep)
    del self.hashes[num_docs:]
    size = 8 * (len(self.streams) + 1) * num_docs
    self.index.flush()
    self.index.truncate(size)
    self.index.seek(size)

  def close(self) -> dict[str, np.ndarray]:
    """Closes the pending files; returns each stream's document offsets (int64 ``[n + 1]``)."""
    offsets = {}
    self.index.close()
    for stream in self.streams:
      self.files[stream].close()
      lengths = np.frombuffer(self.lengths[stream], dtype=np.int64)
      offsets[stream] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return offsets

  def tokens(self, stream: str) -> FileTokens:
    """The pending tokens of ``stream`` (after ``close``), read a slice at a time."""
    return FileTokens(pending_file(self.out, stream))

  def remove(self) -> None:
    """Closes and deletes the pending files."""
    self.index.close()
    os.remove(self.index.name)
    for stream in self.streams:
      self.files[stream].close()
      if os.path.exists(pending_file(self.out, stream)):
        os.remove(pending_file(self.out, stream))


def _chunks(offsets: np.ndarray, docs: np.ndarray) -> Iterator[np.ndarray]:
  """``docs`` (sorted indices) in runs of about ``CHUNK_TOKENS`` tokens (at least one doc)."""
  start, ends = 0, offsets[docs + 1]
  while start < len(docs):
    limit = offsets[docs[start]] + CHUNK_TOKENS
    end = max(start + 1, int(np.searchsorted(ends, limit, side="right")))
    yield docs[start:end]
    start = end


def _gather(tokens: np.ndarray | FileTokens, offsets: np.ndarray, docs: np.ndarray) -> np.ndarray:
  """The tokens of ``docs`` (sorted indices), concatenated; reads their span only, and copies
  runs of consecutive documents as whole slices."""
  lo, hi = int(offsets[docs[0]]), int(offsets[docs[-1] + 1])
  span = np.asarray(tokens[lo:hi])
  breaks = np.flatnonzero(np.diff(docs) != 1) + 1
  if breaks.size == 0:
    return span
  firsts = offsets[docs[np.concatenate([[0], breaks])]] - lo
  ends = offsets[docs[np.concatenate([breaks - 1, [len(docs) - 1]])] + 1] - lo
  return np.concatenate([span[a:b] for a, b in zip(firsts.tolist(), ends.tolist())])


def id_counts(
  tokens: np.ndarray | FileTokens, offsets: np.ndarray, docs: np.ndarray, size: int
) -> np.ndarray:
  """How often each id in ``[0, size)`` occurs in the documents ``docs``, a chunk at a time."""
  counts = np.zeros(size, np.int64)
  for chunk in _chunks(offsets, docs):
    counts += np.bincount(_gather(tokens, offsets, chunk).astype(np.int64), minlength=size)[:size]
  return counts


class ShardWriter:
  """Writes one token stream as shards of at most ``shard_bytes`` bytes (``PREFIX_000.bin``,
  ``PREFIX_001.bin``, ...; a document may continue in the next shard), each to a temporary that is
  renamed when full: a shard file that exists is complete."""

  def __init__(self, out: str, prefix: str, shard_bytes: int):
    self.out, self.prefix = out, prefix
    self.limit = max(1, shard_bytes // 4)  # tokens a shard
    self.names: list[str] = []
    self.counts: list[int] = []
    self.file = None

  def _open(self) -> None:
    self.names.append(f"{self.prefix}_{len(self.names):03d}.bin")
    self.counts.append(0)
    self.file = open(os.path.join(self.out, self.names[-1] + ".tmp"), "wb")

  def _seal(self) -> None:
    self.file.close()
    name = os.path.join(self.out, self.names[-1])
    os.replace(name + ".tmp", name)
    self.file = None

  def write(self, tokens: np.ndarray) -> None:
    tokens = tokens.astype(np.uint32, copy=False)
    while tokens.size:
      if self.file is None:
        self._open()
      room = self.limit - self.counts[-1]
      tokens[:room].tofile(self.file)
      self.counts[-1] += min(room, tokens.size)
      tokens = tokens[room:]
      if self.counts[-1] == self.limit:
        self._seal()

  def close(self) -> tuple[list[str], list[int]]:
    """Seals the last shard (an empty stream gets one empty shard); returns the names and
    token counts of the shards."""
    if self.file is None and not self.names:
      self._open()
    if self.file is not None:
      self._seal()
    return self.names, self.counts


def write_split(
  out: str,
  prefix: str,
  tokens: np.ndarray | FileTokens,
  offsets: np.ndarray,
  docs: np.ndarray,
  remap: Callable[[np.ndarray], np.ndarray] | None,
  shard_bytes: int,
) -> dict[str, Any]:
  """Writes the documents ``docs`` (sorted indices into ``offsets``) as the stream ``prefix``
  (shards of at most ``shard_bytes`` and the document offsets, each written to a temporary and
  renamed); returns its metadata entry, whose ``shard_tokens`` is the shards' index."""
  writer = ShardWriter(out, prefix, shard_bytes)
  for chunk in _chunks(offsets, docs):
    part = _gather(tokens, offsets, chunk)
    writer.write(remap(part) if remap is not None else part)
  shards, counts = writer.close()
  offsets_file = f"{prefix}_offsets.npy"
  lengths = offsets[docs + 1] - offsets[docs]
  with open(os.path.join(out, offsets_file + ".tmp"), "wb") as f:
    np.save(f, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
  os.replace(os.path.join(out, offsets_file + ".tmp"), os.path.join(out, offsets_file))
  return {"shards": shards, "offsets": offsets_file, "tokens": sum(counts), "shard_tokens": counts}
