"""The prepared dataset directory: its files and ``metadata.json``, the checks that a folder holds
one and that its metadata is sound, the content hash that says it is up to date, the seeded
train/val split of its documents, and writing one token stream.

Layout of a dataset directory (all token shards are raw little-endian uint32, written with
``ndarray.tofile``)::

    metadata.json            tokenizer, vocab_size, special ids, per-split counts, content hash, ...
    vocab.json               CompactVocab (only with compact_vocab=True)
    train_000.bin            text tasks (gpt, bert): concatenated document tokens, no separators
    train_001.bin, ...       the stream's next shards, when it is longer than the shard size limit
                             (``shard_tokens`` in its metadata entry: the tokens of each shard)
    train_offsets.npy        int64 [num_docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
                             (positions in the stream, its shards concatenated)
    val_000.bin, val_offsets.npy
    all_000.bin.tmp          (while preparing) every document's tokens in arrival order
    all_index.bin.tmp        (while preparing) each document's length and split hash
    progress.json            (while preparing) how far the pending files are good: an
                             interrupted run resumes from it (``data.stream``)
    train_src_000.bin, train_src_offsets.npy,
    train_tgt_000.bin, train_tgt_offsets.npy   (seq2seq pairs)

Documents are stored without separators; the GPT loader inserts ``<|endoftext|>`` after every
document on the fly, so one prepared directory serves both GPT and BERT.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.data.files import Source, open_binary

FORMAT_VERSION = 1
TASKS = ("gpt", "bert", "seq2seq", "classify")
SPLITS = ("train", "val")
METADATA_FILE = "metadata.json"
COMPACT_VOCAB_FILE = "vocab.json"


# ---- content hash --------------------------------------------------------------------------------


def _file_digest(path: str) -> str:
  h = hashlib.sha256()
  with open_binary(path) as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def content_hash(options: dict[str, Any], sources: list[Source], workers: int) -> str:
  """The hex SHA-256 of the options and of every source's key, kind and bytes (read on
  ``workers`` threads): ``metadata.json``'s ``content_hash``, equal exactly when a rebuild would
  write the same dataset."""
  h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
  # hashlib releases the GIL on big reads. A few files at a time: a future a file would cost
  # memory in proportion to the number of files.
  step = 64 * workers
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    for i in range(0, len(sources), step):
      part = sources[i : i + step]
      for source, digest in zip(part, pool.map(lambda s: _file_digest(s.path), part)):
        packed = f"\0{source.compression}" if source.compression else ""
        h.update(f"{source.key}\0{source.kind}{packed}\0{digest}\n".encode())
  return h.hexdigest()


# ---- splitting and writing -----------------------------------------------------------------------


def _split_hash(seed: int, key: str) -> float:
  digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


def split_documents(keys: Sequence[str], val_fraction: float, seed: int) -> np.ndarray:
  """Assigns documents to validation by a seeded hash of their keys (``split_by_hash``).

  Args:
      keys: Stable document names (paths, ``path:line``).
      val_fraction: Fraction of documents in ``[0, 1)``, or an integer count ``>= 1`` of
          validation documents.
      seed: Split seed.
  """
  return split_by_hash(np.array([_split_hash(seed, k) for k in keys], np.float64), val_fraction)


def split_by_hash(hashes: np.ndarray, val_fraction: float) -> np.ndarray:
  """Assigns documents to validation by their hashes (uniform in ``[0, 1)``, one a document):
  those below ``val_fraction``, or the ``val_fraction`` lowest for a whole count ``>= 1``.

  Returns:
      Bool array ``[num_docs]``, True for validation. With two or more documents and a non-zero
      fraction, both splits are non-empty.
  """
  n = len(hashes)
  if not val_fraction >= 0 or val_fraction == float("inf"):  # NaN fails the comparison
    raise ValueError(f"val_fraction must be a finite number >= 0, got {val_fraction}")
  if val_fraction >= 1:
    if val_fraction != int(val_fraction):
      raise ValueError(f"val_fraction >= 1 must be a whole document count, got {val_fraction}")
    is_val = np.zeros(n, dtype=bool)
    is_val[np.argsort(hashes, kind="stable")[: min(int(val_fraction), max(n - 1, 0))]] = True
    return is_val
  is_val = hashes < val_fraction
  if n >= 2 and val_fraction > 0:
    if not is_val.any():
      is_val[np.argmin(hashes)] = True
    if is_val.all():
      is_val[np.argmax(hashes)] = False
  return is_val


def write_stream(out: str, prefix: str, arrays: list[np.ndarray]) -> dict[str, Any]:
  """Writes one token stream (shard + offsets) atomically; returns its metadata entry."""
  lengths = np.array([len(a) for a in arrays], dtype=np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = np.concatenate(arrays).astype(np.uint32) if arrays else np.zeros(0, np.uint32)
  shard, offsets_file = f"{prefix}_000.bin", f"{prefix}_offsets.npy"
  tokens.tofile(os.path.join(out, shard + ".tmp"))
  os.replace(os.path.join(out, shard + ".tmp"), os.path.join(out, shard))
  with open(os.path.join(out, offsets_file + ".tmp"), "wb") as f:
    np.save(f, offsets)
  os.replace(os.path.join(out, offsets_file + ".tmp"), os.path.join(out, offsets_file))
  return {"shards": [shard], "offsets": offsets_file, "tokens": int(tokens.size)}


def _shard_files(meta: dict[str, Any]) -> list[tuple[str, int | None]]:
  """Every shard ``meta`` lists, with its token count where the shard index gives one."""
  out = []
  for split in meta["splits"].values():
    for s in split["streams"].values():
      counts = s.get("shard_tokens") or [None] * len(s["shards"])
      out.extend(zip(s["shards"], counts))
  return out


def remove_unlisted_shards(out: str, meta: dict[str, Any]) -> None:
  """Deletes the token shards in ``out`` that ``meta`` does not list (left by an earlier build
  with more shards)."""
  listed = {name for name, _ in _shard_files(meta)}
  for entry in os.listdir(out):
    if _SHARD.match(entry) and entry not in listed:
      os.remove(os.path.join(out, entry))


def is_up_to_date(out: str, content_hash: str) -> dict[str, Any] | None:
  """The metadata of the dataset in ``out`` when it was built with ``content_hash`` and all its
  files are there; None when it must be (re)built (missing, damaged or another content)."""
  path = os.path.join(out, METADATA_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path, "rb") as f:
      meta = json.loads(f.read())
  except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: rebuilt
    return None
  if not isinstance(meta, dict) or metadata_problem(meta) is not None:
    return None
  if meta.get("content_hash") != content_hash:
    return None
  files = [s["offsets"] for split in meta["splits"].values() for s in split["streams"].values()]
  if meta.get("compact_vocab"):
    files.append(meta["compact_vocab"])
  if not all(os.path.exists(os.path.join(out, f)) for f in files):
    return None
  for name, count in _shard_files(meta):
    path = os.path.join(out, name)
    if not os.path.exists(path) or (count is not None and os.path.getsize(path) != 4 * count):
      return None
  return meta


# ---- the directory's files and metadata ----------------------------------------------------------

# The files ``prepare`` writes (and their temporaries): a folder holding anything else is not a
# dataset, and is not written into.
_SHARD = re.compile(r"^(?:train|val)(?:_src|_tgt|_b)?_\d+\.bin$")
_DATASET_FILE = re.compile(
  r"^(?:(?:train|val|all)(?:_src|_tgt|_b)?(?:_\d+\.bin|_offsets\.npy|"
  r"_labels\.npy)|all_index\.bin|progress\.json|vocab\.json|metadata\.json)(?:\.tmp)?$"
)


def check_output_dir(out: str) -> None:
  """Refuses an output path that is not a folder, or a folder that holds files other than a
  prepared dataset's (a rebuild replaces the dataset's own files; it never writes over others).

  Raises:
      ValueError: naming the folder and (some of) the other files.
  """
  if not os.path.lexists(out):
    return
  if not os.path.isdir(out):
    raise ValueError(f"--out {out} exists and is not a directory")
  foreign = sorted(e for e in os.listdir(out) if not _DATASET_FILE.match(e))
  if foreign:
    more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
    raise ValueError(
      f"{out} holds files that are not a prepared dataset's "
      f"({', '.join(foreign[:5])}{more}); give a new or empty directory"
    )


def read_metadata(path: str) -> dict[str, Any]:
  """The ``metadata.json`` of the dataset directory ``path``.

  Raises:
      FileNotFoundError: ``path`` holds no ``metadata.json``.
      ValueError: The file is damaged (not a JSON object); the message names it and how to
          rebuild it.
  """
  meta_file = os.path.join(path, METADATA_FILE)
  if not os.path.exists(meta_file):
    raise FileNotFoundError(
      f"{path!r} is not a prepared dataset (no {METADATA_FILE}); run `tjax prepare`"
    )
  with open(meta_file, "rb") as f:
    raw = f.read()
  try:
    meta = json.loads(raw)
    problem = None if isinstance(meta, dict) else f"a JSON {type(meta).__name__}, not an object"
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    problem = str(e)
  if problem is None:
    problem = metadata_problem(meta)
  if problem is not None:
    raise ValueError(
      f"{meta_file} is damaged ({problem}); rebuild the dataset with `tjax prepare "
      f"... --out {path}`, or delete {path} for `tjax train` to prepare it again from "
      "data.inputs"
    )
  return meta


# The streams each task's splits hold (classify may add "tokens_b", the second texts of pairs).
_STREAMS = {
  "gpt": {"tokens"},
  "bert": {"tokens"},
  "seq2seq": {"src", "tgt"},
  "classify": {"tokens"},
}


def _count(value: Any, low: int = 0) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _file_name(value: Any) -> bool:
  """A plain file name: the dataset's files all lie in its own folder."""
  return (
    isinstance(value, str)
    and value not in ("", ".", "..")
    and "/" not in value
    and os.sep not in value
  )


def metadata_problem(meta: dict[str, Any]) -> str | None:
  """What is wrong with a ``metadata.json`` object, naming the field (None: nothing). Checks
  every field a reader uses: ``task``, ``tokenizer``, ``vocab_size``, ``num_regular_tokens``,
  ``special_tokens`` (ids inside the vocabulary), ``compact_vocab``, the splits' counts and
  stream files (plain names, inside the dataset's folder) and a classification set's labels."""
  if meta.get("format_version") != FORMAT_VERSION:
    return None  # load_dataset names an unsupported version itself
  task, vocab = meta.get("task"), meta.get("vocab_size")
  checks = (
    ("task", task in TASKS, f"one of {', '.join(TASKS)}"),
    ("tokenizer", isinstance(meta.get("tokenizer"), str), "a tokenizer name"),
    ("vocab_size", _count(vocab, 1), "an integer >= 1"),
  )
  for field, ok, expected in checks:
    if not ok:
      return f"{field}={meta.get(field)!r}: expected {expected}"
  if not (_count(meta.get("num_regular_tokens")) and meta["num_regular_tokens"] <= vocab):
    return (
      f"num_regular_tokens={meta.get('num_regular_tokens')!r}: expected an integer in [0, {vocab}]"
    )
  specials = meta.get("special_tokens")
  if not isinstance(specials, dict):
    return f"special_tokens={specials!r}: expected an object (name -> id)"
  for name, i in specials.items():
    if not (_count(i) and i < vocab):
      return f"special_tokens.{name}={i!r}: expected an id in [0, {vocab})"
  if meta.get("compact_vocab") is not None and not _file_name(meta["compact_vocab"]):
    return f"compact_vocab={meta['compact_vocab']!r}: expected a file name inside the dataset"
  splits = meta.get("splits")
  if not isinstance(splits, dict) or not splits or not set(splits) <= set(SPLITS):
    return f"splits={splits!r}: expected an object with the splits {', '.join(SPLITS)}"
  for split, m in splits.items():
    if not isinstance(m, dict):
      return f"splits.{split}: expected an object"
    for key in ("documents", "tokens"):
      if not _count(m.get(key)):
        return f"splits.{split}.{key}={m.get(key)!r}: expected an integer >= 0"
    streams = m.get("streams")
    want = _STREAMS[task]
    have = set(streams) if isinstance(streams, dict) else set()
    if not isinstance(streams, dict) or not want <= have or not have <= want | {"tokens_b"}:
      return f"splits.{split}.streams: expected the streams {', '.join(sorted(want))}"
    for name, entry in streams.items():
      where = f"splits.{split}.streams.{name}"
      if not isinstance(entry, dict):
        return f"{where}: expected an object"
      shards = entry.get("shards")
      if not (isinstance(shards, list) and shards and all(_file_name(x) for x in shards)):
        return f"{where}.shards={shards!r}: expected a list of file names inside the dataset"
      index = entry.get("shard_tokens")
      if index is not None and not (
        isinstance(index, list) and len(index) == len(shards) and all(_count(n) for n in index)
      ):
        return f"{where}.shard_tokens={index!r}: expected a token count for each shard"
      if not _file_name(entry.get("offsets")):
        return f"{where}.offsets={entry.get('offsets')!r}: expected a file name inside the dataset"
  if task == "classify":
    labels = meta.get("labels")
    if not (isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels)):
      return f"labels={labels!r}: expected a list of label names"
  return None
