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
