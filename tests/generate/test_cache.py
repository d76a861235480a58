"""Cached decoding equals full recomputation, step by step, for every position-encoding flavour."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate
from tests.generate.conftest import (
  GPT_CASES,
  full_forward,
  gpt_config,
  gpt_model,
  last_logits,
  random_prompts,
)

TOL = 1e-4


@pytest.mark.parametrize("case", list(GPT_CASES))
def test_cached_logits_match_full_forward_every_step(case):
  config, model = gpt_config(case), gpt_model(case)
  graphdef, params = nnx.split(model)

  @jax.jit
  def extend(params, tokens, cache, num_valid):
    return generate.extend(nnx.merge(graphdef, params), tokens, cache, num_valid)

  # Two rows of different lengths, right-padded with junk, prefilled together in one call.
  prompts = random_prompts(1, [6, 3])
  width = 8
  padded = np.full((2, width), 5, np.int32)
  for i, p in enumerate(prompts):
    padded[i, : len(p)] = p
  lengths = jnp.asarray([len(p) for p in prompts], jnp.int32)
  cache = generate.init_cache(config, 2, 24)
  logits, cache = extend(params, jnp.asarray(padded), cache, lengths)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [6, 3])
  for i, p in enumerate(prompts):
    want = np.stack([last_logits(params, config, p[: j + 1]) for j in range(len(p))])
    got = np.asarray(logits[i, : len(p)])
    assert np.abs(got - want).max() <= TOL, (case, "prefill", i)

  # One-token steps with arbitrary next tokens (past the sliding window and past the padding).
  seqs = [list(p) for p in prompts]
  next_tokens = np.random.RandomState(2).randint(0, config.vocab_size, size=(9, 2))
  for step, toks in enumerate(next_tokens):
    logits, cache = extend(params, jnp.asarray(toks[:, None], jnp.int32), cache, None)
    for i in range(2):
      seqs[i].append(int(toks[i]))
      want = last_logits(params, config, seqs[i])
      diff = np.abs(np.asarray(logits[i, 0]) - want).max()
      assert diff <= TOL, (case, step, i, diff)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [15, 12])
  # The padded-buffer reference is the plain forward pass over exactly the sequence so far.
  exact = np.asarray(full_forward(config)(params, jnp.asarray([seqs[0]], jnp.int32))[0, -1])
  assert np.abs(exact - last_logits(params, config, seqs[0])).max() <= TOL


def test_cache_stores_only_kv_heads():
  config = gpt_config("llama-rope-mqa")
  cache = generate.init_cache(config, 3, 16)
  assert cache.shape == (config.num_layers, 3, 16, 1, config.head_size)
  # One heads-major [B * K, S, H] array per layer, for keys and for values.
  chex.assert_shape(cache.k + cache.v, (3 * 1, 16, config.head_size))
  assert len(cache.k) == len(cache.v) == config.num_layers


def test_init_cache_rejects_length_beyond_learned_positions():
  with pytest.raises(ValueError, match="max_len=65"):
    generate.init_cache(gpt_config("gpt2-learned"), 1, 65)


def test_cache_requires_no_positions_argument():
  model = gpt_model("gpt2-learned")
  cache = generate.init_cache(model.config, 1, 8)
  with pytest.raises(ValueError, match="positions"):
    model(jnp.zeros((1, 2), jnp.int32), positions=jnp.zeros((1, 2), jnp.int32), cache=cache)
