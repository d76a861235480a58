"""Corpus preparation: text / JSON lines / Parquet / Arrow / tsv / stdlib / synthetic inputs ->
a tokenized dataset directory, as a stream.

The input names ``prepare`` takes are expanded by ``data.sources`` (files and URLs: ``data.files``)
and read a record at a time by ``data.readers``; batches of documents are tokenized by worker
processes (``data.stream``, which also checkpoints for resumption; or by a Ray Data job,
``data.ray_job``) and appended to pending files as they come (``data.shards``), then copied into
the train and val shards. The directory it writes (its files, ``metadata.json``, the content hash
and the train/val split) is ``data.layout``'s. A document's split is a seeded hash of its text:
the same documents give the same dataset in any input format and file layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.data import layout
from transformer_jax.data.classify import prepare_classify
from transformer_jax.data.layout import (
  COMPACT_VOCAB_FILE,
  FORMAT_VERSION,
  METADATA_FILE,
  SPLITS,
  TASKS,
  check_output_dir,
  read_metadata,
  split_by_hash,
)
from transformer_jax.data.shards import FileTokens, PendingDocs, id_counts, write_split
from transformer_jax.data.files import Source, is_url
from transformer_jax.data.sources import SYNTHETIC_TOKENIZER, parse_synthetic, resolve_inputs
from transformer_jax.data.stream import (
  Pipeline,
  load_checkpoint,
  remove_checkpoint,
  stream_corpus,
  tokenizer_pool,
)
from transformer_jax.data.tokenizer import CompactVocab, Tokenizer


DEFAULT_SHARD_BYTES = 1 << 30  # a token shard's size limit (1 GiB)
# A corpus under this size is tokenized in the calling process when ``workers`` is not given
# (``default_workers``); a synthetic example counts as 64 bytes.
SMALL_CORPUS_BYTES = 1 << 22
ENGINES = ("local", "ray")
_ENGINE_ALIASES = {"threads": "local"}  # the local engine's earlier name


def _ray_stream():
  from transformer_jax.data.ray_job import stream_corpus_ray  # noqa: PLC0415 (imports Ray's glue)

  return stream_corpus_ray


_ENGINE_STREAM = {"local": lambda: stream_corpus, "ray": _ray_stream}


def default_workers(sources: Sequence[Source], synthetic: Sequence[str]) -> int:
  """``workers``' default for these inputs (``resolve_inputs``' two lists): one a core this
  process may run on (``available_cores``), or 1 for a corpus of local files and synthetic
  examples under ``SMALL_CORPUS_BYTES``. Tokenizing 4 MiB takes about half a second on one core,
  while starting worker processes from a process that has loaded JAX takes about that each (they
  are spawned, ``stream.tokenizer_pool``): the trainer preparing a small corpus, a test."""
  total = 64 * sum(parse_synthetic(spec)[1] for spec in synthetic)
  for source in sources:
    if is_url(source.path):  # its size is a request away: a remote corpus is rarely small
      return available_cores()
    total += os.path.getsize(source.path)
    if total >= SMALL_CORPUS_BYTES:
      break
  return 1 if total < SMALL_CORPUS_BYTES else available_cores()


def available_cores() -> int:
  """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where the system
  does not say): ``--workers``' default past a small corpus (``default_workers``)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # macOS, Windows
    return os.cpu_count() or 1


def check_options(
  *,
  task: str,
  val_fraction: float,
  workers: int | None,
  compact_vocab: bool | int,
  text_field: str,
  shard_bytes: int = DEFAULT_SHARD_BYTES,
  engine: str = "local",
) -> None:
  """Refuses options ``prepare`` cannot honour, before any file is read.

  Raises:
      ValueError: an unknown task, a ``val_fraction`` that is negative, not finite or a fraction
          above 1, fewer than one worker, a ``compact_vocab`` count below 1, no text field, or a
          shard size limit below one token (4 bytes), or an unknown engine.
  """
  if task not in TASKS:
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
  if (
    isinstance(val_fraction, bool)
    or not isinstance(val_fraction, (int, float))
    or not 0 <= val_fraction < float("inf")
  ):
    raise ValueError(
      f"val_fraction={val_fraction}: expected a fraction in [0, 1) or a whole number of documents"
    )
  if val_fraction >= 1 and val_fraction != int(val_fraction):
    raise ValueError(f"val_fraction={val_fraction}: a value >= 1 is a whole document count")
  if workers is not None and (
    isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
  ):
    raise ValueError(f"workers={workers}: expected an integer >= 1")
  if not isinstance(compact_vocab, bool) and (
    not isinstance(compact_vocab, int) or compact_vocab < 1
  ):
    raise ValueError(f"compact_vocab={compact_vocab}: expected true, false or a count of ids >= 1")
  if not isinstance(text_field, str) or not text_field:
    raise ValueError(f"text_field={text_field!r}: expected a field name")
  if _ENGINE_ALIASES.get(engine, engine) not in ENGINES:
    raise ValueError(f"engine={engine!r}: expected one of {', '.join(ENGINES)}")
  if isinstance(shard_bytes, bool) or not isinstance(shard_bytes, int) or shard_bytes < 4:
    raise ValueError(f"shard_bytes={shard_bytes}: expected an integer >= 4 (one uint32 token)")


# ---- entry point ---------------------------------------------------------------------------------


def prepare(
  inputs: Sequence[str],
  out: str,
  *,
  tokenizer: str = "cl100k_base",
  compact_vocab: bool | int = False,
  task: str = "gpt",
  val_fraction: float = 0.05,
  seed: int = 0,
  workers: int | None = None,
  text_field: str = "text",
  force: bool = False,
  progress: bool = True,
  vocab_from: str | None = None,
  allow_undecodable: bool = False,
  skip_bad: bool = False,
  shard_bytes: int = DEFAULT_SHARD_BYTES,
  engine: str = "local",
) -> dict[str, Any]:
  """Tokenizes a corpus into a dataset directory (its layout: ``data.layout``).

  Args:
      inputs: Files, globs, directories, ``stdlib``, or ``synthetic:TASK[:COUNT]`` (seq2seq only).
      out: Output directory (created if needed).
      tokenizer: Tokenizer name (tiktoken encoding or ``chars:ALPHABET``); synthetic inputs always
          use ``chars:0123456789+``.
      compact_vocab: Re-number the ids the corpus uses (train and val) into a dense range (saves
          embedding rows); stored as ``vocab.json``. An integer ``N`` keeps only the ``N`` most
          frequent ids of the training documents (the rest become ``[UNK]``): for small CPU runs the
          softmax over the vocabulary dominates the step.
      task: ``"gpt"``, ``"bert"`` (same on-disk format), ``"seq2seq"`` (pairs) or ``"classify"``
          (labelled examples, see ``data.classify``).
      val_fraction: Fraction of documents for validation, or a whole number ``>= 1`` of validation
          documents.
      seed: Seed of the train/val split and of synthetic data.
      workers: Tokenizing workers (processes when more than one: ``stream.tokenizer_pool``);
          None: one a core this process may run on, or with the local engine 1 for a corpus
          under 4 MiB (``default_workers``).
      text_field: Field (column) holding the text in JSON lines, Parquet and Arrow inputs.
      force: Rebuild even if the directory is up to date.
      progress: Show a tqdm progress bar.
      vocab_from: ``classify`` only: a prepared dataset whose tokenizer and compact vocabulary to
          reuse (the ids of a model pretrained on it).
      allow_undecodable: Replace undecodable bytes by U+FFFD however many there are; by default
          a file where they are over ``readers.MAX_UNDECODABLE_FRACTION`` of its bytes is an error.
      skip_bad: Skip and count bad input (an undecodable file, an empty document, a missing text
          field, invalid JSON, a corrupt gzip/zstd stream or Parquet row group: the spoilt file
          is dropped whole) instead of stopping at the first, named by file and line, row group
          or record batch.
      shard_bytes: A token shard's size limit: a stream longer than that is written as several
          shards (``train_000.bin``, ``train_001.bin``, ...), listed with their token counts in
          the metadata; the loaders read them as one stream.
      engine: ``"local"`` (this machine's tokenizing workers, ``stream.tokenizer_pool``;
          ``"threads"`` is its earlier name) or ``"ray"`` (a Ray Data job reads and tokenizes the
          files, ``data.ray_job``; the same dataset, byte for byte).

  Returns:
      The metadata dict written to ``out/metadata.json``.

  Raises:
      FileNotFoundError: An input name matches no files.
      ValueError: Bad options, a file that is not text (compressed, columnar, binary, or more
          undecodable bytes than allowed), malformed jsonl/tsv lines, or an empty corpus.
  """
  check_options(
    task=task,
    val_fraction=val_fraction,
    workers=workers,
    compact_vocab=compact_vocab,
    text_field=text_field,
    shard_bytes=shard_bytes,
    engine=engine,
  )
  check_output_dir(out)
  engine = _ENGINE_ALIASES.get(engine, engine)
  if task == "classify":
    return prepare_classify(
      inputs,
      out,
      tokenizer=tokenizer,
      vocab_from=vocab_from,
      val_fraction=val_fraction,
      seed=seed,
      force=force,
    )
  if vocab_from is not None and task == "seq2seq":
    raise ValueError("vocab_from is for text and classify datasets, not task='seq2seq'")
  sources, synthetic = resolve_inputs(inputs, task)
  if synthetic:
    tokenizer = SYNTHETIC_TOKENIZER
  if workers is None:  # a Ray job's local instance takes every core whatever the corpus
    workers = default_workers(sources, synthetic) if engine == "local" else available_cores()
  tok = Tokenizer.from_name(tokenizer)
  reused = None
  if vocab_from is not None:  # another dataset's ids (a model pretrained on it reads these)
    src_meta = read_metadata(vocab_from)
    tokenizer = src_meta["tokenizer"]
    if src_meta.get("compact_vocab"):
      reused = CompactVocab.load(os.path.join(vocab_from, src_meta["compact_vocab"]))
    tok = Tokenizer.from_name(tokenizer)
    compact_vocab = False
  options = {
    "format_version": FORMAT_VERSION,
    "task": task,
    "tokenizer": tokenizer,
    "compact_vocab": compact_vocab if isinstance(compact_vocab, bool) else int(compact_vocab),
    "val_fraction": val_fraction,
    "seed": seed,
    "text_field": text_field,
    "synthetic": synthetic,
    "split_by": "content",  # a document's side is a hash of its text and the seed
    **({"allow_undecodable": True} if allow_undecodable else {}),
    **({"skip_bad": True} if skip_bad else {}),
    **({"shard_bytes": shard_bytes} if shard_bytes != DEFAULT_SHARD_BYTES else {}),
    **({"vocab_from": reused.to_json()} if reused is not None else {}),
  }
  content_hash = layout.content_hash(options, sources, max(1, workers))
  if not force and (meta := layout.is_up_to_date(out, content_hash)) is not None:
    print(f"{out} is up to date (content hash {content_hash[:12]}); nothing to do")
    return meta

  os.makedirs(out, exist_ok=True)
  meta_path = os.path.join(out, METADATA_FILE)
  if os.path.exists(meta_path):
    os.remove(meta_path)  # a half-rewritten directory must never look up to date
  streams = ("src", "tgt") if task == "seq2seq" else ("tokens",)
  pending, start = _open_pending(out, streams, content_hash, force)
  try:
    # Ray's tasks tokenize for the ray engine: no local workers.
    with tokenizer_pool(workers, tok) if engine == "local" else contextlib.nullcontext() as pool:
      stats = _ENGINE_STREAM[engine]()(
        sources,
        synthetic,
        Pipeline(pool, workers, tok, seed, pending, content_hash),
        text_field=text_field,
        allow_undecodable=allow_undecodable,
        skip_bad=skip_bad,
        seed=seed,
        progress=progress,
        start=start,
      )
    offsets = pending.close()
    tokens = {s: pending.tokens(s) for s in streams}
    lengths = sum(np.diff(offsets[s]) for s in streams)
    # Empty documents carry nothing for text tasks (a seq2seq pair keeps an empty side).
    kept = np.flatnonzero(lengths > 0) if task != "seq2seq" else np.arange(len(lengths))
    if kept.size == 0 or int(lengths.sum()) == 0:
      raise ValueError(f"empty corpus: inputs {list(inputs)} contain no text")
    hashes = np.frombuffer(pending.hashes, dtype=np.uint64)[kept]
    is_val = split_by_hash(hashes / 2.0**64, val_fraction)
    meta = _write_dataset(
      out, task, tok, streams, tokens, offsets, kept, is_val, compact_vocab, reused, shard_bytes
    )
  except ValueError:  # bad input: what was read is of no use to a rerun on other input
    pending.remove()
    remove_checkpoint(out)
    raise
  except KeyboardInterrupt:
    print(f"\ninterrupted: the same command resumes {out} where it stopped", file=sys.stderr)
    raise
  if stats["replaced"]:
    print(
      f"warning: {stats['replaced']} undecodable byte sequences in {stats['undecodable_files']} "
      "file(s) were replaced by U+FFFD",
      file=sys.stderr,
    )
  if stats["bad_records"] or stats["bad_files"]:
    print(
      f"warning: skipped {stats['bad_records']} bad record(s) and {stats['bad_files']} bad file(s)",
      file=sys.stderr,
    )
  meta = {
    **options,
    "content_hash": content_hash,
    **meta,
    "dtype": "uint32",
    "inputs": list(inputs),
    "num_files": len(sources),
    "undecodable": {
      "files": stats["undecodable_files"],
      "replacement_chars": stats["replaced"],
    },
    "skipped": {
      "records": stats["bad_records"],
      "files": stats["bad_files"],
      "empty_documents": int(len(lengths) - kept.size),
    },
  }
  with open(meta_path + ".tmp", "w") as f:
    json.dump(meta, f, indent=2)
  pending.remove()
  remove_checkpoint(out)
  os.replace(meta_path + ".tmp", meta_path)
  layout.remove_unlisted_shards(out, meta)
  return meta


def _open_pending(
  out: str, streams: tuple[str, ...], content_hash: str, force: bool
) -> tuple[PendingDocs, dict[str, Any] | None]:
  """The pending files: those an interrupted run on the same content left, truncated to its
  checkpoint (which is returned), or new ones."""
  start = None if force else load_checkpoint(out, content_hash)
  if start is not None:
    try:
      pending = PendingDocs(out, streams, resume_docs=start["docs"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      print(f"not resuming {out} ({e}); starting over", file=sys.stderr)
    else:
      print(f"resuming {out}: {pending.num_docs} documents already tokenized", file=sys.stderr)
      return pending, start
  remove_checkpoint(out)
  return PendingDocs(out, streams), None


def _write_dataset(
  out: str,
  task: str,
  tok: Tokenizer,
  streams: tuple[str, ...],
  tokens: dict[str, FileTokens],
  offsets: dict[str, np.ndarray],
  kept: np.ndarray,
  is_val: np.ndarray,
  compact_vocab: bool | int,
  reused: CompactVocab | None,
  shard_bytes: int,
) -> dict[str, Any]:
  """Copies the pending documents ``kept`` into the train and val streams, re-numbered by the
  compact vocabulary (``reused``, or one built here); returns the metadata it settles."""
  compact = reused
  if compact_vocab:
    # The GPT separator is always kept.
    base_eot = [] if tok.base_eot_id is None else [tok.base_eot_id]
    size = tok.base_vocab_size
    if compact_vocab is True:
      used = sum(id_counts(tokens[s], offsets[s], kept, size) for s in streams)
      ids = np.flatnonzero(used)
    else:
      # Capped: the `compact_vocab` most frequent ids of the training documents; the rest -> [UNK].
      counts = id_counts(tokens[streams[0]], offsets[streams[0]], kept[~is_val], size)
      order = np.argsort(-counts, kind="stable")[: int(compact_vocab)]
      ids = order[counts[order] > 0]
    compact = CompactVocab(np.unique(np.concatenate([ids, np.array(base_eot, np.int64)])), size)
  remap = compact.to_compact if compact is not None else None
  splits = {}
  for split in SPLITS:
    docs = kept[is_val] if split == "val" else kept[~is_val]
    written = {
      s: write_split(
        out,
        split if s == "tokens" else f"{split}_{s}",
        tokens[s],
        offsets[s],
        docs,
        remap,
        shard_bytes,
      )
      for s in streams
    }
    splits[split] = {
      "documents": int(docs.size),
      "tokens": sum(w["tokens"] for w in written.values()),
      "streams": written,
    }
  if compact is not None:
    compact.save(os.path.join(out, COMPACT_VOCAB_FILE))
    tok = Tokenizer(tok.name, compact)
  return {
    "vocab_size": tok.vocab_size,
    "num_regular_tokens": tok.num_regular,
    "special_tokens": tok.special_ids,
    "compact_vocab": COMPACT_VOCAB_FILE if compact is not None else None,
    "splits": splits,
  }
