import os
import random
import subprocess
import sys

import pytest

from transformer_jax import data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def text_dataset(tmp_path_factory):
  """A small prepared GPT/BERT dataset: 40 documents of pseudo-English lines."""
  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "delta", "value", "return", "self", "def", "class", "for",
           "in", "range", "print", "if", "else", "x", "y", "z", "the", "of"]
  for d in range(40):
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(30)]
    (root / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
  out = str(tmp_path_factory.mktemp("ds") / "text")
  data.prepare([str(root)], out, compact_vocab=True, progress=False, val_fraction=4)
  return out


@pytest.fixture(scope="session")
def reverse_dataset(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ds") / "reverse")
  data.prepare(["synthetic:reverse"], out, task="seq2seq", progress=False)
  return out


def run_tjax(*args, env=None, **kw):
  """Runs the CLI in a fresh interpreter (its own JAX device setup)."""
  full_env = {**os.environ, **(env or {})}
  return subprocess.run([sys.executable, "-m", "transformer_jax.cli", *args], cwd=REPO,
                        env=full_env, capture_output=True, text=True, **kw)


def pytest_configure(config):
  config.addinivalue_line("markers", "slow: end-to-end runs of the CLI in subprocesses")
