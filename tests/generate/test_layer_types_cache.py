"""Decoding a stack of local (sliding) and global layers (Gemma's ``layer_types``): each sliding
layer keeps a rolling cache of W slots and each global one ``max_len`` slots; cached decoding
gives the uncached model's logits and tokens through prompts longer than the window; and the
cache's size is what the layer counts say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate, models
from tests.models.conftest import full_forward_greedy

W = 6
TYPES = ("sliding_attention", "full_attention", "sliding_attention", "sliding_attention")


@pytest.fixture(scope="module")
def model():
  config = models.get_config(
    "gemma3-tiny", num_layers=4, layer_types=TYPES, sliding_window=W, vocab_size=97, max_len=96
  )
  return nnx.merge(models.graphdef(config), models.init(config, jax.random.key(3)))


def test_each_layer_gets_its_own_slots(model):
  cache = generate.init_cache(model.config, 2, 50)
  assert [k.shape[1] for k in cache.k] == [W, 50, W, W]
  assert [v.shape[1] for v in cache.v] == [W, 50, W, W]
  assert cache.windows == (W, None, W, W)
  assert [cache.layer(i).window for i in range(4)] == [W, None, W, W]
  short = generate.init_cache(model.config, 2, W - 1)  # shorter than the window: no rolling
  assert short.windows is None and all(k.shape[1] == W - 1 for k in short.k)


def test_cached_logits_equal_uncached_past_the_window(model):
  """A prompt of 9 (> W) in one call, then one token at a time to 23: every position's logits
  as the full forward pass gives them."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 23)))
  call = nnx.jit(lambda m, ids, cache=None: m(ids, cache=cache))  # compiled, not op by op
  full = call(model, tokens)
  cache = generate.init_cache(model.config, 2, 23)
  logits, cache = call(model, tokens[:, :9], cache)
  steps = [logits]
  for t in range(9, 23):
    logits, cache = call(model, tokens[:, t : t + 1], cache)
    steps.append(logits)
  # float32 rounding of the same sums taken over cache slots in another order.
  np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("prompt_len", [4, 13])  # shorter and longer than the window
def test_greedy_equals_the_full_forward(model, prompt_len):
  prompt = np.random.default_rng(prompt_len).integers(0, 97, (2, prompt_len))
  ours = np.asarray(generate.generate(model, prompt, max_new_tokens=3 * W))
  np.testing.assert_array_equal(ours, full_forward_greedy(model, prompt, 3 * W))


def test_ragged_rows_keep_their_own_windows(model):
  rng = np.random.default_rng(7)
  rows = [rng.integers(0, 97, 11), rng.integers(0, 97, 3)]
  ours = np.asarray(generate.generate(model, [list(r) for r in rows], max_new_tokens=2 * W))
  for i, row in enumerate(rows):
    want = full_forward_greedy(model, np.asarray(row)[None], 2 * W)[0]
    np.testing.assert_array_equal(ours[i], want)


def _cache_bytes(config, max_len):
  shapes = jax.eval_shape(lambda: generate.init_cache(config, 1, max_len, "bfloat16"))
  return sum(x.size * x.dtype.itemsize for x in (*shapes.k, *shapes.v))


def test_gemma3_1b_cache_memory_against_all_global():
  """gemma3-1b's stack (22 local layers of W = 512, 4 global) at 32768 tokens, bfloat16: per
  layer and slot K * H * 2 (keys and values) * 2 bytes = 1 KiB."""
  c = models.get_config("gemma3-1b")
  assert c.layer_types.count("full_attention") == 4 and c.sliding_window == 512
  slot = c.kv_heads * c.head_size * 2 * 2
  mixed = _cache_bytes(c, 32768)
  assert mixed == (22 * 512 + 4 * 32768) * slot == 145_752_064  # 139 MiB
  everything = _cache_bytes(
    models.get_config("gemma3-1b", layer_types=None, rope_local_theta=None, sliding_window=None),
    32768,
  )
  assert everything == 26 * 32768 * slot == 872_415_232  # 832 MiB, 5.99x the mixed stack
