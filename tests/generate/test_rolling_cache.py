"""Sliding-window decoding with a rolling cache: W slots used as a ring, the same tokens as the
full uncached forward pass, past the window, for greedy, sampled and beam-searched generation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate, models
from tests.models.conftest import full_forward_greedy
from transformer_jax.models import gpt as gpt_module

W = 8


@pytest.fixture(scope="module")
def model():
  config = models.get_config("mistral-tiny", sliding_window=W, dropout_rate=0.0)
  return nnx.merge(models.graphdef(config), models.init(config, jax.random.key(5)))


def test_the_cache_holds_the_window_whatever_the_length():
  config = models.get_config("mistral-tiny", sliding_window=W)
  for max_len in (100, 10_000, 1_000_000):
    cache = generate.init_cache(config, 2, max_len)
    assert cache.window == W and cache.shape == (2, 2, W, 2, 16)
  short = generate.init_cache(config, 2, W - 1)  # shorter than the window: plain slots
  assert short.window is None and short.max_len == W - 1
  llama = generate.init_cache(models.get_config("llama-tiny"), 2, 100)
  assert llama.window is None and llama.max_len == 100


@pytest.mark.parametrize("prompt_len", [3, 13])  # shorter and longer than the window
def test_greedy_past_the_window_equals_the_full_forward(model, prompt_len):
  prompt = np.random.default_rng(prompt_len).integers(0, 512, (2, prompt_len))
  ours = np.asarray(generate.generate(model, prompt, max_new_tokens=3 * W))
  np.testing.assert_array_equal(ours, full_forward_greedy(model, prompt, 3 * W))


def test_rows_of_different_lengths_keep_their_own_window(model):
  # Right padding: the padded tokens of the shorter row must not overwrite its real entries.
  rng = np.random.default_rng(7)
  rows = [rng.integers(0, 512, 11), rng.integers(0, 512, 4)]
  ours = np.asarray(generate.generate(model, [list(r) for r in rows], max_new_tokens=2 * W))
  for i, row in enumerate(rows):
    want = full_forward_greedy(model, np.asarray(row)[None], 2 * W)[0]
    np.testing.assert_array_equal(ours[i], want)


def _plain_cache(monkeypatch):
  """Caches of max_len slots even for a windowed model (the window applied by masking only)."""
  zeros = gpt_module.KVCache.zeros
  monkeypatch.setattr(
    gpt_module.KVCache, "zeros", classmethod(lambda cls, *a, window=None: zeros(*a, window=None))
  )


def test_sampling_and_beam_search_give_what_a_plain_cache_gives(model, monkeypatch):
  prompt = np.random.default_rng(9).integers(0, 512, (2, 11))
  sample = dict(max_new_tokens=2 * W, temperature=0.8, top_k=20, key=jax.random.key(3))
  rolling = (
    np.asarray(generate.generate(model, prompt, **sample)),
    generate.beam_search(model, prompt, num_beams=3, max_new_tokens=2 * W),
  )
  _plain_cache(monkeypatch)
  assert generate.init_cache(model.config, 2, 100).window is None
  plain = (
    np.asarray(generate.generate(model, prompt, **sample)),
    generate.beam_search(model, prompt, num_beams=3, max_new_tokens=2 * W),
  )
  np.testing.assert_array_equal(rolling[0], plain[0])
  for a, b in zip(jax.tree.leaves(rolling[1]), jax.tree.leaves(plain[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_step_reads_the_same_bytes_late_as_early(model):
  # The per-token work does not grow: one compiled step, the same cache shape at any length.
  config = model.config
  cache = generate.init_cache(config, 1, 10_000)
  step = jax.jit(lambda c, t: generate.extend(model, t, c))
  tok = jnp.zeros((1, 1), jnp.int32)
  shapes = set()
  for _ in range(3 * W):
    _, cache = step(cache, tok)
    shapes.add(cache.shape)
  assert shapes == {(2, 1, W, 2, 16)} and int(cache.lengths[0]) == 3 * W
  assert step._cache_size() == 1
