"""The seq2seq loader: (source, target) pairs padded to the longest row of the global batch, and
the validation batches that cover every pair once (``data.loaders``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from transformer_jax.data.dataset import Dataset
from transformer_jax.data.loader_base import Batch, Loader, special_id


@dataclasses.dataclass(frozen=True)
class _Pairs:
  src_tokens: np.ndarray
  src_offsets: np.ndarray
  src_len: np.ndarray  # after truncation
  tgt_tokens: np.ndarray
  tgt_offsets: np.ndarray
  tgt_len: np.ndarray  # target tokens kept (without BOS/EOS)


def _pairs(
  dataset: Dataset, split: str, max_src_len: int | None, max_tgt_len: int | None
) -> _Pairs:
  if dataset.task != "seq2seq":
    raise ValueError(
      f"{dataset.path!r} is a {dataset.task!r} dataset; the seq2seq loader needs pairs"
    )
  src, tgt = dataset.stream(split, "src"), dataset.stream(split, "tgt")
  if src.num_docs == 0:
    raise ValueError(f"split {split!r} of {dataset.path!r} has no examples")
  src_len, tgt_len = src.lengths, tgt.lengths
  if max_src_len is not None:
    src_len = np.minimum(src_len, max_src_len)
  if max_tgt_len is not None:  # BOS/EOS take one of the max_tgt_len slots
    tgt_len = np.minimum(tgt_len, max_tgt_len - 1)
  return _Pairs(src.tokens, src.offsets, src_len, tgt.tokens, tgt.offsets, tgt_len)


def _round_up(n: int, multiple: int) -> int:
  return max(multiple, -(-n // multiple) * multiple)


def _pair_batch(
  p: _Pairs,
  ex_B: np.ndarray,
  valid_B: np.ndarray,
  rows: slice,
  bos: int,
  eos: int,
  pad: int,
  length_multiple: int,
) -> Batch:
  """Pads examples ``ex_B`` (global batch; shapes from all rows) and returns the local ``rows``."""
  src_len_B = np.where(valid_B, p.src_len[ex_B], 0)
  tgt_len_B = np.where(valid_B, p.tgt_len[ex_B], 0)
  S = _round_up(int(src_len_B.max()), length_multiple)
  T = _round_up(int(tgt_len_B.max()) + 1, length_multiple)
  ex_B, src_len_B, tgt_len_B = (
    ex_B[rows],
    src_len_B[rows],
    tgt_len_B[rows],
  )  # local rows from here on

  def take(tokens: np.ndarray, offsets: np.ndarray, length_B: np.ndarray, width: int, shift: int):
    t_W = np.arange(width) - shift
    inside_BW = (t_W >= 0) & (t_W < length_B[:, None])
    index_BW = np.clip(offsets[ex_B][:, None] + t_W, 0, max(tokens.size - 1, 0))
    return np.where(inside_BW, tokens[index_BW] if tokens.size else pad, pad), inside_BW

  src_BS, src_mask_BS = take(p.src_tokens, p.src_offsets, src_len_B, S, 0)
  tgt_BT, _ = take(p.tgt_tokens, p.tgt_offsets, tgt_len_B, T, 0)
  shifted_BT, _ = take(p.tgt_tokens, p.tgt_offsets, tgt_len_B, T, 1)
  t_T = np.arange(T)
  tgt_mask_BT = (t_T < (tgt_len_B[:, None] + 1)) & valid_B[rows, None]
  tgt_in_BT = np.where(t_T == 0, bos, shifted_BT)
  tgt_out_BT = np.where(t_T == tgt_len_B[:, None], eos, tgt_BT)
  return {
    "src": src_BS.astype(np.int32),
    "src_mask": src_mask_BS,
    "tgt_in": np.where(tgt_mask_BT, tgt_in_BT, pad).astype(np.int32),
    "tgt_out": np.where(tgt_mask_BT, tgt_out_BT, pad).astype(np.int32),
    "tgt_mask": tgt_mask_BT,
  }


class Seq2SeqLoader(Loader):
  """Length-bucketed, padded (source, target) batches.

  Each epoch (seeded by ``(seed, epoch)``) shuffles the examples, sorts pools of ``pool_batches``
  batches by length, cuts them into batches and shuffles the batch order; incomplete final batches
  are dropped (an epoch smaller than one batch repeats examples). Widths are the longest row of the
  global batch rounded up to ``length_multiple`` (bounding the number of distinct shapes jit sees).

  Batch: src [B, S], src_mask [B, S], tgt_in [B, T] (<bos> + target),
  tgt_out [B, T] (target + <eos>), tgt_mask [B, T] (True on the target length + 1), padding [PAD].
  """

  def __init__(
    self,
    dataset: Dataset,
    *,
    batch_size: int,
    seed: int = 0,
    split: str = "train",
    max_src_len: int | None = None,
    max_tgt_len: int | None = None,
    length_multiple: int = 8,
    pool_batches: int = 32,
    process_index: int | None = None,
    process_count: int | None = None,
  ):
    super().__init__(batch_size, seed, process_index, process_count)
    self._p = _pairs(dataset, split, max_src_len, max_tgt_len)
    self._special = {n: special_id(dataset, n) for n in ("<bos>", "<eos>", "[PAD]")}
    self.length_multiple = length_multiple
    self.pool_batches = pool_batches
    self.num_examples = self._p.src_len.size
    self.batches_per_epoch = max(1, self.num_examples // batch_size)
    self._plans: dict[int, np.ndarray] = {}

  @property
  def examples_per_epoch(self) -> tuple[int, str]:
    """Distinct training examples in one epoch, and what they are."""
    return self.num_examples, "source-target pairs"

  def _epoch_plan(self, epoch: int) -> np.ndarray:
    """Example indices of every batch of ``epoch``, shape ``[batches_per_epoch, batch_size]``."""
    if epoch in self._plans:
      return self._plans[epoch]
    rng = np.random.default_rng([self.seed, epoch])
    B, n = self.batch_size, self.num_examples
    order = rng.permutation(n)
    if n < B:
      order = np.resize(order, B)
    order = order[: self.batches_per_epoch * B]
    length = self._p.src_len + self._p.tgt_len
    pool = B * self.pool_batches
    for s in range(0, order.size, pool):
      chunk = order[s : s + pool]
      order[s : s + pool] = chunk[np.argsort(length[chunk], kind="stable")]
    plan = order.reshape(self.batches_per_epoch, B)[rng.permutation(self.batches_per_epoch)]
    if len(self._plans) > 1:
      self._plans.pop(min(self._plans))
    self._plans[epoch] = plan
    return plan

  def batch_at(self, step: int) -> Batch:
    epoch, b = divmod(step, self.batches_per_epoch)
    ex_B = self._epoch_plan(epoch)[b]
    return self.pair_batch(ex_B, np.ones(ex_B.size, bool))

  def pair_batch(self, ex_B: np.ndarray, valid_B: np.ndarray) -> Batch:
    """This process's rows of the padded global batch of examples ``ex_B`` (``[B]`` indices into
    the split); rows where ``valid_B`` is False get all-False masks."""
    s = self._special
    return _pair_batch(
      self._p,
      ex_B,
      valid_B,
      self.local_rows,
      s["<bos>"],
      s["<eos>"],
      s["[PAD]"],
      self.length_multiple,
    )


def seq2seq_eval_batches(
  dataset: Dataset,
  *,
  batch_size: int,
  split: str = "val",
  max_src_len: int | None = None,
  max_tgt_len: int | None = None,
  length_multiple: int = 8,
  process_index: int | None = None,
  process_count: int | None = None,
) -> Iterator[Batch]:
  """Every example of ``split`` once, in stored order; the last batch is padded with all-False-mask
  rows."""
  loader = Seq2SeqLoader(
    dataset,
    batch_size=batch_size,
    split=split,
    max_src_len=max_src_len,
    max_tgt_len=max_tgt_len,
    length_multiple=length_multiple,
    process_index=process_index,
    process_count=process_count,
  )
  n = loader.num_examples
  for start in range(0, n, batch_size):
    ex_B = start + np.arange(batch_size)
    valid_B = ex_B < n
    yield loader.pair_batch(np.where(valid_B, ex_B, 0), valid_B)
