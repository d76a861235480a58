"""Deterministic numpy batch loaders: GPT packing, BERT MLM + NSP pairs, seq2seq padded pairs.

Every loader is a pure function of ``(seed, step)``: ``batch_at(step)`` always returns the same
batch, so resuming from a checkpoint is exact. Iterating calls ``batch_at(step)`` with an internal
counter exposed by ``get_state()`` / ``set_state()`` as ``{"step": n, "sequences": m}`` (the data
position in sequences, ``data.loader_base``); the GPT loader may start a step at any sequence, so
a resumed run may change its global batch size.

``batch_size`` is the *global* batch. Randomness is drawn for the whole global batch and process
``i`` of ``n`` keeps rows ``[i * B / n, (i + 1) * B / n)``, so processes read disjoint shares of the
same global batch and every process agrees on shapes (seq2seq pads to the longest row of the global
batch).

Batches are dicts of numpy arrays: ids ``int32``, masks ``bool`` (True = real token / predicted
position).

Why not Grain: Grain's ``MapDataset`` would express the same random-access, (seed, step)-pure
pipeline, but its transforms run per example in Python, while these loaders build a whole batch with
a handful of vectorised numpy gathers from memory-mapped shards (a 16 x 256 GPT batch in ~100 us).
The batch construction itself is the determinism guarantee, so Grain would add per-example
overhead without adding reproducibility; its multi-worker prefetching is not needed at these costs
(measured against Grain's ``DataLoader``: experiments/PERFORMANCE.md, "Data path").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from transformer_jax.data.dataset import Dataset
from transformer_jax.data.loader_base import Batch, Loader, process_info, special_id, text_stream
from transformer_jax.data.seq2seq_loader import Seq2SeqLoader, seq2seq_eval_batches

__all__ = [
  "Batch",
  "BertLoader",
  "GPTLoader",
  "Loader",
  "Seq2SeqLoader",
  "bert_eval_batches",
  "gpt_eval_batches",
  "make_loader",
  "process_info",
  "seq2seq_eval_batches",
  "unigram_cross_entropy",
]


# ---- GPT -----------------------------------------------------------------------------------------


class GPTLoader(Loader):
  """Packed next-token windows over the split's documents, each followed by ``<|endoftext|>``.

  The virtual stream ``doc_0 eot doc_1 eot ...`` (eot inserted on the fly, not stored) is cut into
  windows of ``seq_len + 1`` tokens starting at ``shift_e + w * seq_len``; each epoch ``e`` draws a
  random shift and a random permutation of the windows from ``(seed, e)``, so each token is seen
  once per epoch. Sequence ``g`` of the run is window ``g mod num_windows`` of epoch
  ``g // num_windows``; the batch of a step holds the next ``batch_size`` sequences, whatever the
  batch size before (``sequence_offsets``).

  Batch (local rows ``B``, ``T = seq_len``):
      tokens [B, T] int32; labels [B, T] int32 (tokens shifted by one);
      segment_ids [B, T] int32: 1 for the first document in the window, +1 at each document start
          (the token after an eot); 0 marks padding (only in eval batches past the end of the
          stream);
      positions [B, T] int32: offset from the start of the token's document *within this window* (a
          document that began before the window counts from 0 at the window start), so positions
          stay < T;
      loss_mask [B, T] bool: label exists; with ``mask_cross_document=True`` also False where the
          input is an eot (predicting the next document's first token from nothing). The default
          keeps those positions, as GPT-2 / nanoGPT do.
  """

  sequence_offsets = True

  def __init__(
    self,
    dataset: Dataset,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    split: str = "train",
    process_index: int | None = None,
    process_count: int | None = None,
    mask_cross_document: bool = False,
  ):
    super().__init__(batch_size, seed, process_index, process_count)
    if seq_len <= 0:
      raise ValueError(f"seq_len must be positive, got {seq_len}")
    stream = text_stream(dataset, split)
    self.seq_len = seq_len
    self.mask_cross_document = mask_cross_document
    self._tokens = stream.tokens
    self._offsets = stream.offsets
    self._lengths = stream.lengths
    self._eot = special_id(dataset, "<|endoftext|>")
    # Virtual start of document d in the eot-separated stream: offsets[d] + d.
    self._vstarts = self._offsets[:-1] + np.arange(stream.num_docs)
    self.stream_len = int(self._offsets[-1]) + stream.num_docs
    self.num_windows = max(1, (self.stream_len - seq_len) // seq_len)
    self._perms: dict[int, tuple[int, np.ndarray]] = {}

  @property
  def examples_per_epoch(self) -> tuple[int, str]:
    """Distinct training examples in one epoch, and what they are."""
    return self.num_windows, f"windows of {self.seq_len + 1} tokens"

  def _epoch_plan(self, epoch: int) -> tuple[int, np.ndarray]:
    if epoch not in self._perms:
      rng = np.random.default_rng([self.seed, epoch])
      shift = int(rng.integers(0, self.seq_len)) if self.stream_len >= 2 * self.seq_len + 1 else 0
      if len(self._perms) > 2:
        self._perms.pop(min(self._perms))
      self._perms[epoch] = (shift, rng.permutation(self.num_windows))
    return self._perms[epoch]

  def window_starts(self, step: int) -> np.ndarray:
    """Virtual start positions of the global batch's windows at ``step``, shape ``[batch_size]``."""
    return self.starts_of(self.sequences_at(step) + np.arange(self.batch_size, dtype=np.int64))

  def starts_of(self, index: np.ndarray) -> np.ndarray:
    """Virtual start positions of the windows with sequence indices ``index`` (row ``g`` of the
    loader's whole sequence: epoch ``g // num_windows``)."""
    epochs, within = np.divmod(np.asarray(index, np.int64), self.num_windows)
    starts = np.empty(epochs.shape, dtype=np.int64)
    for epoch in np.unique(epochs):  # a batch spans at most two epochs
      shift, perm = self._epoch_plan(int(epoch))
      sel = epochs == epoch
      starts[sel] = shift + perm[within[sel]] * self.seq_len
    return starts

  def documents_at(self, starts: np.ndarray) -> np.ndarray:
    """The document (index in the split) where each window starting at ``starts`` begins."""
    return np.searchsorted(self._vstarts, np.asarray(starts, np.int64), side="right") - 1

  def batch_at(self, step: int) -> Batch:
    return self.gather(self.window_starts(step)[self.local_rows])

  def gather(self, starts_B: np.ndarray) -> Batch:
    """Builds a batch from virtual window starts (starts >= stream length give all-padding rows)."""
    T = self.seq_len
    p_BT1 = starts_B[:, None] + np.arange(T + 1)  # [B, T+1]
    valid_BT1 = p_BT1 < self.stream_len
    p_BT1 = np.minimum(p_BT1, self.stream_len - 1)
    doc_BT1 = np.searchsorted(self._vstarts, p_BT1, side="right") - 1
    in_doc_BT1 = p_BT1 - self._vstarts[doc_BT1]
    is_eot_BT1 = in_doc_BT1 == self._lengths[doc_BT1]
    index_BT1 = np.minimum(self._offsets[doc_BT1] + in_doc_BT1, self._tokens.size - 1)
    seq_BT1 = np.where(is_eot_BT1 | ~valid_BT1, self._eot, self._tokens[index_BT1]).astype(np.int32)

    doc_BT, valid_BT = doc_BT1[:, :-1], valid_BT1[:, :-1]
    t_T = np.arange(T)
    new_doc_BT = np.ones_like(valid_BT)
    new_doc_BT[:, 1:] = doc_BT[:, 1:] != doc_BT[:, :-1]
    seg_start_BT = np.maximum.accumulate(np.where(new_doc_BT, t_T, 0), axis=1)
    loss_mask_BT = valid_BT1[:, 1:].copy()
    if self.mask_cross_document:
      loss_mask_BT &= ~is_eot_BT1[:, :-1]
    return {
      "tokens": seq_BT1[:, :-1],
      "labels": seq_BT1[:, 1:],
      "segment_ids": np.where(valid_BT, doc_BT - doc_BT[:, :1] + 1, 0).astype(np.int32),
      "positions": (t_T - seg_start_BT).astype(np.int32),
      "loss_mask": loss_mask_BT,
    }


def gpt_eval_batches(
  dataset: Dataset,
  *,
  batch_size: int,
  seq_len: int,
  split: str = "val",
  process_index: int | None = None,
  process_count: int | None = None,
  max_batches: int | None = None,
) -> Iterator[Batch]:
  """Finite, fixed-order GPT batches covering the whole split once (consecutive windows, no shift).

  The last batch is padded with rows whose ``loss_mask`` is all False, so every batch has the same
  shape.
  """
  loader = GPTLoader(
    dataset,
    batch_size=batch_size,
    seq_len=seq_len,
    split=split,
    process_index=process_index,
    process_count=process_count,
  )
  num_windows = -(-(loader.stream_len - 1) // seq_len)
  num_batches = -(-num_windows // batch_size)
  if max_batches is not None:
    num_batches = min(num_batches, max_batches)
  for b in range(num_batches):
    w = b * batch_size + np.arange(batch_size, dtype=np.int64)
    starts = np.where(w < num_windows, w * seq_len, loader.stream_len)
    yield loader.gather(starts[loader.local_rows])


# ---- BERT ----------------------------------------------------------------------------------------


class BertLoader(Loader):
  """BERT pre-training pairs ``[CLS] A [SEP] B [SEP] [PAD]...`` with MLM masking and NSP labels.

  Sentences: a "sentence" is a line (it ends after a token whose text contains a newline, which
  suits source code); lines longer than ``max_sentence_tokens`` are cut into pieces of that many
  tokens. Segment A starts at a random sentence that has a successor in its document and extends
  over whole sentences up to a random target length in ``[1, seq_len - 4]`` (cut mid-sentence only
  if its first sentence is longer). With probability 1/2, B is the text that follows A in the same
  document (``nsp_labels`` 0 = IsNext), otherwise it starts at a random sentence of another document
  (1 = NotNext, as in Hugging Face). B is truncated to fill the remaining ``seq_len - 3 - len(A)``
  slots.

  Masking (as in BERT's create_pretraining_data): ``max(1, round(mask_prob * n))`` of the ``n`` real
  A/B tokens of each row are predicted (none if ``mask_prob == 0``); of those 80% become [MASK], 10%
  a random ordinary token, 10% stay unchanged.

  Batch: tokens, token_types (0 for [CLS] A [SEP], 1 for B [SEP], 0 padding), attention_mask (bool),
  mlm_labels (original id where predicted, else 0), mlm_mask (bool), all [B, T]; nsp_labels [B].
  """

  def __init__(
    self,
    dataset: Dataset,
    *,
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    split: str = "train",
    mask_prob: float = 0.15,
    max_sentence_tokens: int = 64,
    process_index: int | None = None,
    process_count: int | None = None,
  ):
    super().__init__(batch_size, seed, process_index, process_count)
    if seq_len < 5:
      raise ValueError(f"seq_len must be >= 5 for [CLS] A [SEP] B [SEP], got {seq_len}")
    stream = text_stream(dataset, split)
    self.seq_len = seq_len
    self.mask_prob = mask_prob
    self._tokens = stream.tokens
    self._ids = {name: special_id(dataset, name) for name in ("[CLS]", "[SEP]", "[PAD]", "[MASK]")}
    self._num_regular = int(dataset.meta["num_regular_tokens"])
    self._build_sentences(stream.offsets, dataset.tokenizer.newline_table(), max_sentence_tokens)

  def _build_sentences(
    self, offsets: np.ndarray, newline_V: np.ndarray, max_sentence_tokens: int
  ) -> None:
    n_tok = self._tokens.size
    lengths = np.diff(offsets)
    line_start = np.zeros(n_tok, dtype=bool)
    line_start[offsets[:-1][lengths > 0]] = True
    line_start[1:] |= newline_V[np.asarray(self._tokens[:-1])]
    # Cut long lines every max_sentence_tokens tokens, counted from the line's start.
    line_id = np.cumsum(line_start) - 1
    rel = np.arange(n_tok) - np.flatnonzero(line_start)[line_id]
    starts = np.flatnonzero(line_start | (rel % max_sentence_tokens == 0))
    doc = np.searchsorted(offsets, starts, side="right") - 1
    has_next = np.zeros(starts.size, dtype=bool)
    has_next[:-1] = doc[1:] == doc[:-1]
    if not has_next.any():
      raise ValueError(
        "BERT pairs need a document with at least two sentences (lines or "
        f"{max_sentence_tokens}-token pieces); every document here has one"
      )
    self._starts, self._doc = starts, doc
    self._doc_end = offsets[1:]
    # Last sentence start of each document (documents with sentences only).
    self._docs = np.unique(doc)  # non-empty documents
    first = np.searchsorted(doc, self._docs, side="left")
    last = np.searchsorted(doc, self._docs, side="right") - 1
    self._first_sent, self._num_sent = first, last - first + 1
    self._last_start = np.zeros(len(offsets) - 1, dtype=np.int64)
    self._last_start[self._docs] = starts[last]
    self._doc_rank = np.zeros(len(offsets) - 1, dtype=np.int64)
    self._doc_rank[self._docs] = np.arange(self._docs.size)
    self._candidates = np.flatnonzero(has_next)

  @property
  def examples_per_epoch(self) -> tuple[int, str]:
    """Distinct segment-A starts (sentences with a successor), and what they are."""
    return int(self._candidates.size), "sentences that can start a pair"

  def batch_at(self, step: int) -> Batch:
    B, T = self.batch_size, self.seq_len
    rng = np.random.default_rng([self.seed, step])
    max_tokens = T - 3
    # --- segment A: whole sentences from a random start, up to a random target length.
    i = self._candidates[rng.integers(0, self._candidates.size, B)]
    a_start, a_doc = self._starts[i], self._doc[i]
    a_target = rng.integers(1, max_tokens, B)
    k = np.searchsorted(self._starts, a_start + a_target, side="right") - 1
    a_end = np.where(
      k > i, np.minimum(self._starts[k], self._last_start[a_doc]), a_start + a_target
    )
    a_len = a_end - a_start
    budget = max_tokens - a_len
    # --- segment B: the continuation (IsNext) or a random sentence of another document (NotNext).
    is_next = rng.random(B) < 0.5
    n_docs = self._docs.size
    other = rng.integers(0, max(n_docs - 1, 1), B)
    other = np.where((n_docs > 1) & (other >= self._doc_rank[a_doc]), other + 1, other)
    j = self._first_sent[other] + (rng.random(B) * self._num_sent[other]).astype(np.int64)
    b_start = np.where(is_next, a_end, self._starts[j])
    b_doc = np.where(is_next, a_doc, self._doc[j])
    b_len = np.minimum(budget, self._doc_end[b_doc] - b_start)
    # --- masking randomness for the global batch (drawn before slicing, so shares are disjoint).
    keys_BT = rng.random((B, T))
    action_BT = rng.random((B, T))
    random_tok_BT = rng.integers(0, self._num_regular, (B, T))

    r = self.local_rows
    a_start, a_len, b_start, b_len = a_start[r], a_len[r], b_start[r], b_len[r]
    t_T = np.arange(T)
    a_len_B1, b_len_B1 = a_len[:, None], b_len[:, None]
    in_a_BT = (t_T >= 1) & (t_T <= a_len_B1)
    in_b_BT = (t_T >= a_len_B1 + 2) & (t_T < a_len_B1 + 2 + b_len_B1)
    sep_BT = (t_T == a_len_B1 + 1) | (t_T == a_len_B1 + 2 + b_len_B1)
    index_BT = np.where(
      in_a_BT,
      a_start[:, None] + t_T - 1,
      np.where(in_b_BT, b_start[:, None] + t_T - a_len_B1 - 2, 0),
    )
    real_BT = in_a_BT | in_b_BT
    orig_BT = np.where(real_BT, self._tokens[index_BT], self._ids["[PAD]"])
    orig_BT = np.where(sep_BT, self._ids["[SEP]"], orig_BT)
    orig_BT[:, 0] = self._ids["[CLS]"]

    n_pred_B = np.maximum(1, np.round(self.mask_prob * (a_len + b_len))).astype(np.int64)
    keys_BT = np.where(real_BT, keys_BT[r], 2.0)  # non-candidates sort last
    threshold_B1 = np.take_along_axis(np.sort(keys_BT, axis=1), n_pred_B[:, None] - 1, axis=1)
    mlm_mask_BT = real_BT & (keys_BT <= threshold_B1) & (self.mask_prob > 0)
    action_BT = action_BT[r]
    tokens_BT = np.where(mlm_mask_BT & (action_BT < 0.8), self._ids["[MASK]"], orig_BT)
    tokens_BT = np.where(
      mlm_mask_BT & (action_BT >= 0.8) & (action_BT < 0.9), random_tok_BT[r], tokens_BT
    )
    return {
      "tokens": tokens_BT.astype(np.int32),
      "token_types": (in_b_BT | (t_T == a_len_B1 + 2 + b_len_B1)).astype(np.int32),
      "attention_mask": t_T < a_len_B1 + b_len_B1 + 3,
      "mlm_labels": np.where(mlm_mask_BT, orig_BT, 0).astype(np.int32),
      "mlm_mask": mlm_mask_BT,
      "nsp_labels": (~is_next[r]).astype(np.int32),
    }


def bert_eval_batches(
  dataset: Dataset,
  *,
  batch_size: int,
  seq_len: int,
  num_batches: int = 20,
  seed: int = 0,
  split: str = "val",
  process_index: int | None = None,
  process_count: int | None = None,
) -> Iterator[Batch]:
  """A fixed, finite set of BERT batches from the validation split: steps ``0..num_batches-1`` of
  ``seed``."""
  loader = BertLoader(
    dataset,
    batch_size=batch_size,
    seq_len=seq_len,
    seed=seed,
    split=split,
    process_index=process_index,
    process_count=process_count,
  )
  for step in range(num_batches):
    yield loader.batch_at(step)


# ---- learning bar --------------------------------------------------------------------------------


def unigram_cross_entropy(dataset: Dataset, split: str = "val") -> float:
  """Cross-entropy (nats/token) of ``split`` under the train split's add-one-smoothed unigram
  distribution.

  Both streams are counted as the GPT loader sees them: each document followed by ``<|endoftext|>``.
  A GPT that has learned anything beats this number.
  """
  V = dataset.vocab_size
  eot = special_id(dataset, "<|endoftext|>")

  def counts(name: str) -> np.ndarray:
    stream = text_stream(dataset, name)
    c = np.bincount(np.asarray(stream.tokens), minlength=V).astype(np.float64)
    c[eot] += stream.num_docs
    return c

  train, val = counts("train"), counts(split)
  log_p = np.log(train + 1.0) - np.log(train.sum() + V)
  return float(-(val * log_p).sum() / val.sum())


def make_loader(kind: str, dataset: Dataset, **kwargs: Any) -> Loader:
  """Returns ``GPTLoader`` / ``BertLoader`` / ``Seq2SeqLoader`` for ``kind`` in gpt | bert |
  seq2seq."""
  match kind:
    case "gpt":
      return GPTLoader(dataset, **kwargs)
    case "bert":
      return BertLoader(dataset, **kwargs)
    case "seq2seq":
      return Seq2SeqLoader(dataset, **kwargs)
    case _:
      raise ValueError(f"unknown loader kind {kind!r}; expected gpt, bert or seq2seq")
