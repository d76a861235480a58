"""Sequence classification data: labelled text -> a prepared dataset, and its batch loaders.

Inputs (``tjax prepare --task classify``):
  * ``.tsv``: one ``text<TAB>label`` example a line, or ``text<TAB>text_b<TAB>label`` for pairs;
  * ``.jsonl``: one object a line with string fields ``text`` and ``label`` (optional ``text_b``);
  * ``stdlib:packages``: the embedded task, "which top-level standard-library package does this
    function come from" (:data:`STDLIB_PACKAGES`), one example per function or method, split by
    file so that no file has functions on both sides.

Label names are sorted and numbered from 0; the mapping is stored in ``metadata.json`` (``labels``:
the names in id order) with per-split label counts and the majority-class baseline of the
validation split. On disk the texts are token streams like the text tasks' (``tokens`` and, for
pairs, ``tokens_b``) plus ``{split}_labels.npy`` (int32, one label a document).
"""

from __future__ import annotations

import ast
import glob
import json
import os
import sysconfig
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from transformer_jax.data import layout
from transformer_jax.data.layout import split_documents
from transformer_jax.data.loader_base import process_info
from transformer_jax.data.files import sniff
from transformer_jax.data.sources import Source, files_under
from transformer_jax.data.tokenizer import CompactVocab, Tokenizer

STDLIB_TASK = "stdlib:packages"
# Ten top-level packages of CPython 3.11's standard library, each with 13 files or more (so a split
# by file leaves functions of every package on both sides).
STDLIB_PACKAGES = (
  "asyncio",
  "distutils",
  "email",
  "idlelib",
  "importlib",
  "lib2to3",
  "multiprocessing",
  "tkinter",
  "unittest",
  "xml",
)
_SKIPPED_DIRS = {"test", "tests", "idle_test", "__pycache__"}
LABELS_SUFFIX = "_labels.npy"


class Example:
  """One labelled example: its key (``file:line``), the file it came from (the split unit) and
  its texts."""

  __slots__ = ("key", "group", "text", "text_b", "label")

  def __init__(self, key: str, group: str, text: str, text_b: str | None, label: str):
    self.key, self.group, self.text, self.text_b, self.label = key, group, text, text_b, label


def read_labelled(path: str, key: str) -> list[Example]:
  """Examples of a ``.tsv`` or ``.jsonl`` file; a malformed line raises a one-line error naming it.

  Args:
    path: The file.
    key: Its stable name (relative path) for the split hash.

  Raises:
    ValueError: a malformed line, or a file that is not text (compressed, columnar, binary).
  """
  if (fmt := sniff(path)) is not None:
    raise ValueError(f"{path}: a {fmt} file, not text; labelled examples are .tsv or .jsonl text")
  with open(path, encoding="utf-8", errors="replace") as f:
    lines = f.read().splitlines()
  out = []
  for lineno, line in enumerate(lines, start=1):
    if not line.strip():
      continue
    where = f"{path}:{lineno}"
    if path.endswith(".jsonl"):
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with fields 'text' and 'label'")
      text, text_b, label = record.get("text"), record.get("text_b"), record.get("label")
      if not isinstance(text, str):
        raise ValueError(f"{where}: field 'text' must be a string, got {text!r}")
      if text_b is not None and not isinstance(text_b, str):
        raise ValueError(f"{where}: field 'text_b' must be a string, got {text_b!r}")
      if isinstance(label, bool) or not isinstance(label, (str, int)):
        raise ValueError(f"{where}: field 'label' must be a string or an integer, got {label!r}")
      label = str(label)
    elif path.endswith(".tsv"):
      parts = line.split("\t")
      if len(parts) not in (2, 3):
        raise ValueError(
          f"{where}: expected 'text<TAB>label' or 'text<TAB>text_b<TAB>label', "
          f"got {len(parts)} tab-separated fields"
        )
      text, text_b, label = parts[0], (parts[1] if len(parts) == 3 else None), parts[-1].strip()
    else:
      raise ValueError(
        f"{path}: classification inputs must be .tsv or .jsonl files (or {STDLIB_TASK})"
      )
    if not label:
      raise ValueError(f"{where}: empty label")
    out.append(Example(f"{key}:{lineno}", f"{key}:{lineno}", text, text_b, label))
  return out


def stdlib_examples() -> list[Example]:
  """The embedded task: every function and method of :data:`STDLIB_PACKAGES` (test folders
  left out), labelled with its top-level package; the source file is the split unit."""
  root = sysconfig.get_paths()["stdlib"]
  out = []
  for package in STDLIB_PACKAGES:
    top = os.path.join(root, package)
    if not os.path.isdir(top):
      continue
    for dirpath, dirnames, filenames in os.walk(top):
      dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
      for name in sorted(filenames):
        if not name.endswith(".py"):
          continue
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root).replace(os.sep, "/")
        with open(path, encoding="utf-8", errors="replace") as f:
          source = f.read()
        try:
          tree = ast.parse(source)
        except SyntaxError:  # lib2to3's grammar test data and the like
          continue
        lines = source.splitlines()
        for node in ast.walk(tree):
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            text = textwrap.dedent("\n".join(lines[start - 1 : node.end_lineno]))
            out.append(Example(f"{rel}:{start}", rel, text, None, package))
  if not out:
    raise FileNotFoundError(f"none of the packages {STDLIB_PACKAGES} found in {root!r}")
  out.sort(key=lambda e: e.key)
  return out


def label_counts(labels: np.ndarray, num_labels: int) -> list[int]:
  return np.bincount(labels, minlength=num_labels).astype(int).tolist()


def majority_baseline(train_labels: np.ndarray, val_labels: np.ndarray) -> dict[str, Any]:
  """Validation accuracy of always predicting the training split's most frequent label."""
  top = int(np.argmax(np.bincount(train_labels))) if train_labels.size else 0
  acc = float(np.mean(val_labels == top)) if val_labels.size else 0.0
  return {"label": top, "val_accuracy": acc}


# ---- loading -------------------------------------------------------------------------------------


def labels_of(dataset, split: str) -> np.ndarray:
  """The int32 labels ``[num_docs]`` of a classification dataset's split."""
  if dataset.task != "classify":
    raise ValueError(
      f"dataset {dataset.path} was prepared for task {dataset.task!r}, not 'classify'"
    )
  file = os.path.join(dataset.path, f"{split}{LABELS_SUFFIX}")
  try:
    labels = np.load(file, allow_pickle=False)
  except (ValueError, EOFError) as e:
    raise ValueError(f"{file}: not a labels array ({e})") from None
  n = dataset.stream(split).num_docs
  if labels.shape != (n,) or not np.issubdtype(labels.dtype, np.integer):
    raise ValueError(
      f"{file}: labels of shape {labels.shape} and dtype {labels.dtype} for {n} "
      "examples (expected integers, one per example)"
    )
  num_labels = len(dataset.meta["labels"])
  if labels.size and (labels.min() < 0 or labels.max() >= num_labels):
    bad = int(labels[(labels < 0) | (labels >= num_labels)][0])
    raise ValueError(
      f"{file}: label {bad} lies outside the {num_labels} labels of {dataset.path}/metadata.json"
    )
  return labels.astype(np.int32)


def _encode_rows(
  dataset, split: str, idx_B: np.ndarray, seq_len: int, cls_token: bool
) -> dict[str, np.ndarray]:
  """``[CLS] a [SEP] (b [SEP])`` (``cls_token``) or ``a ([SEP] b)`` rows, right-padded to
  ``seq_len`` and cut to fit (pairs share the room, the longer text cut first)."""
  ids = dataset.meta["special_tokens"]
  cls, sep, pad = ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]
  a = dataset.stream(split, "tokens")
  b = (
    dataset.stream(split, "tokens_b")
    if "tokens_b" in dataset.meta["splits"][split]["streams"]
    else None
  )
  rows, types = [], []
  for i in idx_B.tolist():
    ta = a.doc(i).astype(np.int64)
    tb = None if b is None else b.doc(i).astype(np.int64)
    room = seq_len - (2 if cls_token else 0) - (0 if tb is None else 1)
    if tb is None:
      ta = ta[:room]
      row = ([cls] if cls_token else []) + ta.tolist() + ([sep] if cls_token else [])
      typ = [0] * len(row)
    else:
      while len(ta) + len(tb) > room:  # cut the longer one a token at a time
        if len(ta) >= len(tb):
          ta = ta[:-1]
        else:
          tb = tb[:-1]
      first = ([cls] if cls_token else []) + ta.tolist() + [sep]
      second = tb.tolist() + ([sep] if cls_token else [])
      row, typ = first + second, [0] * len(first) + [1] * len(second)
    rows.append(row)
    types.append(typ)
  b_, t_ = len(rows), seq_len
  tokens = np.full((b_, t_), pad, np.int32)
  token_types = np.zeros((b_, t_), np.int32)
  mask = np.zeros((b_, t_), bool)
  for r, (row, typ) in enumerate(zip(rows, types)):
    if not row:  # an empty text still needs one real position to pool from
      row, typ = [pad], [0]
    tokens[r, : len(row)] = row
    token_types[r, : len(typ)] = typ
    mask[r, : len(row)] = True
  return {"tokens": tokens, "token_types": token_types, "attention_mask": mask}


class ClassifyLoader:
  """Shuffled classification batches, a pure function of ``(seed, step)`` (epochs reshuffled).

  Batch: ``tokens``, ``token_types`` (int32), ``attention_mask`` (bool), all ``[B, T]``;
  ``labels`` int32 ``[B]``; ``label_mask`` bool ``[B]`` (False for padding rows of eval batches).
  ``cls_token``: BERT's ``[CLS] a [SEP] b [SEP]`` layout; otherwise ``a [SEP] b`` (GPT pools its
  last real token, the encoder of a seq2seq model its mean).
  """

  def __init__(
    self,
    dataset,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    split: str = "train",
    cls_token: bool = True,
    process_index: int | None = None,
    process_count: int | None = None,
  ):
    self.process_index, self.process_count = process_info(process_index, process_count)
    if batch_size <= 0 or batch_size % self.process_count:
      raise ValueError(
        f"batch_size={batch_size} must be positive and divisible by the "
        f"{self.process_count} processes"
      )
    self.dataset, self.split = dataset, split
    self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
    self.cls_token = cls_token
    self.labels = labels_of(dataset, split)
    if self.labels.size == 0:
      raise ValueError(f"the {split} split of {dataset.path} holds no examples")
    local = batch_size // self.process_count
    self.local_rows = slice(self.process_index * local, (self.process_index + 1) * local)
    self.step = 0

  @property
  def examples_per_epoch(self) -> tuple[int, str]:
    """Distinct training examples in one epoch, and what they are."""
    return int(self.labels.size), "labelled examples"

  def indices_at(self, step: int) -> np.ndarray:
    """The global batch's example ids at ``step``: consecutive slices of per-epoch permutations."""
    n = self.labels.size
    pos = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
    epochs, within = pos // n, pos % n
    out = np.empty_like(pos)
    for e in np.unique(epochs):
      perm = np.random.default_rng([self.seed, int(e)]).permutation(n)
      out[epochs == e] = perm[within[epochs == e]]
    return out

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    idx = self.indices_at(step)[self.local_rows]
    batch = _encode_rows(self.dataset, self.split, idx, self.seq_len, self.cls_token)
    batch["labels"] = self.labels[idx]
    batch["label_mask"] = np.ones(idx.size, bool)
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"step": self.step}

  def set_state(self, state: dict[str, Any]) -> None:
    self.step = int(state["step"])

  def __iter__(self):
    return self

  def __next__(self):
    batch = self.batch_at(self.step)
    self.step += 1
    return batch


def classify_eval_batches(
  dataset,
  *,
  batch_size: int,
  seq_len: int,
  split: str = "val",
  cls_token: bool = True,
  max_batches: int | None = None,
  process_index: int | None = None,
  process_count: int | None = None,
):
  """Every example of ``split`` once, in a fixed shuffled order (so ``max_batches`` takes a
  sample of all classes, not the first files); the last batch padded with masked rows."""
  process_index, process_count = process_info(process_index, process_count)
  labels = labels_of(dataset, split)
  n = labels.size
  order = np.random.default_rng(0).permutation(n)
  local = batch_size // process_count
  rows = slice(process_index * local, (process_index + 1) * local)
  num = -(-n // batch_size)
  if max_batches is not None:
    num = min(num, max_batches)
  for k in range(num):
    pos = np.arange(k * batch_size, (k + 1) * batch_size)
    real = pos < n
    idx = order[np.where(real, pos, 0)][rows]
    batch = _encode_rows(dataset, split, idx, seq_len, cls_token)
    batch["labels"] = labels[idx]
    batch["label_mask"] = real[rows]
    yield batch


# ---- preparation ---------------------------------------------------------------------------------


def collect_examples(inputs: Sequence[str]) -> list[Example]:
  """Examples of every input (``stdlib:packages``, ``.tsv``/``.jsonl`` files, globs, folders)."""
  out: list[Example] = []
  files = []
  for name in inputs:
    if name == STDLIB_TASK:
      out.extend(stdlib_examples())
      continue
    matches = (
      sorted(glob.glob(name, recursive=True))
      if glob.has_magic(name)
      else ([name] if os.path.exists(name) else [])
    )
    found = []
    for m in matches:
      found.extend(files_under(m) if os.path.isdir(m) else [m])
    if not found:
      raise FileNotFoundError(f"no files found for input {name!r}")
    files.extend(os.path.abspath(p) for p in found)
  if files:
    files = sorted(set(files))
    root = os.path.commonpath(files) if len(files) > 1 else os.path.dirname(files[0])
    for path in files:
      out.extend(read_labelled(path, os.path.relpath(path, root).replace(os.sep, "/")))
  if not out:
    raise ValueError(f"inputs {list(inputs)} hold no labelled examples")
  return out


def split_by_group(examples: Sequence[Example], val_fraction: float, seed: int) -> np.ndarray:
  """Validation flags ``[num_examples]``: whole groups (files of the embedded task, lines of a
  labelled file) go to one side, by the seeded hash of ``layout.split_documents``."""
  groups = sorted({e.group for e in examples})
  is_val_group = dict(zip(groups, split_documents(groups, val_fraction, seed)))
  return np.array([is_val_group[e.group] for e in examples], bool)


def source_files(inputs: Sequence[str]) -> list[str]:
  """The files the examples come from (for the content hash)."""
  out = []
  root = sysconfig.get_paths()["stdlib"]
  for name in inputs:
    if name == STDLIB_TASK:
      for package in STDLIB_PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
          dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
          out.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
  return out


def prepare_classify(
  inputs: Sequence[str],
  out: str,
  *,
  tokenizer: str = "cl100k_base",
  vocab_from: str | None = None,
  val_fraction: float = 0.2,
  seed: int = 0,
  force: bool = False,
) -> dict[str, Any]:
  """Tokenizes labelled examples into a classification dataset (see the module docstring).

  Args:
    inputs: ``stdlib:packages``, ``.tsv``/``.jsonl`` files, globs or folders of them.
    out: The dataset directory.
    tokenizer: Tokenizer name (ignored with ``vocab_from``).
    vocab_from: A prepared dataset whose tokenizer and compact vocabulary to reuse, so the ids
      match a model pretrained on it (ids it lacks become ``[UNK]``).
    val_fraction: Fraction (or whole count) of groups for validation.
    seed: Split seed.
    force: Rebuild even if up to date.

  Returns:
    The metadata written to ``out/metadata.json``.
  """
  compact = None
  if vocab_from is not None:
    meta_file = os.path.join(vocab_from, layout.METADATA_FILE)
    if not os.path.exists(meta_file):
      raise ValueError(
        f"vocab_from={vocab_from!r} holds no prepared dataset ({layout.METADATA_FILE})"
      )
    src_meta = layout.read_metadata(vocab_from)
    tokenizer = src_meta["tokenizer"]
    if src_meta.get("compact_vocab"):
      compact = CompactVocab.load(os.path.join(vocab_from, src_meta["compact_vocab"]))
  options = {
    "format_version": layout.FORMAT_VERSION,
    "task": "classify",
    "tokenizer": tokenizer,
    "compact": None if compact is None else compact.to_json(),
    "val_fraction": val_fraction,
    "seed": seed,
    "inputs": sorted(inputs),
  }
  files = [Source(p, p, "text") for p in source_files(inputs)]
  for name in inputs:
    if name != STDLIB_TASK and os.path.isfile(name):
      files.append(Source(os.path.basename(name), name, "text"))
  content_hash = layout.content_hash(options, files, 2)
  if not force and (meta := layout.is_up_to_date(out, content_hash)) is not None:
    print(f"{out} is up to date (content hash {content_hash[:12]}); nothing to do")
    return meta
  examples = collect_examples(inputs)
  names = sorted({e.label for e in examples})
  label_id = {n: i for i, n in enumerate(names)}
  is_val = split_by_group(examples, val_fraction, seed)
  tok = Tokenizer(tokenizer, compact) if compact is not None else Tokenizer.from_name(tokenizer)
  texts = [e.text for e in examples]
  docs = [np.asarray(tok.encode(t), np.uint32) for t in texts]
  pairs = any(e.text_b is not None for e in examples)
  docs_b = [np.asarray(tok.encode(e.text_b or ""), np.uint32) for e in examples] if pairs else None
  labels = np.array([label_id[e.label] for e in examples], np.int32)
  os.makedirs(out, exist_ok=True)
  meta_path = os.path.join(out, layout.METADATA_FILE)
  if os.path.exists(meta_path):
    os.remove(meta_path)  # a half-rewritten directory must never look up to date
  splits, counts = {}, {}
  for split in layout.SPLITS:
    idx = np.flatnonzero(is_val if split == "val" else ~is_val)
    streams = {"tokens": layout.write_stream(out, split, [docs[i] for i in idx])}
    if pairs:
      streams["tokens_b"] = layout.write_stream(out, f"{split}_b", [docs_b[i] for i in idx])
    np.save(os.path.join(out, f"{split}{LABELS_SUFFIX}"), labels[idx])
    splits[split] = {
      "documents": int(idx.size),
      "tokens": sum(s["tokens"] for s in streams.values()),
      "streams": streams,
      "groups": len({examples[i].group for i in idx}),
    }
    counts[split] = label_counts(labels[idx], len(names))
  if compact is not None:
    compact.save(os.path.join(out, layout.COMPACT_VOCAB_FILE))
  meta = {
    **{k: v for k, v in options.items() if k != "compact"},
    "content_hash": content_hash,
    "vocab_size": tok.vocab_size,
    "num_regular_tokens": tok.num_regular,
    "special_tokens": tok.special_ids,
    "compact_vocab": layout.COMPACT_VOCAB_FILE if compact is not None else None,
    "dtype": "uint32",
    "labels": names,
    "label_counts": counts,
    "majority_baseline": majority_baseline(labels[~is_val], labels[is_val]),
    "splits": splits,
  }
  with open(meta_path + ".tmp", "w") as f:
    json.dump(meta, f, indent=2)
  os.replace(meta_path + ".tmp", meta_path)
  return meta
