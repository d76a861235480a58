"""Reading a prepared dataset directory: memory-mapped token streams with document offsets."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from transformer_jax.data.layout import FORMAT_VERSION, METADATA_FILE, read_metadata
from transformer_jax.data.tokenizer import Tokenizer


class ShardedTokens:
  """Several uint32 shards read as one array: ``size``, ``len``, ``np.asarray`` and indexing by an
  integer, a slice or an integer array give what the concatenated shards would, while only the
  indexed tokens are read (each shard stays memory-mapped)."""

  dtype = np.dtype(np.uint32)
  ndim = 1

  def __init__(self, shards: list[np.ndarray]):
    self.shards = shards
    sizes = np.array([s.size for s in shards], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    self.size = int(self.starts[-1])
    self.shape = (self.size,)

  def __len__(self) -> int:
    return self.size

  def __array__(self, dtype=None, copy=None) -> np.ndarray:
    whole = np.concatenate(self.shards) if self.shards else np.zeros(0, np.uint32)
    return whole if dtype is None else whole.astype(dtype)

  def _take(self, index: np.ndarray) -> np.ndarray:
    index = np.where(index < 0, index + self.size, index)
    if index.size and (index.min() < 0 or index.max() >= self.size):
      raise IndexError(f"index out of range for {self.size} tokens")
    shard = np.searchsorted(self.starts, index, side="right") - 1
    out = np.empty(index.shape, np.uint32)
    for k in np.unique(shard):
      sel = shard == k
      out[sel] = self.shards[k][index[sel] - self.starts[k]]
    return out

  def __getitem__(self, key):
    if isinstance(key, slice):
      start, stop, step = key.indices(self.size)
      if step != 1:
        return self._take(np.arange(start, stop, step, dtype=np.int64))
      if stop <= start:
        return np.zeros(0, np.uint32)
      first = int(np.searchsorted(self.starts, start, side="right")) - 1
      last = int(np.searchsorted(self.starts, stop, side="left"))
      pieces = [
        self.shards[k][max(start - self.starts[k], 0) : stop - self.starts[k]]
        for k in range(first, last)
      ]
      return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
    if isinstance(key, (int, np.integer)):
      return self._take(np.array([key], np.int64))[0]
    return self._take(np.asarray(key, np.int64))

  def max(self) -> int:
    return max(int(s.max()) for s in self.shards if s.size)


@dataclasses.dataclass(frozen=True)
class Stream:
  """A token stream cut into documents (or into the sources / targets of pairs).

  Attributes:
      tokens: uint32 ``[num_tokens]``: a read-only memmap for a single-shard stream, a
          ``ShardedTokens`` over the shards' memmaps for several.
      offsets: int64 ``[num_docs + 1]``; document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``.
  """

  tokens: np.ndarray
  offsets: np.ndarray

  @property
  def num_docs(self) -> int:
    return len(self.offsets) - 1

  @property
  def lengths(self) -> np.ndarray:
    return np.diff(self.offsets)

  def doc(self, d: int) -> np.ndarray:
    return np.asarray(self.tokens[self.offsets[d] : self.offsets[d + 1]])


class Dataset:
  """A prepared dataset: metadata, tokenizer and per-split streams.

  Text tasks (gpt, bert) have one stream per split, ``"tokens"``; seq2seq has ``"src"`` and
  ``"tgt"``.

  Attributes:
      path: Dataset directory.
      meta: Contents of ``metadata.json``.
      vocab_size: Model-facing vocabulary size.
  """

  def __init__(self, path: str, meta: dict[str, Any], streams: dict[str, dict[str, Stream]]):
    self.path = path
    self.meta = meta
    self.vocab_size = int(meta["vocab_size"])
    self._streams = streams
    self._tokenizer: Tokenizer | None = None

  @property
  def task(self) -> str:
    return self.meta["task"]

  @property
  def tokenizer(self) -> Tokenizer:
    """The tokenizer the dataset was prepared with (built lazily)."""
    if self._tokenizer is None:
      self._tokenizer = Tokenizer.from_metadata(self.meta, self.path)
    return self._tokenizer

  @property
  def splits(self) -> tuple[str, ...]:
    return tuple(self._streams)

  def stream(self, split: str, name: str = "tokens") -> Stream:
    """Returns one stream: ``name`` is ``"tokens"`` for text tasks, ``"src"``/``"tgt"`` for
    seq2seq."""
    if split not in self._streams:
      raise KeyError(f"unknown split {split!r}; dataset has {list(self._streams)}")
    if name not in self._streams[split]:
      raise KeyError(
        f"split {split!r} has no stream {name!r} (task {self.task!r} has "
        f"{list(self._streams[split])})"
      )
    return self._streams[split][name]

  def __repr__(self) -> str:
    counts = ", ".join(
      f"{s}={m['documents']} docs/{m['tokens']} tokens" for s, m in self.meta["splits"].items()
    )
    return f"Dataset({self.path!r}, task={self.task!r}, vocab_size={self.vocab_size}, {counts})"


def _load_stream(path: str, entry: dict[str, Any], vocab_size: int) -> Stream:
  shards = []
  index = entry.get("shard_tokens")
  for k, shard in enumerate(entry["shards"]):
    file = os.path.join(path, shard)
    size = os.path.getsize(file)
    if size % 4:
      raise ValueError(f"{file}: size {size} is not a whole number of uint32 tokens")
    if index is not None and size != 4 * index[k]:
      raise ValueError(
        f"{file}: {size // 4} tokens, the shard index in {METADATA_FILE} says {index[k]}; "
        "rebuild the dataset with `tjax prepare --force`"
      )
    tokens = np.memmap(file, dtype=np.uint32, mode="r") if size else np.zeros(0, np.uint32)
    if tokens.size:
      top = int(tokens.max())  # one vectorised pass over the shard
      if top >= vocab_size:
        position = int(np.argmax(tokens >= vocab_size))
        bad = int(tokens[position])
        raise ValueError(
          f"{file}: token id {bad} at position {position} is out of range for "
          f"vocab_size {vocab_size}"
        )
    shards.append(tokens)
  tokens = shards[0] if len(shards) == 1 else ShardedTokens(shards)
  offsets_file = os.path.join(path, entry["offsets"])
  try:
    offsets = np.load(offsets_file, allow_pickle=False)
  except (ValueError, EOFError) as e:  # truncated, or not an .npy array
    raise ValueError(f"{offsets_file}: not a document offsets array ({e})") from None
  if not np.issubdtype(offsets.dtype, np.integer):
    raise ValueError(
      f"{offsets_file}: document offsets of dtype {offsets.dtype}, expected integers"
    )
  if (
    offsets.ndim != 1
    or offsets.size == 0
    or offsets[0] != 0
    or offsets[-1] != tokens.size
    or np.any(np.diff(offsets) < 0)
  ):
    raise ValueError(
      f"{offsets_file}: document offsets are inconsistent with {tokens.size} tokens "
      f"in {entry['shards']}"
    )
  return Stream(tokens, offsets.astype(np.int64))


def load_dataset(path: str | os.PathLike) -> Dataset:
  """Opens a dataset directory written by ``prepare``, memory-mapping its shards.

  Every shard is checked against ``vocab_size`` (one vectorised max per shard).

  Raises:
      FileNotFoundError: ``path`` has no ``metadata.json``.
      ValueError: A damaged ``metadata.json`` (named, with how to rebuild it), an unsupported
          format version, a token id out of range (names the id, file and vocab size), or
          inconsistent offsets.
  """
  path = os.fspath(path)
  meta_file = os.path.join(path, METADATA_FILE)
  meta = read_metadata(path)
  if meta.get("format_version") != FORMAT_VERSION:
    raise ValueError(
      f"{meta_file}: format_version {meta.get('format_version')} is not supported "
      f"(expected {FORMAT_VERSION}); re-run `tjax prepare --force`"
    )
  vocab_size = int(meta["vocab_size"])
  streams = {
    split: {name: _load_stream(path, entry, vocab_size) for name, entry in m["streams"].items()}
    for split, m in meta["splits"].items()
  }
  return Dataset(path, meta, streams)
