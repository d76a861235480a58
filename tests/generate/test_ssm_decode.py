"""Decoding Mamba-1, Mamba-2 and hybrid models in the compiled loop: greedy, sampling and beam
search equal naive loops of full forward passes, ragged prompts, cached == uncached, and a state
whose size does not grow with the length."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import generate, models
from transformer_jax.generate import beam
from tests.generate.conftest import VOCAB, naive_greedy, random_prompts
from tests.generate.test_beam import assert_matches_naive, gpt_next_logp, naive_beam_search

NEW = 7
CASES = {"mamba1": "mamba-tiny", "mamba2": "mamba2-tiny", "hybrid": "hybrid-tiny"}


@functools.lru_cache(maxsize=None)
def ssm_config(case):
  # Chunks of 4 positions: prompts span several chunks of the prefill's scan.
  return models.get_config(CASES[case], vocab_size=VOCAB, init_std=0.3, max_len=64, ssm_chunk=4)


@functools.lru_cache(maxsize=None)
def ssm_model(case):
  return models.create(ssm_config(case))


# Mamba-2's greedy tokens are checked against transformers' generate (tests/hf/test_mamba_hf.py).
@pytest.mark.parametrize("case", ["mamba1", "hybrid"])
def test_greedy_equals_naive_full_forward_loop(case):
  model = ssm_model(case)
  prompts = random_prompts(3, [5, 9, 1])
  out = np.asarray(generate.generate(model, prompts, max_new_tokens=NEW))
  for i, p in enumerate(prompts):
    assert out[i].tolist() == naive_greedy(model, p, NEW), (case, i)


@pytest.mark.parametrize("case", ["mamba2", "hybrid"])
def test_batch_of_different_lengths_equals_each_alone_left_and_right_padding(case):
  model = ssm_model(case)
  prompts = random_prompts(4, [3, 11, 6])
  alone = [np.asarray(generate.generate(model, [p], max_new_tokens=NEW))[0] for p in prompts]
  width = 11
  right = np.zeros((3, width), np.int32)
  left = np.zeros((3, width), np.int32)
  for i, p in enumerate(prompts):
    right[i, : len(p)] = p
    left[i, width - len(p) :] = p
  lengths = [len(p) for p in prompts]
  got_right = generate.generate(model, right, prompt_lengths=lengths, max_new_tokens=NEW)
  got_left = generate.generate(
    model, left, prompt_lengths=lengths, max_new_tokens=NEW, padding_side="left"
  )
  np.testing.assert_array_equal(got_right, np.stack(alone))
  np.testing.assert_array_equal(got_left, np.stack(alone))


def test_sampling_top_k_one_equals_greedy_and_samples_follow_the_key():
  model = ssm_model("mamba1")
  prompts = random_prompts(5, [4, 8])
  greedy = generate.generate(model, prompts, max_new_tokens=NEW)
  top1 = generate.generate(
    model, prompts, max_new_tokens=NEW, temperature=1.5, top_k=1, key=jax.random.key(3)
  )
  np.testing.assert_array_equal(top1, greedy)
  a = generate.generate(model, prompts, max_new_tokens=NEW, temperature=1.0, key=jax.random.key(4))
  b = generate.generate(model, prompts, max_new_tokens=NEW, temperature=1.0, key=jax.random.key(4))
  c = generate.generate(model, prompts, max_new_tokens=NEW, temperature=1.0, key=jax.random.key(5))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


@pytest.mark.parametrize("case", ["mamba1", "hybrid"])
def test_beam_search_equals_naive_beam_search(case):
  model, num_beams = ssm_model(case), 3
  prompts = random_prompts(32, [4, 10])
  out = beam.beam_search(model, prompts, num_beams=num_beams, max_new_tokens=5, length_penalty=0.5)
  for row, prompt in enumerate(prompts):
    finished, _ = naive_beam_search(
      gpt_next_logp(model, prompt), num_beams=num_beams, max_new_tokens=5, length_penalty=0.5
    )
    assert_matches_naive(out, row, finished, num_beams, 0)


@pytest.mark.parametrize("case", CASES)
def test_cached_steps_equal_the_uncached_forward(case):
  """A prefill of 6 tokens, then one token at a time: every position's logits equal one forward
  pass over the whole sequence (float32, 1e-4)."""
  model = ssm_model(case)
  toks = jnp.asarray(random_prompts(6, [13])[0])[None]
  step = jax.jit(lambda t, c: generate.extend(model, t, c))
  full = jax.jit(lambda t: model(t))(toks)
  logits, cache = step(toks[:, :6], generate.init_cache(model.config, 1, 16))
  got = [logits]
  for i in range(6, 13):
    logits, cache = step(toks[:, i : i + 1], cache)
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, 1), full, rtol=1e-4, atol=1e-4)
  assert int(cache.lengths[0]) == 13


@pytest.mark.parametrize("case", ["mamba1", "mamba2"])
def test_the_decoding_state_does_not_grow_with_the_length(case):
  config = models.get_config(CASES[case], vocab_size=VOCAB, max_len=1 << 16)
  sizes = {
    n: [x.shape for x in jax.tree.leaves(generate.init_cache(config, 2, n))] for n in (1024, 32768)
  }
  assert sizes[1024] == sizes[32768]
  # One compiled step serves every position: its state has the same shapes after any number of
  # tokens, so time and memory per token do not depend on how many came before.
  model = models.create(config)
  cache = generate.init_cache(config, 2, 32768)
  traces = []

  @jax.jit
  def step(t, c):
    traces.append(1)
    return generate.extend(model, t, c)

  tok = jnp.zeros((2, 1), jnp.int32)
  shapes = [x.shape for x in jax.tree.leaves(cache)]
  for _ in range(5):
    _, cache = step(tok, cache)
  assert len(traces) == 1 and [x.shape for x in jax.tree.leaves(cache)] == shapes


def test_hybrid_cache_holds_keys_only_for_its_attention_layers():
  config = ssm_config("hybrid")
  cache = generate.init_cache(config, 2, 32)
  assert len(cache.conv) == len(cache.ssm) == 2 and len(cache.kv.k) == 1
  assert cache.kv.k[0].shape == (2 * config.kv_heads, 32, config.head_size)
