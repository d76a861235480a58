"""Streaming a corpus into the pending files of ``data.shards``: records read one at a time,
tokenized in batches by worker processes (``tokenizer_pool``), the progress bar (bytes read,
documents, tokens), and the checkpoint that lets an interrupted ``prepare`` resume.

The checkpoint (``progress.json`` in the output folder, replaced atomically) says how far the
pending files are good: the documents written, and the place in the inputs (file, and records of
that file) the next document comes from, with the counts of what was skipped so far. It is written
after the pending files are flushed, so what it names is on disk; a rerun with the same content
hash truncates the pending files to it and reads on from there.
"""

from __future__ import annotations

import collections
import concurrent.futures
import concurrent.futures.process
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from transformer_jax.data.files import size_of
from transformer_jax.data.readers import Record, read_records
from transformer_jax.data.shards import PendingDocs, document_hash
from transformer_jax.data.sources import Source, parse_synthetic, synthetic_examples
from transformer_jax.data.tokenizer import Tokenizer

PROGRESS_FILE = "progress.json"
BATCH_DOCS = 512  # documents tokenized together (split among the workers)
BATCH_CHARS = 1 << 22  # ... or fewer, when their text reaches 4 Mi characters
CHECKPOINT_SECONDS = 2.0  # the checkpoint is rewritten at most this often
_SHOWN_PROBLEMS = 10  # skipped problems printed one a line; the rest are counted
_PROGRESS_EVERY = 256  # records between progress bar updates


def new_stats() -> dict[str, int]:
  return {"undecodable_files": 0, "replaced": 0, "bad_records": 0, "bad_files": 0}


def first_place() -> dict[str, Any]:
  """Where a new preparation starts: the first input, nothing read, nothing counted."""
  return {"source": 0, "items": 0, "mark": 0, "replaced": 0, "stats": new_stats()}


def count_problem(problem, stats: dict[str, int], skip_bad: bool) -> None:
  """Raises ``ValueError`` naming ``problem`` (a ``readers.Problem``) unless ``skip_bad``; else
  prints the first few and counts it in ``stats``, as a bad file or a bad record."""
  if not skip_bad:
    raise ValueError(f"{problem}; --skip-bad skips and counts such input")
  if stats["bad_records"] + stats["bad_files"] < _SHOWN_PROBLEMS:
    print(f"skipped: {problem}", file=sys.stderr)
  stats["bad_files" if problem.whole_file else "bad_records"] += 1


def load_checkpoint(out: str, content_hash: str) -> dict[str, Any] | None:
  """The checkpoint an interrupted run left in ``out`` for the same content hash, else None."""
  try:
    with open(os.path.join(out, PROGRESS_FILE)) as f:
      state = json.load(f)
  except (OSError, ValueError):
    return None
  if not isinstance(state, dict) or state.get("content_hash") != content_hash:
    return None
  return state


def remove_checkpoint(out: str) -> None:
  for name in (PROGRESS_FILE, PROGRESS_FILE + ".tmp"):
    if os.path.exists(os.path.join(out, name)):
      os.remove(os.path.join(out, name))


_TOKENIZERS: dict[str, Tokenizer] = {}  # this process's tokenizers, by name


def _tokenizer(name: str) -> Tokenizer:
  if name not in _TOKENIZERS:
    _TOKENIZERS[name] = Tokenizer.from_name(name)
  return _TOKENIZERS[name]


def _worker_start(name: str, parent: int) -> None:
  """A tokenizing process's start: its tokenizer, and a thread that ends the process when its
  parent is gone (a killed ``prepare`` leaves no worker waiting on its queue)."""
  _tokenizer(name)

  def exit_with_parent() -> None:
    while os.getppid() == parent:
      time.sleep(0.5)
    os._exit(1)

  threading.Thread(target=exit_with_parent, daemon=True).start()


def tokenize_documents(
  name: str, seed: int, documents: list[tuple[str, ...]]
) -> list[tuple[list[np.ndarray], int]]:
  """Each document's texts as base-vocabulary uint32 ids, and its seeded content hash: what a
  worker returns for a part of a batch."""
  tok = _tokenizer(name)
  return [
    ([tok.encode_full_array(t) for t in texts], document_hash(texts, seed)) for texts in documents
  ]


def tokenizer_pool(workers: int, tok: Tokenizer) -> concurrent.futures.Executor:
  """The executor ``Pipeline`` tokenizes on: one thread beside the reading thread for one worker;
  else ``workers`` processes, each with its own tokenizer. tiktoken releases the GIL, but threads
  still contend for it to hand texts in and arrays out, and on two cores two tokenizing threads
  cost more CPU time than one without finishing sooner; processes do not share a GIL.

  Processes are forked (started in milliseconds, the tokenizer already loaded) unless this
  process has loaded JAX, whose threads make forking unsafe: then they are spawned (each loads
  the tokenizer once, in about 0.3 s). They are started here, before the progress bar's thread.

  Raises:
    RuntimeError: spawned processes ended as they started (``NOT_STARTED``: most often a script
      that calls ``prepare`` outside ``if __name__ == "__main__":``, which each spawned process
      runs again).
  """
  if workers == 1:
    return concurrent.futures.ThreadPoolExecutor(1)
  method = (
    "spawn"
    if "jax" in sys.modules or "fork" not in multiprocessing.get_all_start_methods()
    else "fork"
  )
  if method == "fork":
    _TOKENIZERS[tok.name] = tok
  pool = concurrent.futures.ProcessPoolExecutor(
    workers,
    mp_context=multiprocessing.get_context(method),
    initializer=_worker_start,
    initargs=(tok.name, os.getpid()),
  )
  try:
    for started in [pool.submit(_tokenizer, tok.name) for _ in range(workers)]:
      started.result()
  except BaseException as e:
    pool.shutdown(wait=False, cancel_futures=True)
    if method == "spawn" and isinstance(e, concurrent.futures.process.BrokenProcessPool):
      raise RuntimeError(NOT_STARTED.format(workers=workers)) from e
    raise
  return pool


# What ``tokenizer_pool`` says when its spawned processes end as they start.
NOT_STARTED = (
  "prepare's {workers} tokenizing processes ended as they started (their error is above). They "
  "are spawned (JAX is loaded, or this platform cannot fork), and a spawned process first runs the "
  "main script again: call prepare under `if __name__ == \"__main__\":`, or pass workers=1"
)


def split_by_size(documents: list[tuple[str, ...]], parts: int) -> list[list[tuple[str, ...]]]:
  """``documents`` cut in order into at most ``parts`` runs of about equal characters (the
  tokenizer's work), none empty: each worker's share of a batch."""
  sizes = np.cumsum([sum(len(t) for t in texts) + 1 for texts in documents])
  cuts = np.searchsorted(sizes, sizes[-1] * np.arange(1, parts) / parts, side="right")
  bounds = [0, *sorted({int(c) for c in cuts if 0 < c < len(documents)}), len(documents)]
  return [documents[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


class Pipeline:
  """Records in, tokenized documents appended to ``PendingDocs`` in arrival order: each batch is
  split among the ``workers`` of ``pool`` (``tokenizer_pool``) with at most ``workers`` batches
  in flight, so memory holds a few batches, never the corpus. Each batch carries the place in the
  inputs after its last record; once it is written, that place is checkpointed."""

  def __init__(
    self,
    pool,
    workers: int,
    tok: Tokenizer,
    seed: int,
    pending: PendingDocs,
    content_hash: str,
  ):
    self.pool, self.workers, self.tok, self.seed, self.pending = pool, workers, tok, seed, pending
    self.content_hash = content_hash
    self.batch: list[Record] = []
    self.chars = 0
    self.added = pending.num_docs  # records handed in (written, in flight or batched)
    self.in_flight: collections.deque = collections.deque()
    self.saved_at = 0.0
    self.written: dict[str, Any] | None = None  # the place of the last batch written

  def add(self, record: Record) -> bool:
    """Batches ``record``; True when the batch is full (``submit`` it)."""
    self.batch.append(record)
    self.added += 1
    self.chars += sum(len(t) for t in record.texts)
    return len(self.batch) >= BATCH_DOCS or self.chars >= BATCH_CHARS

  def submit(self, place: dict[str, Any]) -> None:
    """Sends the batch to the pool; ``place`` is where the inputs stand after it."""
    if self.batch:
      futures = [
        self.pool.submit(tokenize_documents, self.tok.name, self.seed, part)
        for part in split_by_size([r.texts for r in self.batch], self.workers)
      ]
      self.in_flight.append((futures, {**place, "docs": self.added}))
      self.batch, self.chars = [], 0
    while len(self.in_flight) > self.workers:
      self._write_oldest()

  def _write_oldest(self) -> None:
    futures, place = self.in_flight.popleft()
    for future in futures:
      self.pending.extend(future.result())
    self.written = place
    if time.monotonic() - self.saved_at >= CHECKPOINT_SECONDS:
      self.checkpoint(place)

  def checkpoint(self, place: dict[str, Any]) -> None:
    """Records ``place`` (whose documents are all written) as the point to resume from."""
    self.pending.flush()
    path = os.path.join(self.pending.out, PROGRESS_FILE)
    with open(path + ".tmp", "w") as f:
      json.dump({"content_hash": self.content_hash, **place}, f)
    os.replace(path + ".tmp", path)
    self.saved_at = time.monotonic()

  def drain(self, place: dict[str, Any]) -> None:
    self.submit(place)
    while self.in_flight:
      self._write_oldest()

  def rollback(self, mark: int, place: dict[str, Any]) -> None:
    """Drops every record handed in after the first ``mark``; checkpoints ``place``."""
    self.drain(place)
    self.pending.truncate(mark)
    self.added = mark
    self.written = {**place, "docs": mark}
    self.checkpoint(self.written)


def _synthetic_records(specs: list[str], seed: int) -> Iterator[Record]:
  for spec in specs:
    name, count = parse_synthetic(spec)
    for i, pair in enumerate(synthetic_examples(name, count, seed)):
      yield Record(pair, f"{spec}:{i}")


class _Bar:
  """The progress bar: input bytes read (its rate in MB/s), documents and tokens written."""

  def __init__(self, sizes: list[int | None], enabled: bool, pending: PendingDocs):
    known = None if None in sizes else sum(sizes)
    self.bar = tqdm(
      total=known, desc="preparing", unit="B", unit_scale=True, disable=not enabled, smoothing=0.1
    )
    self.pending, self.done, self.raw = pending, 0, None

  def opened(self, raw) -> None:
    self.raw = raw

  def update(self, base: int) -> None:
    """Bytes read: ``base`` before this file, and where its file handle stands."""
    try:
      at = base + self.raw.tell() if self.raw is not None else base
    except (OSError, ValueError):  # closed, or not seekable
      at = base
    if at > self.done:
      self.bar.update(at - self.done)
      self.done = at
    docs, tokens = self.pending.num_docs, self.pending.num_tokens
    self.bar.set_postfix_str(f"{docs:,} docs, {tokens:,} tokens", refresh=False)

  def close(self) -> None:
    self.bar.close()


def stream_corpus(
  sources: list[Source],
  synthetic: list[str],
  pipeline: Pipeline,
  *,
  text_field: str,
  allow_undecodable: bool,
  skip_bad: bool,
  seed: int,
  progress: bool,
  start: dict[str, Any] | None = None,
) -> dict[str, Any]:
  """Reads every record into ``pipeline``, from the checkpoint ``start`` when given; returns the
  counts of what was replaced and skipped. A problem raises ``ValueError`` naming its place
  unless ``skip_bad``."""
  try:
    return _stream(
      sources, synthetic, pipeline, text_field, allow_undecodable, skip_bad, seed, progress, start
    )
  except KeyboardInterrupt:  # what is written is kept: the rerun reads on after it
    if pipeline.written is not None:
      pipeline.checkpoint(pipeline.written)
    raise


def _stream(
  sources, synthetic, pipeline, text_field, allow_undecodable, skip_bad, seed, progress, start
):
  start = start or first_place()
  stats = dict(start["stats"])
  sizes: list[int | None] = [size_of(s.path) for s in sources] + ([None] if synthetic else [])
  bar = _Bar(sizes, progress, pipeline.pending)
  opened = bar.opened

  def reader(i: int) -> Iterator:
    if i == len(sources):
      return _synthetic_records(synthetic, seed)
    return read_records(sources[i], text_field, allow_undecodable, opened=opened)

  base = sum(sizes[: start["source"]] or [0]) if None not in sizes[: start["source"]] else 0
  for i in range(start["source"], len(sizes)):
    resumed = i == start["source"]
    mark = start["mark"] if resumed else pipeline.added
    replaced = start["replaced"] if resumed else 0
    skip = start["items"] if resumed else 0
    bar.raw = None

    def place(k: int) -> dict[str, Any]:
      return {"source": i, "items": k, "mark": mark, "replaced": replaced, "stats": dict(stats)}

    for k, item in enumerate(reader(i), start=1):
      if k <= skip:
        continue
      if k % _PROGRESS_EVERY == 0:
        bar.update(base)
      if isinstance(item, Record):
        replaced += item.replaced
        if pipeline.add(item):
          pipeline.submit(place(k))
        continue
      count_problem(item, stats, skip_bad)
      if item.whole_file:
        replaced = 0
        pipeline.rollback(mark, place(k))
    stats["replaced"] += replaced
    stats["undecodable_files"] += replaced > 0
    base += sizes[i] or 0
    bar.raw = None
    bar.update(base)
  end = {"source": len(sizes), "items": 0, "mark": pipeline.added, "replaced": 0, "stats": stats}
  pipeline.drain(end)
  pipeline.checkpoint(end)
  bar.update(base)
  bar.close()
  return stats
