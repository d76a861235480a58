"""Loader tests: GPT packing, BERT MLM/NSP statistics, seq2seq padding, unigram learning bar."""

import re

import numpy as np
import pytest

from transformer_jax.data import (
  BertLoader,
  GPTLoader,
  Seq2SeqLoader,
  gpt_eval_batches,
  load_dataset,
  seq2seq_eval_batches,
  unigram_cross_entropy,
)

ONE = {"process_index": 0, "process_count": 1}


@pytest.fixture(scope="module")
def ds(text_dataset_dir):
  return load_dataset(text_dataset_dir)


@pytest.fixture(scope="module")
def rev(reverse_dataset_dir):
  return load_dataset(reverse_dataset_dir)


def _virtual_stream(ds, split="train"):
  """Documents joined by <|endoftext|> after each one, built independently of the loader."""
  s, eot = ds.stream(split), ds.meta["special_tokens"]["<|endoftext|>"]
  return np.concatenate([np.append(s.doc(d), eot) for d in range(s.num_docs)]).astype(np.int64)


# ---- GPT -----------------------------------------------------------------------------------------


def test_gpt_windows_come_from_the_stream_and_labels_shift(ds):
  loader = GPTLoader(ds, batch_size=8, seq_len=32, seed=0, **ONE)
  stream = _virtual_stream(ds)
  for step in (0, 5, 1000):
    batch = loader.batch_at(step)
    for row, start in enumerate(loader.window_starts(step)):
      np.testing.assert_array_equal(batch["tokens"][row], stream[start : start + 32])
      np.testing.assert_array_equal(batch["labels"][row], stream[start + 1 : start + 33])
    np.testing.assert_array_equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])
    assert batch["loss_mask"].all()
    assert all(v.shape[:2] == (8, 32) for v in batch.values())


def test_gpt_segments_change_exactly_after_eot(ds):
  loader = GPTLoader(ds, batch_size=16, seq_len=64, seed=1, **ONE)
  eot = ds.meta["special_tokens"]["<|endoftext|>"]
  seen_boundary = False
  for step in range(5):
    b = loader.batch_at(step)
    seg, pos, tok = b["segment_ids"], b["positions"], b["tokens"]
    assert (seg[:, 0] == 1).all() and (pos[:, 0] == 0).all()
    after_eot = tok[:, :-1] == eot
    np.testing.assert_array_equal(np.diff(seg, axis=1), after_eot.astype(np.int32))
    np.testing.assert_array_equal(pos[:, 1:], np.where(after_eot, 0, pos[:, :-1] + 1))
    seen_boundary |= after_eot.any()
  assert seen_boundary


def test_gpt_mask_cross_document(ds):
  loader = GPTLoader(ds, batch_size=16, seq_len=64, seed=1, mask_cross_document=True, **ONE)
  b = loader.batch_at(0)
  eot = ds.meta["special_tokens"]["<|endoftext|>"]
  np.testing.assert_array_equal(b["loss_mask"], b["tokens"] != eot)


def test_gpt_deterministic_and_resumable(ds):
  a = GPTLoader(ds, batch_size=4, seq_len=16, seed=7, **ONE)
  b = GPTLoader(ds, batch_size=4, seq_len=16, seed=7, **ONE)
  for k in a.batch_at(3):
    np.testing.assert_array_equal(a.batch_at(3)[k], b.batch_at(3)[k])
  assert not np.array_equal(a.batch_at(3)["tokens"], a.batch_at(4)["tokens"])
  assert not np.array_equal(
    a.batch_at(3)["tokens"],
    GPTLoader(ds, batch_size=4, seq_len=16, seed=8, **ONE).batch_at(3)["tokens"],
  )
  first = [next(a) for _ in range(3)]
  state = a.get_state()
  assert state == {"step": 3, "sequences": 12}
  expected = next(a)
  b.set_state(state)
  np.testing.assert_array_equal(next(b)["tokens"], expected["tokens"])
  np.testing.assert_array_equal(first[1]["tokens"], b.batch_at(1)["tokens"])


def test_gpt_process_shares_are_disjoint_and_cover_the_global_batch(ds):
  full = GPTLoader(ds, batch_size=8, seq_len=16, seed=0, **ONE)
  parts = [
    GPTLoader(ds, batch_size=8, seq_len=16, seed=0, process_index=i, process_count=2)
    for i in (0, 1)
  ]
  for step in (0, 9):
    halves = [p.batch_at(step)["tokens"] for p in parts]
    np.testing.assert_array_equal(np.concatenate(halves), full.batch_at(step)["tokens"])
  # One epoch visits every window exactly once: windows never overlap between rows or processes.
  steps = full.num_windows // full.batch_size
  starts = np.concatenate([full.window_starts(s) for s in range(steps)])
  assert len(np.unique(starts)) == len(starts)
  assert np.all(np.diff(np.sort(starts)) >= 16)
  with pytest.raises(ValueError, match="divisible"):
    GPTLoader(ds, batch_size=7, seq_len=16, process_index=0, process_count=2)


def test_gpt_eval_covers_the_validation_split_once(ds):
  batches = list(gpt_eval_batches(ds, batch_size=4, seq_len=32, **ONE))
  stream = _virtual_stream(ds, "val")
  labels = np.concatenate([b["labels"][b["loss_mask"]] for b in batches])
  np.testing.assert_array_equal(labels, stream[1:])
  again = list(gpt_eval_batches(ds, batch_size=4, seq_len=32, **ONE))
  assert len(again) == len(batches)
  assert all(np.array_equal(x["tokens"], y["tokens"]) for x, y in zip(batches, again))
  assert all(b["tokens"].shape == (4, 32) for b in batches)


class _CountingTokens(np.ndarray):
  """A token array that records how many elements each read takes."""

  reads: list[int]

  def __getitem__(self, key):
    out = super().__getitem__(key)
    self.reads.append(int(np.size(out)))
    return np.asarray(out)


def _count_reads(loader, step: int) -> list[int]:
  tokens = loader._tokens.view(_CountingTokens)  # pylint: disable=protected-access
  tokens.reads = []
  loader._tokens = tokens  # pylint: disable=protected-access
  loader.batch_at(step)
  return tokens.reads


@pytest.mark.parametrize("batch_size", [4, 16])
def test_gpt_batch_is_one_vectorised_gather_at_any_step(ds, batch_size):
  # A batch costs one gather of its own B x (T + 1) tokens, at step 0 as at step 10^6 (many epochs
  # in): no per-row Python loop, no scan of earlier steps. Speed itself belongs to benchmarks.
  loader = GPTLoader(ds, batch_size=batch_size, seq_len=32, **ONE)
  for step in (0, 10**6):
    assert _count_reads(loader, step) == [batch_size * 33]


# ---- BERT ----------------------------------------------------------------------------------------


def _bert_stats(ds, steps=60, batch_size=32, seq_len=64):
  loader = BertLoader(ds, batch_size=batch_size, seq_len=seq_len, seed=0, **ONE)
  return [loader.batch_at(s) for s in range(steps)]


def test_bert_layout_cls_sep_token_types(ds):
  tok = ds.tokenizer
  for b in _bert_stats(ds, steps=5):
    for row in range(b["tokens"].shape[0]):
      n = int(b["attention_mask"][row].sum())
      assert b["attention_mask"][row, :n].all() and not b["attention_mask"][row, n:].any()
      orig = np.where(b["mlm_mask"][row], b["mlm_labels"][row], b["tokens"][row])
      assert orig[0] == tok.cls_id and orig[n - 1] == tok.sep_id
      seps = np.flatnonzero(orig == tok.sep_id)
      assert len(seps) == 2
      types = b["token_types"][row]
      assert (
        (types[: seps[0] + 1] == 0).all()
        and (types[seps[0] + 1 : n] == 1).all()
        and (types[n:] == 0).all()
      )
      assert (b["tokens"][row, n:] == tok.pad_id).all()
      inner = np.delete(orig[1 : n - 1], seps[0] - 1)
      assert not np.isin(inner, [tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id]).any()


def test_bert_masking_rates(ds):
  tok = ds.tokenizer
  batches = _bert_stats(ds)
  real = masked = as_mask = random = kept = 0
  for b in batches:
    real_BT = b["attention_mask"] & ~np.isin(
      np.where(b["mlm_mask"], b["mlm_labels"], b["tokens"]), [tok.cls_id, tok.sep_id]
    )
    assert not (b["mlm_mask"] & ~real_BT).any(), "only real tokens are predicted"
    per_row = b["mlm_mask"].sum(1)
    np.testing.assert_array_equal(per_row, np.maximum(1, np.round(0.15 * real_BT.sum(1))))
    m = b["mlm_mask"]
    real += real_BT.sum()
    masked += m.sum()
    as_mask += (b["tokens"][m] == tok.mask_id).sum()
    kept += (b["tokens"][m] == b["mlm_labels"][m]).sum()
    random += ((b["tokens"][m] != tok.mask_id) & (b["tokens"][m] != b["mlm_labels"][m])).sum()
    assert (b["mlm_labels"][~m] == 0).all()
    assert (b["tokens"][m] < tok.num_regular).sum() + (
      b["tokens"][m] == tok.mask_id
    ).sum() == m.sum()
  assert 0.14 < masked / real < 0.16
  assert abs(as_mask / masked - 0.8) < 0.025
  assert abs(random / masked - 0.1) < 0.02
  assert abs(kept / masked - 0.1) < 0.02


def test_bert_nsp_balance_and_pair_semantics(ds):
  loader = BertLoader(ds, batch_size=32, seq_len=64, seed=3, mask_prob=0.0, **ONE)
  tok = ds.tokenizer
  texts = {
    ds.tokenizer.decode(ds.stream("train").doc(d)) for d in range(ds.stream("train").num_docs)
  }
  labels = []
  for step in range(40):
    b = loader.batch_at(step)
    assert not b["mlm_mask"].any()
    labels.append(b["nsp_labels"])
    for row in range(4):
      t = b["tokens"][row]
      sep1, sep2 = np.flatnonzero(t == tok.sep_id)
      a_ids, b_ids = t[1:sep1], t[sep1 + 1 : sep2]
      docs_a = set(re.findall(r"doc(\d+)-", tok.decode(a_ids)))
      docs_b = set(re.findall(r"doc(\d+)-", tok.decode(b_ids)))
      if b["nsp_labels"][row] == 0:  # IsNext: A then B is contiguous text of one document
        assert any(tok.decode(np.concatenate([a_ids, b_ids])) in x for x in texts)
      elif docs_a and docs_b:  # NotNext: B comes from another document
        assert not docs_a & docs_b
  labels = np.concatenate(labels)
  assert abs(labels.mean() - 0.5) < 0.06


def test_bert_deterministic_and_sharded(ds):
  full = BertLoader(ds, batch_size=8, seq_len=48, seed=5, **ONE)
  parts = [
    BertLoader(ds, batch_size=8, seq_len=48, seed=5, process_index=i, process_count=2)
    for i in (0, 1)
  ]
  a, b = full.batch_at(11), full.batch_at(11)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k])
    np.testing.assert_array_equal(np.concatenate([p.batch_at(11)[k] for p in parts]), a[k])
  assert not np.array_equal(a["tokens"], full.batch_at(12)["tokens"])


@pytest.mark.parametrize("batch_size", [4, 16])
def test_bert_batch_is_one_vectorised_gather_at_any_step(ds, batch_size):
  loader = BertLoader(ds, batch_size=batch_size, seq_len=48, **ONE)
  for step in (0, 10**6):
    assert _count_reads(loader, step) == [batch_size * 48]


# ---- seq2seq -------------------------------------------------------------------------------------


def test_seq2seq_reverse_targets_and_masks(rev):
  tok = rev.tokenizer
  loader = Seq2SeqLoader(rev, batch_size=32, seed=0, **ONE)
  for step in (0, 1, 57):
    b = loader.batch_at(step)
    assert b["src"].shape[1] % 8 == 0 and b["tgt_in"].shape[1] % 8 == 0
    for row in range(32):
      src = b["src"][row][b["src_mask"][row]]
      n = int(b["tgt_mask"][row].sum())  # target length + 1
      assert 3 <= len(src) <= 12 and n == len(src) + 1
      assert (
        not b["src_mask"][row, len(src) :].any() and (b["src"][row, len(src) :] == tok.pad_id).all()
      )
      np.testing.assert_array_equal(b["tgt_out"][row, : n - 1], src[::-1])
      assert b["tgt_out"][row, n - 1] == tok.eos_id and b["tgt_in"][row, 0] == tok.bos_id
      np.testing.assert_array_equal(b["tgt_in"][row, 1:n], b["tgt_out"][row, : n - 1])
      assert (b["tgt_in"][row, n:] == tok.pad_id).all() and (
        b["tgt_out"][row, n:] == tok.pad_id
      ).all()
      assert tok.decode(b["tgt_out"][row, : n - 1]) == tok.decode(src)[::-1]


def test_seq2seq_bucketing_deterministic_sharded(rev):
  loader = Seq2SeqLoader(rev, batch_size=32, seed=0, **ONE)
  spreads = [np.ptp(loader.batch_at(s)["src_mask"].sum(1)) for s in range(20)]
  assert np.mean(spreads) <= 3  # length-bucketed: lengths in a batch are close (random batches: ~9)
  parts = [
    Seq2SeqLoader(rev, batch_size=32, seed=0, process_index=i, process_count=2) for i in (0, 1)
  ]
  for k, v in loader.batch_at(4).items():
    np.testing.assert_array_equal(np.concatenate([p.batch_at(4)[k] for p in parts]), v)
    np.testing.assert_array_equal(
      Seq2SeqLoader(rev, batch_size=32, seed=0, **ONE).batch_at(4)[k], v
    )
  assert not np.array_equal(loader.batch_at(4)["src"], loader.batch_at(5)["src"])


def test_seq2seq_eval_covers_each_example_once(rev):
  n = rev.stream("val", "src").num_docs
  batches = list(seq2seq_eval_batches(rev, batch_size=64, **ONE))
  assert len(batches) == -(-n // 64)
  assert sum(int(b["tgt_mask"].any(1).sum()) for b in batches) == n
  src = rev.stream("val", "src")
  first = batches[0]["src"][0][batches[0]["src_mask"][0]]
  np.testing.assert_array_equal(first, src.doc(0))


# ---- unigram learning bar ------------------------------------------------------------------------


def test_unigram_cross_entropy_matches_float64_reference(ds):
  V = ds.vocab_size
  train, val = _virtual_stream(ds, "train"), _virtual_stream(ds, "val")
  counts = np.zeros(V, dtype=np.float64)
  np.add.at(counts, train, 1.0)
  prob = (counts + 1.0) / (len(train) + V)
  expected = float(np.mean(-np.log(prob[val])))
  assert unigram_cross_entropy(ds) == pytest.approx(expected, rel=1e-9)
  assert 0 < expected < np.log(V)
