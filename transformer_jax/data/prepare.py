"""Corpus preparation: text / jsonl / tsv / stdlib / synthetic inputs -> a tokenized dataset
directory.

The input names ``prepare`` takes are expanded by ``data.sources``; the directory it writes (its
files, ``metadata.json``, the content hash and the train/val split) is ``data.layout``'s.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

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
  split_documents,
)
from transformer_jax.data.sources import (
  SYNTHETIC_TOKENIZER,
  Source,
  parse_synthetic,
  resolve_inputs,
  synthetic_examples,
)
from transformer_jax.data.tokenizer import CompactVocab, Tokenizer


# Above this fraction of a file's bytes, undecodable bytes mean the file is not UTF-8 text (a
# binary, compressed or other-encoding file): an error naming it, unless the caller allows them.
MAX_UNDECODABLE_FRACTION = 0.001


@dataclasses.dataclass
class _FileResult:
  """Tokenized documents of one file: keys and token arrays (one array per document, or a pair)."""

  keys: list[str]
  tokens: list[np.ndarray]
  targets: list[np.ndarray] | None
  replaced_chars: int


# ---- reading and tokenizing ----------------------------------------------------------------------


def _decode(data: bytes) -> tuple[str, int]:
  """UTF-8 decode; undecodable bytes become U+FFFD. Returns (text, number of replacement
  characters added)."""
  try:
    return data.decode("utf-8"), 0
  except UnicodeDecodeError:
    text = data.decode("utf-8", errors="replace")
    return text, text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")


def _as_ids(ids: list[int]) -> np.ndarray:
  return np.asarray(ids, dtype=np.uint32)


def _check_undecodable(path: str, replaced: int, size: int, allow: bool) -> None:
  if not allow and replaced > MAX_UNDECODABLE_FRACTION * size:
    raise ValueError(
      f"{path}: {replaced} undecodable byte sequences in {size} bytes (over "
      f"{MAX_UNDECODABLE_FRACTION:.1%}): not UTF-8 text; --allow-undecodable replaces them by "
      "U+FFFD"
    )


def _tokenize_source(
  source: Source, tokenizer: Tokenizer, text_field: str, allow_undecodable: bool = False
) -> _FileResult:
  with open(source.path, "rb") as f:
    data = f.read()
  text, replaced = _decode(data)
  _check_undecodable(source.path, replaced, len(data), allow_undecodable)
  if source.kind == "text":
    return _FileResult([source.key], [_as_ids(tokenizer.encode_full(text))], None, replaced)
  keys, tokens, targets = [], [], []
  for lineno, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    where = f"{source.path}:{lineno}"
    if source.kind == "jsonl":
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
      if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"{where}: expected an object with a string field {text_field!r}")
      tokens.append(_as_ids(tokenizer.encode_full(record[text_field])))
    else:  # tsv
      if "\t" not in line:
        raise ValueError(f"{where}: expected 'source<TAB>target'")
      src, tgt = line.split("\t", 1)
      tokens.append(_as_ids(tokenizer.encode_full(src)))
      targets.append(_as_ids(tokenizer.encode_full(tgt)))
    keys.append(f"{source.key}:{lineno}")
  return _FileResult(keys, tokens, targets if source.kind == "tsv" else None, replaced)


def check_options(
  *, task: str, val_fraction: float, workers: int, compact_vocab: bool | int, text_field: str
) -> None:
  """Refuses options ``prepare`` cannot honour, before any file is read.

  Raises:
      ValueError: an unknown task, a ``val_fraction`` that is negative, not finite or a fraction
          above 1, fewer than one worker, a ``compact_vocab`` count below 1, or no text field.
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
  if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
    raise ValueError(f"workers={workers}: expected an integer >= 1")
  if not isinstance(compact_vocab, bool) and (
    not isinstance(compact_vocab, int) or compact_vocab < 1
  ):
    raise ValueError(f"compact_vocab={compact_vocab}: expected true, false or a count of ids >= 1")
  if not isinstance(text_field, str) or not text_field:
    raise ValueError(f"text_field={text_field!r}: expected a field name")


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
  workers: int = 2,
  text_field: str = "text",
  force: bool = False,
  progress: bool = True,
  vocab_from: str | None = None,
  allow_undecodable: bool = False,
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
      workers: Threads for reading and tokenizing (tiktoken's BPE releases the GIL, so threads use
          all cores without process start-up cost or fork-after-JAX hazards).
      text_field: Field holding the text in ``.jsonl`` inputs.
      force: Rebuild even if the directory is up to date.
      progress: Show a tqdm progress bar.
      vocab_from: ``classify`` only: a prepared dataset whose tokenizer and compact vocabulary to
          reuse (the ids of a model pretrained on it).
      allow_undecodable: Replace undecodable bytes by U+FFFD however many there are; by default
          a file where they are over ``MAX_UNDECODABLE_FRACTION`` of its bytes is an error.

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
  )
  check_output_dir(out)
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
    **({"vocab_from": reused.to_json()} if reused is not None else {}),
  }
  content_hash = layout.content_hash(options, sources, max(1, workers))
  if not force and (meta := layout.is_up_to_date(out, content_hash)) is not None:
    print(f"{out} is up to date (content hash {content_hash[:12]}); nothing to do")
    return meta

  # Tokenize: one result per file, in input order.
  results: list[_FileResult] = []
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    futures = [
      pool.submit(_tokenize_source, s, tok, text_field, allow_undecodable) for s in sources
    ]
    for fut in tqdm(
      futures, total=len(futures), desc="tokenizing", unit="file", disable=not progress
    ):
      results.append(fut.result())
  for spec in synthetic:
    name, count = parse_synthetic(spec)
    pairs = synthetic_examples(name, count, seed)
    results.append(
      _FileResult(
        [f"{spec}:{i}" for i in range(count)],
        [_as_ids(tok.encode_full(s)) for s, _ in pairs],
        [_as_ids(tok.encode_full(t)) for _, t in pairs],
        0,
      )
    )

  keys = [k for r in results for k in r.keys]
  docs = [a for r in results for a in r.tokens]
  targets = [a for r in results for a in r.targets] if task == "seq2seq" else None
  replaced = sum(r.replaced_chars for r in results)
  bad_docs = sum(r.replaced_chars > 0 for r in results)
  if targets is None:  # empty documents carry nothing for text tasks
    keep = [i for i, d in enumerate(docs) if len(d)]
    keys, docs = [keys[i] for i in keep], [docs[i] for i in keep]
  if not docs or sum(len(d) for d in docs) + sum(len(t) for t in targets or []) == 0:
    raise ValueError(f"empty corpus: inputs {list(inputs)} contain no text")
  if replaced:
    print(
      f"warning: {replaced} undecodable byte sequences in {bad_docs} file(s) were replaced by "
      "U+FFFD",
      file=sys.stderr,
    )

  is_val = split_documents(keys, val_fraction, seed)
  compact = reused
  if reused is not None:
    docs = [reused.to_compact(a).astype(np.uint32) for a in docs]
    tok = Tokenizer(tok.name, reused)
  if compact_vocab:
    # The GPT separator is always kept.
    base_eot = [] if tok.base_eot_id is None else [tok.base_eot_id]
    if compact_vocab is True:
      kept = np.unique(np.concatenate([np.unique(a) for a in docs + (targets or [])]))
    else:
      # Capped: the `compact_vocab` most frequent ids of the training documents; the rest -> [UNK].
      train_docs = [a for a, v in zip(docs, is_val) if not v]
      counts = np.bincount(
        np.concatenate(train_docs + [np.zeros(0, np.uint32)]).astype(np.int64),
        minlength=tok.base_vocab_size,
      )
      order = np.argsort(-counts, kind="stable")
      kept = order[: int(compact_vocab)][counts[order[: int(compact_vocab)]] > 0]
    compact = CompactVocab(
      np.unique(np.concatenate([kept, np.array(base_eot, np.int64)])), tok.base_vocab_size
    )
    docs = [compact.to_compact(a).astype(np.uint32) for a in docs]
    targets = (
      [compact.to_compact(a).astype(np.uint32) for a in targets] if targets is not None else None
    )
    tok = Tokenizer(tok.name, compact)

  os.makedirs(out, exist_ok=True)
  meta_path = os.path.join(out, METADATA_FILE)
  if os.path.exists(meta_path):
    os.remove(meta_path)  # a half-rewritten directory must never look up to date
  splits = {}
  for split in SPLITS:
    idx = np.flatnonzero(is_val if split == "val" else ~is_val)
    if targets is None:
      streams = {"tokens": layout.write_stream(out, split, [docs[i] for i in idx])}
    else:
      streams = {
        "src": layout.write_stream(out, f"{split}_src", [docs[i] for i in idx]),
        "tgt": layout.write_stream(out, f"{split}_tgt", [targets[i] for i in idx]),
      }
    splits[split] = {
      "documents": int(idx.size),
      "tokens": sum(s["tokens"] for s in streams.values()),
      "streams": streams,
    }
  if compact is not None:
    compact.save(os.path.join(out, COMPACT_VOCAB_FILE))

  meta = {
    **options,
    "content_hash": content_hash,
    "vocab_size": tok.vocab_size,
    "num_regular_tokens": tok.num_regular,
    "special_tokens": tok.special_ids,
    "compact_vocab": COMPACT_VOCAB_FILE if compact is not None else None,
    "dtype": "uint32",
    "inputs": list(inputs),
    "num_files": len(sources),
    "undecodable": {"files": int(bad_docs), "replacement_chars": int(replaced)},
    "splits": splits,
  }
  with open(meta_path + ".tmp", "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(meta_path + ".tmp", meta_path)
  return meta
