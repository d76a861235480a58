"""How big a corpus or a dataset is, before the work: ``tjax prepare --dry-run`` counts the input
files and bytes and estimates the tokens and the time from a timed sample (``estimate_corpus``);
``dataset_facts`` gives a prepared dataset's tokens, shards and bytes and how many epochs a
training run's steps read (what ``tjax info`` and ``tjax train --dry-run`` print)."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Sequence
from typing import Any

from transformer_jax.data.files import size_of
from transformer_jax.data.layout import read_metadata
from transformer_jax.data.readers import Record, read_records
from transformer_jax.data.sources import Source, parse_synthetic, resolve_inputs
from transformer_jax.data.tokenizer import Tokenizer

SAMPLE_BYTES = 4 << 20  # input bytes read and tokenized for the estimate
_SAMPLE_FILES = 16  # the sample reads at least this many files (if there are) ...
_MAX_SAMPLE_FILES = 1024  # ... and at most this many: small files are whole documents


def _spread(n: int, m: int) -> list[int]:
  """Up to ``m`` distinct indices in ``range(n)``, each next one in the widest gap left (0, n/2,
  n/4, 3n/4, ...): a sample cut short anywhere still spans the files."""
  out, seen, i = [], set(), 0
  while len(out) < min(n, m) and i < 8 * m:
    x, bit, k = 0.0, 0.5, i
    while k:
      x, bit, k = x + bit * (k & 1), bit / 2, k >> 1
    j = int(x * n)
    if j not in seen:
      seen.add(j)
      out.append(j)
    i += 1
  return out


def _sample_file(
  source: Source, text_field: str, tok: Tokenizer, budget: int, size: int
) -> tuple[int, int, int, float]:
  """The documents and tokens of the first ``budget`` bytes of one file or more (a reader moves
  a chunk, row batch or record batch at a time), those bytes, and the seconds they took.

  The records counted are the ones the bytes read hold: a reader's position moves when it reads
  the next chunk, so the sample stops at the first record that needed a chunk beyond ``budget``
  bytes, with the position before that chunk as its size. A stream that cannot tell its position
  is measured by the text read."""
  handle: list = []
  documents = tokens = at = text = 0
  start = time.perf_counter()
  for item in read_records(source, text_field, allow_undecodable=True, opened=handle.append):
    try:
      now = handle[-1].tell() if handle else at
    except (OSError, ValueError):
      now = text
    if now != at:
      if at >= budget:
        return documents, tokens, at, time.perf_counter() - start
      at = now
    if isinstance(item, Record):
      documents += 1
      tokens += sum(tok.encode_full_array(t).size for t in item.texts)
      text += sum(len(t.encode()) for t in item.texts)
  return documents, tokens, size, time.perf_counter() - start


def estimate_corpus(
  inputs: Sequence[str],
  *,
  task: str = "gpt",
  tokenizer: str = "cl100k_base",
  text_field: str = "text",
  workers: int = 1,
  sample_bytes: int = SAMPLE_BYTES,
) -> dict[str, Any]:
  """Counts the files and bytes ``inputs`` stand for and times reading and tokenizing a sample of
  about ``sample_bytes`` (spread over the files, a sixteenth of it from one, or what its reader
  reads at once: a compressed chunk, a Parquet row batch, an Arrow record batch) on one thread.

  Returns:
      ``files``, ``bytes``, ``kinds`` (files a format), ``sample`` (``files``, ``bytes``,
      ``documents``, ``tokens``, ``seconds``), and the estimates ``tokens``, ``dataset_bytes``
      (4 a token) and ``seconds`` (the sample's rate, times ``workers``: tokenizing scales with
      the cores when they are free). Synthetic inputs give ``examples`` instead.

  Raises:
      FileNotFoundError: an input that matches no file; ValueError: a file in a format ``prepare``
      does not read, or the classify task (its inputs are labelled folders).
  """
  if task == "classify":
    raise ValueError("--dry-run estimates text and seq2seq corpora, not task='classify'")
  sources, synthetic = resolve_inputs(inputs, task)
  if synthetic:
    return {"files": 0, "bytes": 0, "examples": sum(parse_synthetic(s)[1] for s in synthetic)}
  tok = Tokenizer.from_name(tokenizer)
  sizes = [size_of(s.path) or 0 for s in sources]
  total = sum(sizes)
  budget = max(1, sample_bytes // _SAMPLE_FILES)  # bytes read from one file at most
  sample = {"files": 0, "bytes": 0, "documents": 0, "tokens": 0, "seconds": 0.0}
  for i in _spread(len(sources), _MAX_SAMPLE_FILES):
    if sample["bytes"] >= sample_bytes:
      break
    counts = _sample_file(sources[i], text_field, tok, budget, sizes[i])
    sample["files"] += 1
    for key, n in zip(("documents", "tokens", "bytes", "seconds"), counts):
      sample[key] += n
  result = {
    "files": len(sources),
    "bytes": total,
    "kinds": dict(
      collections.Counter(s.kind + (f"+{s.compression}" if s.compression else "") for s in sources)
    ),
    "sample": sample,
  }
  if sample["bytes"] and sample["seconds"] > 0:
    result["tokens"] = round(total * sample["tokens"] / sample["bytes"])
    result["dataset_bytes"] = 4 * result["tokens"]
    result["seconds"] = total / (sample["bytes"] / sample["seconds"]) / max(workers, 1)
  return result


def _duration(seconds: float) -> str:
  if seconds < 90:
    return f"{seconds:.0f} s"
  if seconds < 5400:
    return f"{seconds / 60:.0f} min"
  return f"{seconds / 3600:.1f} h"


def _size(n: float) -> str:
  for unit in ("B", "KB", "MB", "GB", "TB"):
    if n < 1000 or unit == "TB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1000
  return f"{n:.1f} TB"


def describe_estimate(est: dict[str, Any], workers: int) -> str:
  """``estimate_corpus``'s result as the lines ``tjax prepare --dry-run`` prints."""
  if "examples" in est:
    return f"synthetic: {est['examples']:,} examples"
  kinds = ", ".join(f"{n} {k}" for k, n in sorted(est["kinds"].items()))
  lines = [f"{est['files']:,} files ({kinds}), {_size(est['bytes'])}"]
  s = est["sample"]
  lines.append(
    f"sample: {_size(s['bytes'])} of {s['files']} file(s), {s['documents']:,} documents, "
    f"{s['tokens']:,} tokens in {s['seconds']:.2f} s on one thread"
  )
  if "tokens" in est:
    lines.append(
      f"estimate: {est['tokens']:,} tokens ({_size(est['dataset_bytes'])} of shards), "
      f"about {_duration(est['seconds'])} on {workers} worker(s)"
    )
  return "\n".join(lines)


# ---- a prepared dataset --------------------------------------------------------------------------


def dataset_facts(
  path: str | os.PathLike,
  *,
  steps: int | None = None,
  batch_size: int | None = None,
  seq_len: int | None = None,
) -> dict[str, Any]:
  """A prepared dataset's size from its ``metadata.json`` and file sizes (no shard is read), and
  how many epochs of its train split ``steps`` batches read.

  Returns:
      ``task``, ``tokens``, ``documents``, ``shards``, ``bytes`` (all its files) and ``splits``
      (the same a split); with ``steps`` and ``batch_size`` (and ``seq_len`` for gpt and bert),
      ``epochs``: for gpt, the packed windows of ``seq_len + 1`` tokens the steps draw over the
      windows in the train stream (documents each followed by ``<|endoftext|>``); for bert, the
      ``seq_len - 3`` text tokens a row holds over the train tokens; for seq2seq and classify,
      the examples the steps draw over the train examples.
  """
  path = os.fspath(path)
  meta = read_metadata(path)
  splits = {}
  for name, split in meta["splits"].items():
    files = [f for s in split["streams"].values() for f in [*s["shards"], s["offsets"]]]
    splits[name] = {
      "documents": split["documents"],
      "tokens": split["tokens"],
      "shards": sum(len(s["shards"]) for s in split["streams"].values()),
      "bytes": sum(os.path.getsize(os.path.join(path, f)) for f in files),
    }
  facts: dict[str, Any] = {
    "task": meta["task"],
    **{k: sum(s[k] for s in splits.values()) for k in ("tokens", "documents", "shards", "bytes")},
    "splits": splits,
  }
  train = splits.get("train")
  if steps is None or batch_size is None or train is None:
    return facts
  drawn = steps * batch_size
  if meta["task"] in ("gpt", "bert"):
    if seq_len is None:
      raise ValueError(f"the epochs of a {meta['task']} dataset need seq_len")
    if meta["task"] == "gpt":
      windows = max(1, (train["tokens"] + train["documents"] - seq_len) // seq_len)
      facts["epochs"] = drawn / windows
    else:
      facts["epochs"] = drawn * (seq_len - 3) / max(train["tokens"], 1)
  else:
    facts["epochs"] = drawn / max(train["documents"], 1)
  return facts


def describe_facts(facts: dict[str, Any]) -> str:
  """``dataset_facts``' result as one line."""
  line = (
    f"{facts['tokens']:,} tokens in {facts['documents']:,} documents, {facts['shards']} shard(s), "
    f"{_size(facts['bytes'])}"
  )
  if "epochs" in facts:
    line += f"; the configured steps read {facts['epochs']:.3g} epoch(s) of train"
  return line
