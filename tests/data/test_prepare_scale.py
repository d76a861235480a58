"""``prepare`` at corpus scale: tokenizing on every core, shards with a size limit read as one
stream, resuming an interrupted run, and the dry run's estimate."""

import argparse
import importlib

import numpy as np
import pytest

from transformer_jax.cli.prepare import add_prepare_args
from transformer_jax.data import Tokenizer, prepare
from transformer_jax.data.shards import _gather

# The module (``transformer_jax.data.prepare`` is also the name of the function).
prepare_module = importlib.import_module("transformer_jax.data.prepare")


@pytest.mark.parametrize("name", ["cl100k_base", "chars:abdefnotx<|>"])
def test_encode_full_array_equals_encode_full(name):
  tok = Tokenizer(name)
  texts = ["abd", "", "a<|endoftext|>b"]
  if not name.startswith("chars:"):
    texts += ["naïve 日本 café\n\tdef f(x):\n", "lone \ud800 surrogate", "x" * 10_000]
  for text in texts:
    array = tok.encode_full_array(text)
    assert array.dtype == np.uint32
    assert array.tolist() == tok.encode_full(text), text


def test_gather_copies_runs_of_documents():
  rng = np.random.default_rng(0)
  lengths = rng.integers(0, 9, 200)
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  tokens = rng.integers(0, 1000, int(offsets[-1])).astype(np.uint32)
  for p in (0.05, 0.5, 1.0):
    docs = np.flatnonzero(rng.random(200) < p)
    want = np.concatenate([tokens[offsets[d] : offsets[d + 1]] for d in docs])
    np.testing.assert_array_equal(_gather(tokens, offsets, docs), want)


def test_workers_default_to_every_available_core(corpus_dir, tmp_path, monkeypatch):
  args = add_prepare_args(argparse.ArgumentParser()).parse_args(["x", "--out", "y"])
  assert args.workers is None
  seen = []
  real = prepare_module._Pipeline.__init__

  def spy(self, pool, workers, *rest):
    seen.append(workers)
    real(self, pool, workers, *rest)

  monkeypatch.setattr(prepare_module, "available_cores", lambda: 3)
  monkeypatch.setattr(prepare_module._Pipeline, "__init__", spy)
  prepare([str(corpus_dir)], str(tmp_path / "o"), progress=False)
  assert seen == [3]


# ---- shards with a size limit --------------------------------------------------------------------


def _batches(ds, kind, steps=4, **kw):
  from transformer_jax.data import make_loader

  loader = make_loader(kind, ds, **kw)
  return [loader.batch_at(s) for s in range(steps)]


def _assert_same(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_many_small_shards_read_as_the_one_stream(corpus_dir, text_dataset_dir, tmp_path):
  from transformer_jax.data import gpt_eval_batches, load_dataset, unigram_cross_entropy

  out = tmp_path / "sharded"
  meta = prepare(
    [str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False, shard_bytes=400
  )
  one, many = load_dataset(str(text_dataset_dir)), load_dataset(str(out))
  train = meta["splits"]["train"]["streams"]["tokens"]
  assert len(train["shards"]) > 5 and max(train["shard_tokens"]) == 100
  assert sum(train["shard_tokens"]) == train["tokens"]
  for split in ("train", "val"):
    a, b = one.stream(split), many.stream(split)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(a.offsets, b.offsets)
    for d in range(a.num_docs):
      np.testing.assert_array_equal(a.doc(d), b.doc(d))
  gpt = dict(batch_size=4, seq_len=32, seed=3)
  _assert_same(_batches(one, "gpt", **gpt), _batches(many, "gpt", **gpt))
  _assert_same(_batches(one, "bert", **gpt), _batches(many, "bert", **gpt))
  evals = dict(batch_size=4, seq_len=32)
  _assert_same(list(gpt_eval_batches(one, **evals)), list(gpt_eval_batches(many, **evals)))
  assert unigram_cross_entropy(one) == unigram_cross_entropy(many)


def test_sharded_pairs_give_the_same_seq2seq_batches(tmp_path):
  from transformer_jax.data import load_dataset

  kw = dict(task="seq2seq", val_fraction=0.1, seed=0, progress=False)
  prepare(["synthetic:reverse:300"], str(tmp_path / "one"), **kw)
  prepare(["synthetic:reverse:300"], str(tmp_path / "many"), shard_bytes=64, **kw)
  one, many = load_dataset(str(tmp_path / "one")), load_dataset(str(tmp_path / "many"))
  assert len(many.meta["splits"]["train"]["streams"]["src"]["shards"]) > 10
  _assert_same(_batches(one, "seq2seq", batch_size=8), _batches(many, "seq2seq", batch_size=8))


def test_sharded_tokens_index_like_the_concatenation():
  from transformer_jax.data.dataset import ShardedTokens

  rng = np.random.default_rng(1)
  parts = [rng.integers(0, 99, n).astype(np.uint32) for n in (5, 0, 7, 1, 9)]
  whole, view = np.concatenate(parts), ShardedTokens(parts)
  assert view.size == len(view) == whole.size and view.max() == whole.max()
  for key in (
    slice(None),
    slice(3, 14),
    slice(4, 5),
    slice(12, 12),
    slice(-6, None),
    slice(1, 20, 3),
  ):
    np.testing.assert_array_equal(view[key], whole[key])
  index = rng.integers(-whole.size, whole.size, (3, 4))
  np.testing.assert_array_equal(view[index], whole[index])
  assert view[13] == whole[13] and view[-1] == whole[-1]
  with pytest.raises(IndexError):
    view[np.array([whole.size])]


def test_a_shard_that_disagrees_with_its_index_is_named(corpus_dir, tmp_path):
  from transformer_jax.data import load_dataset

  out = tmp_path / "ds"
  prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  shard = out / "train_001.bin"
  shard.write_bytes(shard.read_bytes()[:-4])
  with pytest.raises(ValueError, match="train_001.bin: 99 tokens, the shard index"):
    load_dataset(str(out))
  # ... and a rebuild does not take the folder for up to date.
  prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  assert load_dataset(str(out)).stream("train").tokens.size > 0


def test_a_rebuild_with_bigger_shards_removes_the_extra_ones(corpus_dir, tmp_path):
  out = tmp_path / "ds"
  prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False, shard_bytes=400)
  assert (out / "train_005.bin").exists()
  meta = prepare([str(corpus_dir)], str(out), val_fraction=4, progress=False)
  assert meta["splits"]["train"]["streams"]["tokens"]["shards"] == ["train_000.bin"]
  assert sorted(p.name for p in out.glob("train_*.bin")) == ["train_000.bin"]
