"""Weighted mixtures of prepared GPT datasets, with weight stages by step.

A mixture reads several prepared datasets (``tjax prepare``), each through the GPT packing logic
of :class:`~transformer_jax.data.loaders.GPTLoader`: source ``s`` has its own sequence of windows
(``seq_len + 1`` tokens from a per-epoch permutation), and its ``q``-th window is the one the
GPT loader would give as its ``q``-th row.

Each step's global batch is a block of ``batch_size`` rows. Within a stage (the weights from one
``data.stages`` step to the next; the first stage has the sources' own weights), the rows are dealt
to the sources in the order of the arrival times ``(j + 1/2) / w_s`` (source ``s``'s ``j``-th
row; ties go to the earlier source): the Sainte-Laguë (Webster) apportionment. For two sources it
is the largest-remainder rounding; for any number it is house-monotone, so every block holds each
source's share of the block rounded, with the rounding carried from block to block, and every
prefix of the stage holds ``n * w_s / sum(w)`` rows within ``(S + 1) / 2`` for ``S`` sources. The
counts are exact rational arithmetic on the weights, so every machine deals the same rows.

How many rows a source got before a step is a closed form of the stage boundaries (each full stage's
count plus the current stage's prefix), never a replay: the batch is a pure function of (config,
step), resume and topology changes stay exact. Within a block, the rows are shuffled by
``(seed, step)``; source ``s``'s rows of the block take its next sequence indices in row order.
Process ``i`` of ``n`` keeps rows ``[i * B / n, (i + 1) * B / n)`` of the shuffled block and gathers
only those windows.

A source that runs out starts its next epoch (a new permutation) with a notice on stderr;
``max_epochs`` refuses to start epoch ``max_epochs + 1`` of any source.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from transformer_jax.data.dataset import Dataset, load_dataset
from transformer_jax.data.layout import METADATA_FILE
from transformer_jax.data.loader_base import Batch, Loader
from transformer_jax.data.loaders import GPTLoader


class MixtureError(ValueError):
  """A bad mixture setting; ``key`` is its dotted key (``data.mixture[1].weight``)."""

  def __init__(self, key: str, message: str):
    super().__init__(message)
    self.key = key


@dataclasses.dataclass(frozen=True)
class MixtureSource:
  """One source of ``data.mixture``: a prepared dataset with a name and a weight."""

  name: str | None = None  # how metrics, final.json and ``tjax data`` name it
  path: str | None = None  # a prepared gpt dataset directory (tjax prepare)
  weight: float | None = None  # relative share of the rows (> 0; normalised over the sources)


@dataclasses.dataclass(frozen=True)
class MixtureStage:
  """One entry of ``data.stages``: the weights from ``step`` on (sources it does not name keep
  their weights)."""

  step: int | None = None
  weights: dict[str, float] | None = None  # source name -> weight (>= 0; 0 pauses the source)


def _number(value) -> float | None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value)


def check_mixture(
  sources: Sequence[MixtureSource],
  stages: Sequence[MixtureStage] = (),
  max_epochs: int | None = None,
) -> None:
  """Checks ``data.mixture``, ``data.stages`` and ``data.max_epochs``.

  Raises:
    MixtureError: naming the key and the value: a source without a name or path, a repeated
      name, a weight that is not a positive finite number; a stage without a step, a step not
      above the previous one, a weight for a name the mixture lacks, or a negative, non-finite or
      all-zero weight; stages or max_epochs without a mixture; max_epochs < 1.
  """
  if not sources:
    for key, given in (("data.stages", bool(stages)), ("data.max_epochs", max_epochs is not None)):
      if given:
        raise MixtureError(key, f"{key} applies to data.mixture, which is empty")
    return
  names: list[str] = []
  for i, s in enumerate(sources):
    where = f"data.mixture[{i}]"
    if not isinstance(s.name, str) or not s.name.strip():
      raise MixtureError(f"{where}.name", f"{where}.name={s.name!r}: expected a source name")
    if s.name in names:
      raise MixtureError(
        f"{where}.name",
        f"{where}.name={s.name!r} repeats data.mixture[{names.index(s.name)}]'s name",
      )
    names.append(s.name)
    if not isinstance(s.path, str) or not s.path:
      raise MixtureError(
        f"{where}.path", f"{where}.path is missing: give the prepared dataset (tjax prepare)"
      )
    w = _number(s.weight)
    if w is None or not math.isfinite(w) or w <= 0:
      raise MixtureError(
        f"{where}.weight", f"{where}.weight={s.weight!r}: expected a positive finite number"
      )
  previous = 0
  for i, stage in enumerate(stages):
    where = f"data.stages[{i}]"
    if not isinstance(stage.step, int) or stage.step <= previous:
      after = f"above data.stages[{i - 1}].step={previous}" if i else "a step >= 1"
      raise MixtureError(f"{where}.step", f"{where}.step={stage.step!r}: expected {after}")
    previous = stage.step
    if not isinstance(stage.weights, dict) or not stage.weights:
      raise MixtureError(
        f"{where}.weights", f"{where}.weights={stage.weights!r}: expected a mapping name: weight"
      )
    for name, value in stage.weights.items():
      if name not in names:
        close = difflib.get_close_matches(str(name), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise MixtureError(
          f"{where}.weights.{name}",
          f"{where}.weights: unknown source {name!r}{hint}; the mixture has {', '.join(names)}",
        )
      w = _number(value)
      if w is None or not math.isfinite(w) or w < 0:
        raise MixtureError(
          f"{where}.weights.{name}",
          f"{where}.weights.{name}={value!r}: expected a finite number >= 0",
        )
  for i, weights in enumerate(stage_weights(sources, stages)[1]):
    if i and not any(weights):
      raise MixtureError(
        f"data.stages[{i - 1}].weights", f"data.stages[{i - 1}]: every source's weight is 0"
      )
  if max_epochs is not None and (isinstance(max_epochs, bool) or max_epochs < 1):
    raise MixtureError("data.max_epochs", f"data.max_epochs={max_epochs!r} must be >= 1")


def stage_weights(
  sources: Sequence[MixtureSource], stages: Sequence[MixtureStage] = ()
) -> tuple[list[int], list[tuple[float, ...]]]:
  """The stages' first steps (0 first) and each stage's weight per source, in source order."""
  names = [s.name for s in sources]
  current = {s.name: float(s.weight) for s in sources}
  starts, weights = [0], [tuple(current[n] for n in names)]
  for stage in stages:
    current.update({k: float(v) for k, v in stage.weights.items()})
    starts.append(int(stage.step))
    weights.append(tuple(current[n] for n in names))
  return starts, weights


# ---- the apportionment -----------------------------------------------------------------------


def _rank(w: Sequence[Fraction], s: int, j: int) -> int:
  """How many rows come before source ``s``'s ``j``-th row (arrival ``(2j + 1) / w_s``; sources
  before ``s`` win ties)."""
  key = Fraction(2 * j + 1) / w[s]
  rank = j
  for t, wt in enumerate(w):
    if t == s or wt == 0:
      continue
    y = key * wt  # source t's rows with 2j' + 1 < y (<= y for earlier sources) come first
    rank += math.floor((y + 1) / 2) if t < s else max(0, math.ceil((y - 1) / 2))
  return rank


def prefix_counts(w: Sequence[Fraction], n: int) -> np.ndarray:
  """Rows each source gets among the first ``n`` rows of a stage with weights ``w``."""
  out = np.zeros(len(w), np.int64)
  for s, ws in enumerate(w):
    if ws == 0 or n == 0:
      continue
    lo, hi = 0, n  # the first j whose rank is >= n: the count
    while lo < hi:
      mid = (lo + hi) // 2
      if _rank(w, s, mid) < n:
        lo = mid + 1
      else:
        hi = mid
    out[s] = lo
  return out


class Schedule:
  """Rows per source of every step of a mixture (closed form from the stage boundaries)."""

  def __init__(self, starts: Sequence[int], weights: Sequence[Sequence[float]], batch_size: int):
    self.starts = list(starts)
    self.weights = [tuple(Fraction(x) for x in w) for w in weights]
    self.batch_size = batch_size
    self._cache: dict[int, np.ndarray] = {}

  def stage_of(self, step: int) -> int:
    return int(np.searchsorted(self.starts, step, side="right")) - 1

  def consumed(self, step: int) -> np.ndarray:
    """Rows each source got in the steps before ``step``."""
    if step not in self._cache:
      if len(self._cache) > 64:
        self._cache.clear()
      k = self.stage_of(step)
      total = np.zeros(len(self.weights[0]), np.int64)
      for i in range(k):  # the full stages before
        total += prefix_counts(
          self.weights[i], (self.starts[i + 1] - self.starts[i]) * self.batch_size
        )
      total += prefix_counts(self.weights[k], (step - self.starts[k]) * self.batch_size)
      self._cache[step] = total
    return self._cache[step]

  def rows_at(self, step: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, sequence index)`` of each row of the global batch at ``step``, ``[B]`` each."""
    before, after = self.consumed(step), self.consumed(step + 1)
    source_B = np.repeat(np.arange(before.size), after - before)
    source_B = source_B[np.random.default_rng([seed, step, 0x6D6978]).permutation(source_B.size)]
    index_B = np.empty(source_B.size, np.int64)
    for s in range(before.size):
      sel = source_B == s
      index_B[sel] = before[s] + np.arange(int(sel.sum()))
    return source_B, index_B


# ---- the loader ------------------------------------------------------------------------------


def _same_vocabulary(first: Dataset, other: Dataset) -> bool:
  keys = ("tokenizer", "vocab_size", "special_tokens")
  if any(first.meta.get(k) != other.meta.get(k) for k in keys):
    return False
  files = [d.meta.get("compact_vocab") for d in (first, other)]
  if not any(files):
    return True
  if not all(files):
    return False
  a, b = (open(os.path.join(d.path, f), "rb").read() for d, f in zip((first, other), files))
  return a == b


class MixtureLoader(Loader):
  """GPT batches drawn from several datasets by weight (see the module's docstring).

  Batch: as :class:`GPTLoader`'s (tokens, labels, segment_ids, positions, loss_mask).
  """

  def __init__(
    self,
    sources: Sequence[tuple[str, Dataset, float]],
    *,
    batch_size: int,
    seq_len: int,
    stages: Sequence[tuple[int, dict[str, float]]] = (),
    seed: int = 0,
    split: str = "train",
    max_epochs: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    mask_cross_document: bool = False,
  ):
    super().__init__(batch_size, seed, process_index, process_count)
    specs = [MixtureSource(n, d.path, w) for n, d, w in sources]
    stage_specs = [MixtureStage(step, dict(w)) for step, w in stages]
    check_mixture(specs, stage_specs, max_epochs)
    self.names = [n for n, _, _ in sources]
    self.datasets = [d for _, d, _ in sources]
    for name, dataset in zip(self.names[1:], self.datasets[1:]):
      self.check_vocabulary(dataset, f"mixture source {name!r}")
    self.seq_len, self.max_epochs = seq_len, max_epochs
    self.loaders = [
      GPTLoader(
        d,
        batch_size=batch_size,
        seq_len=seq_len,
        seed=seed,
        split=split,
        process_index=0,
        process_count=1,
        mask_cross_document=mask_cross_document,
      )
      for _, d, _ in sources
    ]
    self.schedule = Schedule(*stage_weights(specs, stage_specs), batch_size)
    self._noticed: set[tuple[int, int]] = set()

  def check_vocabulary(self, dataset: Dataset, what: str = "the evaluation dataset") -> None:
    """Refuses ``dataset`` (a source, or the dataset a run evaluates on) when its tokenizer or
    vocabulary is not the first source's."""
    first = self.datasets[0]
    if not _same_vocabulary(first, dataset):
      raise ValueError(
        f"{what} ({dataset.path}) has another tokenizer or vocabulary than mixture source "
        f"{self.names[0]!r} ({first.path}); prepare every dataset with the same tokenizer "
        "(and --vocab-from the first source with --compact-vocab)"
      )

  @property
  def examples_per_epoch(self) -> tuple[int, str]:
    """Windows over all sources in one epoch of each."""
    return sum(x.num_windows for x in self.loaders), f"windows of {self.seq_len + 1} tokens"

  def rows_at(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source, sequence index)`` of each row of the global batch at ``step``; checks the
    epochs and says when a source starts a new one."""
    source_B, index_B = self.schedule.rows_at(step, self.seed)
    for s, loader in enumerate(self.loaders):
      sel = source_B == s
      if not sel.any():
        continue
      epoch = int(index_B[sel].max()) // loader.num_windows
      self._check_epoch(s, epoch, step)
      if epoch > 0 and (s, epoch) not in self._noticed:
        self._noticed.add((s, epoch))
        print(
          f"data: mixture source {self.names[s]!r} runs out at step {step} and repeats: epoch "
          f"{epoch + 1} of its {loader.num_windows} windows",
          file=sys.stderr,
          flush=True,
        )
    return source_B, index_B

  def _check_epoch(self, s: int, epoch: int, step: int) -> None:
    if self.max_epochs is not None and epoch >= self.max_epochs:
      loader = self.loaders[s]
      raise ValueError(
        f"data.max_epochs={self.max_epochs}: mixture source {self.names[s]!r} "
        f"({loader.num_windows} windows of {self.seq_len + 1} tokens) would start epoch "
        f"{epoch + 1} at step {step}; prepare more data, lower its weight or raise "
        "data.max_epochs"
      )

  def check_steps(self, steps: int) -> None:
    """Refuses, before training, a run of ``steps`` steps that needs more epochs of a source
    than ``max_epochs`` (naming the source and the step where it would start the next one)."""
    if self.max_epochs is None or steps <= 0:
      return
    first = None  # (step, source) of the earliest source past its limit
    for s, loader in enumerate(self.loaders):
      limit = self.max_epochs * loader.num_windows
      if self.schedule.consumed(steps)[s] <= limit:
        continue
      lo, hi = 0, steps  # the first step whose rows pass the limit
      while lo < hi:
        mid = (lo + hi) // 2
        if self.schedule.consumed(mid + 1)[s] > limit:
          hi = mid
        else:
          lo = mid + 1
      first = min(first or (lo, s), (lo, s))
    if first is not None:
      self._check_epoch(first[1], self.max_epochs, first[0])

  def tokens_consumed(self, step: int) -> dict[str, int]:
    """Tokens (``seq_len`` a row) each source gave the steps before ``step``, all processes."""
    rows = self.schedule.consumed(step)
    return {n: int(r) * self.seq_len for n, r in zip(self.names, rows)}

  def batch_at(self, step: int) -> Batch:
    source_B, index_B = self.rows_at(step)
    source_B, index_B = source_B[self.local_rows], index_B[self.local_rows]
    out: Batch = {}
    for s, loader in enumerate(self.loaders):
      sel = np.flatnonzero(source_B == s)
      if not sel.size:
        continue
      part = loader.gather(loader.starts_of(index_B[sel]))
      for key, value in part.items():
        if key not in out:
          out[key] = np.empty((source_B.size, *value.shape[1:]), value.dtype)
        out[key][sel] = value
    return out

  def row_documents(self, step: int) -> list[tuple[str, int]]:
    """``(source name, document index)`` of each row of the global batch at ``step``: the
    document of the split where the row's window starts."""
    source_B, index_B = self.rows_at(step)
    doc_B = np.empty(source_B.size, np.int64)
    for s, loader in enumerate(self.loaders):
      sel = source_B == s
      doc_B[sel] = loader.documents_at(loader.starts_of(index_B[sel]))
    return [(self.names[s], int(d)) for s, d in zip(source_B, doc_B)]


def row_documents(loader: Loader, step: int, name: str = "data") -> list[tuple[str, int]]:
  """``(source, document)`` of each row of ``loader``'s global batch at ``step``: a mixture's
  sources by name, a single GPT dataset as ``name``."""
  if isinstance(loader, MixtureLoader):
    return loader.row_documents(step)
  if isinstance(loader, GPTLoader):
    return [(name, int(d)) for d in loader.documents_at(loader.window_starts(step))]
  raise ValueError(f"row documents are known for GPT loaders, not {type(loader).__name__}")


def load_mixture(
  sources: Sequence[MixtureSource],
  stages: Sequence[MixtureStage] = (),
  **kwargs,
) -> MixtureLoader:
  """The :class:`MixtureLoader` of ``data.mixture`` / ``data.stages`` (each source loaded from its
  prepared directory); ``kwargs`` go to the loader (batch_size, seq_len, seed, max_epochs...).

  Raises:
    ValueError: a source that holds no prepared dataset, or one prepared for another task than gpt
      (named with its index and path).
  """
  loaded = []
  for i, s in enumerate(sources):
    if not os.path.isfile(os.path.join(s.path, METADATA_FILE)):
      raise ValueError(
        f"data.mixture[{i}].path={s.path!r} holds no prepared dataset; prepare it with tjax prepare"
      )
    dataset = load_dataset(s.path)
    if dataset.task not in ("gpt", "bert"):  # both hold plain text documents
      raise ValueError(
        f"data.mixture[{i}].path={s.path!r} was prepared for task {dataset.task!r}; a mixture "
        "reads gpt datasets"
      )
    loaded.append((s.name, dataset, s.weight))
  return MixtureLoader(loaded, stages=[(st.step, st.weights) for st in stages], **kwargs)
