"""Shared small corpora for the data tests."""

import random

import pytest

WORDS = (
  "alpha beta gamma delta return import class def self value index total count node item "
  "über naïve 日本 café None True False"
).split()


def write_corpus(root, num_docs: int = 24, seed: int = 0) -> list:
  """Writes ``num_docs`` code-like text files ``doc_XX.txt``; every line is tagged
  ``doc{d}-line{k}``."""
  rng = random.Random(seed)
  root.mkdir(parents=True, exist_ok=True)
  paths = []
  for d in range(num_docs):
    lines = []
    for k in range(rng.randint(15, 40)):
      words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))
      lines.append(f"{'    ' * rng.randint(0, 2)}doc{d}-line{k} = {words}")
    path = root / f"doc_{d:02d}.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    paths.append(path)
  return paths


@pytest.fixture(scope="session")
def make_corpus():
  """The corpus writer, as a fixture (test modules cannot import conftest reliably)."""
  return write_corpus


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpus")
  write_corpus(root)
  return root


@pytest.fixture(scope="session")
def text_dataset_dir(corpus_dir, tmp_path_factory):
  from transformer_jax.data import prepare

  out = tmp_path_factory.mktemp("ds") / "text"
  prepare([str(corpus_dir)], str(out), val_fraction=4, seed=0, progress=False)
  return out


@pytest.fixture(scope="session")
def reverse_dataset_dir(tmp_path_factory):
  from transformer_jax.data import prepare

  out = tmp_path_factory.mktemp("ds") / "reverse"
  prepare(
    ["synthetic:reverse:3000"], str(out), task="seq2seq", val_fraction=0.1, seed=0, progress=False
  )
  return out
