"""Corpus preparation: text / jsonl / tsv / stdlib / synthetic inputs -> a tokenized dataset directory.

Layout of a dataset directory (all token shards are raw little-endian uint32, written with ``ndarray.tofile``)::

    metadata.json            tokenizer, vocab_size, special ids, per-split counts, content hash, ...
    vocab.json               CompactVocab (only with compact_vocab=True)
    train_000.bin            text tasks (gpt, bert): concatenated document tokens, no separators
    train_offsets.npy        int64 [num_docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
    val_000.bin, val_offsets.npy
    train_src_000.bin, train_src_offsets.npy, train_tgt_000.bin, train_tgt_offsets.npy   (seq2seq pairs)

Documents are stored without separators; the GPT loader inserts ``<|endoftext|>`` after every document on the
fly, so one prepared directory serves both GPT and BERT.

Input names:
  * a file, a glob (``**`` allowed) or a directory (recursive; hidden entries and binary files skipped);
    each file is a document, except ``.jsonl`` (one document per line, field ``text_field``) and, for the
    seq2seq task, ``.tsv`` (one ``source<TAB>target`` example per line).
  * ``stdlib-tests``: the same Python's own test suite (``Lib/test``), which ``stdlib`` leaves out: a
    second code corpus (for adapting a model trained on ``stdlib``).
  * ``stdlib``: the running Python's standard-library ``.py`` files (``sysconfig.get_paths()["stdlib"]``),
    excluding ``site-packages``/``dist-packages``, test directories (``test``, ``tests``, ``idle_test``),
    ``__pycache__``, ``config-*`` and the platform-specific ``_sysconfigdata*`` file: about 730 files, 12 MB
    for CPython 3.11, stable across machines with the same Python version.
  * ``synthetic:reverse``, ``synthetic:sort``, ``synthetic:add`` (optionally ``synthetic:add:50000``): seq2seq
    digit tasks generated deterministically from ``seed`` with the character tokenizer
    ``chars:0123456789+``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from transformer_jax.data.tokenizer import CHARS_PREFIX, CompactVocab, Tokenizer

FORMAT_VERSION = 1
TASKS = ("gpt", "bert", "seq2seq", "classify")
SPLITS = ("train", "val")
METADATA_FILE = "metadata.json"
COMPACT_VOCAB_FILE = "vocab.json"
SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_TASKS = ("reverse", "sort", "add")
SYNTHETIC_ALPHABET = "0123456789+"
SYNTHETIC_TOKENIZER = CHARS_PREFIX + SYNTHETIC_ALPHABET
DEFAULT_SYNTHETIC_EXAMPLES = 20_000
SYNTHETIC_MIN_DIGITS, SYNTHETIC_MAX_DIGITS = 3, 12
_STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_BINARY_SNIFF_BYTES = 8192


@dataclasses.dataclass(frozen=True)
class _Source:
    """One input file."""
    key: str  # stable name for the train/val hash and content hash: path relative to the inputs' common folder
    path: str
    kind: str  # "text" | "jsonl" | "tsv"


@dataclasses.dataclass
class _FileResult:
    """Tokenized documents of one file: keys and token arrays (one array per document, or a pair)."""
    keys: list[str]
    tokens: list[np.ndarray]
    targets: list[np.ndarray] | None
    replaced_chars: int


# ---- input discovery ----------------------------------------------------------------------------------

def _stdlib_test_sources() -> list[_Source]:
    """The standard library's own test suite (``Lib/test``): code the ``stdlib`` corpus leaves out."""
    root = sysconfig.get_paths()["stdlib"]
    sources = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "test")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                sources.append(_Source(f"stdlib/{rel}", path, "text"))
    return sources


def _stdlib_sources() -> list[_Source]:
    root = sysconfig.get_paths()["stdlib"]
    sources = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _STDLIB_EXCLUDED_DIRS and not d.startswith(("config-", ".")))
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                sources.append(_Source(f"stdlib/{rel}", path, "text"))
    return sources


def _is_binary(path: str) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_SNIFF_BYTES)


def _kind_of(path: str, task: str) -> str:
    if path.endswith(".jsonl"):
        return "jsonl"
    if task == "seq2seq":
        if not path.endswith(".tsv"):
            raise ValueError(f"seq2seq inputs must be .tsv files (source<TAB>target) or synthetic:TASK, "
                             f"got {path!r}")
        return "tsv"
    return "text"


def files_under(directory: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith("."))
    return [p for p in out if not _is_binary(p)]


def _resolve_inputs(inputs: Sequence[str], task: str) -> tuple[list[_Source], list[str]]:
    """Expands input names into files (sorted, deduplicated) and synthetic task specs."""
    if not inputs:
        raise ValueError("no inputs given")
    sources: dict[str, _Source] = {}
    files_found: dict[str, str] = {}  # absolute path -> kind
    synthetic: list[str] = []
    for name in inputs:
        if name.startswith(SYNTHETIC_PREFIX):
            _parse_synthetic(name)  # validate early
            synthetic.append(name)
            continue
        if name in ("stdlib", "stdlib-tests") and not os.path.exists(name):
            found = _stdlib_sources() if name == "stdlib" else _stdlib_test_sources()
            if not found:
                raise FileNotFoundError(f"no .py files found in the stdlib {sysconfig.get_paths()['stdlib']!r}")
            for s in found:
                sources.setdefault(s.key, s)
            continue
        matches = sorted(glob.glob(name, recursive=True)) if glob.has_magic(name) else (
            [name] if os.path.exists(name) else [])
        files = []
        for m in matches:
            files.extend(files_under(m) if os.path.isdir(m) else [m])
        if not files:
            raise FileNotFoundError(f"no files found for input {name!r}")
        for path in files:
            files_found.setdefault(os.path.abspath(path), _kind_of(path, task))
    if files_found:
        # Keys are relative to the files' common folder, so the split and content hash survive moving the corpus.
        root = os.path.commonpath(list(files_found))
        if len(files_found) == 1:
            root = os.path.dirname(root)
        for path, kind in files_found.items():
            key = os.path.relpath(path, root).replace(os.sep, "/")
            sources.setdefault(key, _Source(key, path, kind))
    if synthetic and task != "seq2seq":
        raise ValueError(f"synthetic inputs {synthetic} are seq2seq tasks; use task='seq2seq'")
    if synthetic and sources:
        raise ValueError("synthetic inputs use their own character tokenizer and cannot be mixed with files")
    return list(sources.values()), synthetic


def _parse_synthetic(name: str) -> tuple[str, int]:
    parts = name[len(SYNTHETIC_PREFIX):].split(":")
    if parts[0] not in SYNTHETIC_TASKS or len(parts) > 2:
        raise ValueError(f"unknown synthetic input {name!r}; expected synthetic:TASK[:COUNT] with TASK in "
                         f"{SYNTHETIC_TASKS}")
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
        task: ``"reverse"`` (target = reversed source), ``"sort"`` (target = sorted digits) or ``"add"``
            (source ``"a+b"`` with operands of 1-6 digits, target the decimal sum).
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
            b = int("".join(map(str, row[half:half + nb])))
            out.append((f"{a}+{b}", str(a + b)))
        return out
    raise ValueError(f"unknown synthetic task {task!r}; expected one of {SYNTHETIC_TASKS}")


# ---- reading and tokenizing ---------------------------------------------------------------------------

def _decode(data: bytes) -> tuple[str, int]:
    """UTF-8 decode; undecodable bytes become U+FFFD. Returns (text, number of replacement characters added)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.decode("utf-8", errors="ignore").count("\ufffd")


def _as_ids(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.uint32)


def _tokenize_source(source: _Source, tokenizer: Tokenizer, text_field: str) -> _FileResult:
    with open(source.path, "rb") as f:
        text, replaced = _decode(f.read())
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


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _content_hash(options: dict[str, Any], sources: list[_Source], workers: int) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # hashlib releases the GIL on big reads
        digests = list(pool.map(lambda s: _file_digest(s.path), sources))
    for source, digest in zip(sources, digests):
        h.update(f"{source.key}\0{source.kind}\0{digest}\n".encode())
    return h.hexdigest()


# ---- splitting and writing ----------------------------------------------------------------------------

def _split_hash(seed: int, key: str) -> float:
    digest = hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


def split_documents(keys: Sequence[str], val_fraction: float, seed: int) -> np.ndarray:
    """Assigns documents to validation by a seeded hash of their keys.

    Args:
        keys: Stable document names (paths, ``path:line``).
        val_fraction: Fraction of documents in ``[0, 1)``, or an integer count ``>= 1`` of validation documents.
        seed: Split seed.

    Returns:
        Bool array ``[num_docs]``, True for validation. With two or more documents and a non-zero fraction, both
        splits are non-empty.
    """
    n = len(keys)
    if not val_fraction >= 0 or val_fraction == float("inf"):   # NaN fails the comparison
        raise ValueError(f"val_fraction must be a finite number >= 0, got {val_fraction}")
    hashes = np.array([_split_hash(seed, k) for k in keys], dtype=np.float64)
    if val_fraction >= 1:
        if val_fraction != int(val_fraction):
            raise ValueError(f"val_fraction >= 1 must be a whole document count, got {val_fraction}")
        is_val = np.zeros(n, dtype=bool)
        is_val[np.argsort(hashes, kind="stable")[:min(int(val_fraction), max(n - 1, 0))]] = True
        return is_val
    is_val = hashes < val_fraction
    if n >= 2 and val_fraction > 0:
        if not is_val.any():
            is_val[np.argmin(hashes)] = True
        if is_val.all():
            is_val[np.argmax(hashes)] = False
    return is_val


def _write_stream(out: str, prefix: str, arrays: list[np.ndarray]) -> dict[str, Any]:
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


def _is_up_to_date(out: str, content_hash: str) -> dict[str, Any] | None:
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
    files = [f for split in meta["splits"].values() for s in split["streams"].values()
             for f in [*s["shards"], s["offsets"]]]
    if meta.get("compact_vocab"):
        files.append(meta["compact_vocab"])
    return meta if all(os.path.exists(os.path.join(out, f)) for f in files) else None


# The files ``prepare`` writes (and their temporaries): a folder holding anything else is not a
# dataset, and is not written into.
_DATASET_FILE = re.compile(r"^(?:(?:train|val)(?:_src|_tgt|_b)?(?:_\d+\.bin|_offsets\.npy|"
                           r"_labels\.npy)|vocab\.json|metadata\.json)(?:\.tmp)?$")


def check_options(*, task: str, val_fraction: float, workers: int, compact_vocab: bool | int,
                  text_field: str) -> None:
    """Refuses options ``prepare`` cannot honour, before any file is read.

    Raises:
        ValueError: an unknown task, a ``val_fraction`` that is negative, not finite or a fraction
            above 1, fewer than one worker, a ``compact_vocab`` count below 1, or no text field.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if (isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float))
            or not 0 <= val_fraction < float("inf")):
        raise ValueError(f"val_fraction={val_fraction}: expected a fraction in [0, 1) or a whole "
                         "number of documents")
    if val_fraction >= 1 and val_fraction != int(val_fraction):
        raise ValueError(f"val_fraction={val_fraction}: a value >= 1 is a whole document count")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers}: expected an integer >= 1")
    if not isinstance(compact_vocab, bool) and (not isinstance(compact_vocab, int)
                                                 or compact_vocab < 1):
        raise ValueError(f"compact_vocab={compact_vocab}: expected true, false or a count of ids "
                         ">= 1")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field={text_field!r}: expected a field name")


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
        raise ValueError(f"{out} holds files that are not a prepared dataset's "
                         f"({', '.join(foreign[:5])}{more}); give a new or empty directory")


def read_metadata(path: str) -> dict[str, Any]:
    """The ``metadata.json`` of the dataset directory ``path``.

    Raises:
        FileNotFoundError: ``path`` holds no ``metadata.json``.
        ValueError: The file is damaged (not a JSON object); the message names it and how to rebuild it.
    """
    meta_file = os.path.join(path, METADATA_FILE)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"{path!r} is not a prepared dataset (no {METADATA_FILE}); run `tjax prepare`")
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
        raise ValueError(f"{meta_file} is damaged ({problem}); rebuild the dataset with `tjax prepare "
                         f"... --out {path}`, or delete {path} for `tjax train` to prepare it again from "
                         "data.inputs")
    return meta


# The streams each task's splits hold (classify may add "tokens_b", the second texts of pairs).
_STREAMS = {"gpt": {"tokens"}, "bert": {"tokens"}, "seq2seq": {"src", "tgt"},
            "classify": {"tokens"}}


def _count(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _file_name(value: Any) -> bool:
    """A plain file name: the dataset's files all lie in its own folder."""
    return (isinstance(value, str) and value not in ("", ".", "..") and "/" not in value
            and os.sep not in value)


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
        return (f"num_regular_tokens={meta.get('num_regular_tokens')!r}: expected an integer in "
                f"[0, {vocab}]")
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
                return (f"{where}.shards={shards!r}: expected a list of file names inside the "
                        "dataset")
            if not _file_name(entry.get("offsets")):
                return (f"{where}.offsets={entry.get('offsets')!r}: expected a file name inside "
                        "the dataset")
    if task == "classify":
        labels = meta.get("labels")
        if not (isinstance(labels, list) and labels and all(isinstance(x, str) for x in labels)):
            return f"labels={labels!r}: expected a list of label names"
    return None


# ---- entry point --------------------------------------------------------------------------------------

def prepare(inputs: Sequence[str], out: str, *, tokenizer: str = "cl100k_base", compact_vocab: bool | int = False,
            task: str = "gpt", val_fraction: float = 0.05, seed: int = 0, workers: int = 2,
            text_field: str = "text", force: bool = False, progress: bool = True,
            vocab_from: str | None = None) -> dict[str, Any]:
    """Tokenizes a corpus into a dataset directory (see the module docstring for the layout).

    Args:
        inputs: Files, globs, directories, ``stdlib``, or ``synthetic:TASK[:COUNT]`` (seq2seq only).
        out: Output directory (created if needed).
        tokenizer: Tokenizer name (tiktoken encoding or ``chars:ALPHABET``); synthetic inputs always use
            ``chars:0123456789+``.
        compact_vocab: Re-number the ids the corpus uses (train and val) into a dense range (saves embedding
            rows); stored as ``vocab.json``. An integer ``N`` keeps only the ``N`` most frequent ids of the
            training documents (the rest become ``[UNK]``): for small CPU runs the softmax over the
            vocabulary dominates the step.
        task: ``"gpt"``, ``"bert"`` (same on-disk format), ``"seq2seq"`` (pairs) or ``"classify"``
            (labelled examples, see ``data.classify``).
        val_fraction: Fraction of documents for validation, or a whole number ``>= 1`` of validation documents.
        seed: Seed of the train/val split and of synthetic data.
        workers: Threads for reading and tokenizing (tiktoken's BPE releases the GIL, so threads use all
            cores without process start-up cost or fork-after-JAX hazards).
        text_field: Field holding the text in ``.jsonl`` inputs.
        force: Rebuild even if the directory is up to date.
        progress: Show a tqdm progress bar.
        vocab_from: ``classify`` only: a prepared dataset whose tokenizer and compact vocabulary to
            reuse (the ids of a model pretrained on it).

    Returns:
        The metadata dict written to ``out/metadata.json``.

    Raises:
        FileNotFoundError: An input name matches no files.
        ValueError: Bad options, malformed jsonl/tsv lines, or an empty corpus.
    """
    check_options(task=task, val_fraction=val_fraction, workers=workers,
                  compact_vocab=compact_vocab, text_field=text_field)
    check_output_dir(out)
    if task == "classify":
        from transformer_jax.data.classify import prepare_classify
        return prepare_classify(inputs, out, tokenizer=tokenizer, vocab_from=vocab_from,
                                val_fraction=val_fraction, seed=seed, force=force)
    if vocab_from is not None and task == "seq2seq":
        raise ValueError("vocab_from is for text and classify datasets, not task='seq2seq'")
    sources, synthetic = _resolve_inputs(inputs, task)
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
    options = {"format_version": FORMAT_VERSION, "task": task, "tokenizer": tokenizer,
               "compact_vocab": compact_vocab if isinstance(compact_vocab, bool) else int(compact_vocab),
               "val_fraction": val_fraction, "seed": seed,
               "text_field": text_field, "synthetic": synthetic,
               **({"vocab_from": reused.to_json()} if reused is not None else {})}
    content_hash = _content_hash(options, sources, max(1, workers))
    if not force and (meta := _is_up_to_date(out, content_hash)) is not None:
        print(f"{out} is up to date (content hash {content_hash[:12]}); nothing to do")
        return meta

    # Tokenize: one result per file, in input order.
    results: list[_FileResult] = []
    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        futures = [pool.submit(_tokenize_source, s, tok, text_field) for s in sources]
        for fut in tqdm(futures, total=len(futures), desc="tokenizing", unit="file", disable=not progress):
            results.append(fut.result())
    for spec in synthetic:
        name, count = _parse_synthetic(spec)
        pairs = synthetic_examples(name, count, seed)
        results.append(_FileResult([f"{spec}:{i}" for i in range(count)],
                                   [_as_ids(tok.encode_full(s)) for s, _ in pairs],
                                   [_as_ids(tok.encode_full(t)) for _, t in pairs], 0))

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
        print(f"warning: {replaced} undecodable byte sequences in {bad_docs} file(s) were replaced by U+FFFD",
              file=sys.stderr)

    is_val = split_documents(keys, val_fraction, seed)
    compact = reused
    if reused is not None:
        docs = [reused.to_compact(a).astype(np.uint32) for a in docs]
        tok = Tokenizer(tok.name, reused)
    if compact_vocab:
        if tok.name.startswith(CHARS_PREFIX):
            base_eot = []
        else:
            base_eot = [tok._backend.eot_token]  # pylint: disable=protected-access; GPT separator always kept
        if compact_vocab is True:
            kept = np.unique(np.concatenate([np.unique(a) for a in docs + (targets or [])]))
        else:
            # Capped: the `compact_vocab` most frequent ids of the training documents; the rest -> [UNK].
            train_docs = [a for a, v in zip(docs, is_val) if not v]
            counts = np.bincount(np.concatenate(train_docs + [np.zeros(0, np.uint32)]).astype(np.int64),
                                 minlength=tok.base_vocab_size)
            order = np.argsort(-counts, kind="stable")
            kept = order[:int(compact_vocab)][counts[order[:int(compact_vocab)]] > 0]
        compact = CompactVocab(np.unique(np.concatenate([kept, np.array(base_eot, np.int64)])),
                               tok.base_vocab_size)
        docs = [compact.to_compact(a).astype(np.uint32) for a in docs]
        targets = [compact.to_compact(a).astype(np.uint32) for a in targets] if targets is not None else None
        tok = Tokenizer(tok.name, compact)

    os.makedirs(out, exist_ok=True)
    meta_path = os.path.join(out, METADATA_FILE)
    if os.path.exists(meta_path):
        os.remove(meta_path)  # a half-rewritten directory must never look up to date
    splits = {}
    for split in SPLITS:
        idx = np.flatnonzero(is_val if split == "val" else ~is_val)
        if targets is None:
            streams = {"tokens": _write_stream(out, split, [docs[i] for i in idx])}
        else:
            streams = {"src": _write_stream(out, f"{split}_src", [docs[i] for i in idx]),
                       "tgt": _write_stream(out, f"{split}_tgt", [targets[i] for i in idx])}
        splits[split] = {"documents": int(idx.size), "tokens": sum(s["tokens"] for s in streams.values()),
                         "streams": streams}
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
