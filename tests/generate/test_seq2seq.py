"""Seq2Seq decoder cache (self-attention cache + cross-attention keys/values computed once) equals
the full model, step by step, for sinusoidal (Transformer) and T5 relative-bias decoders."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate, models
from tests.generate.conftest import VOCAB, random_prompts

TOL = 1e-4
BUFFER = 24


@functools.lru_cache(maxsize=None)
def seq2seq(name):
  config = models.get_config(name, vocab_size=VOCAB, init_std=0.3, max_len=64)
  return models.create(config)


SRC_BUFFER = 12


@functools.lru_cache(maxsize=None)
def full(config):
  graphdef = models.graphdef(config)
  return jax.jit(
    lambda params, src, tgt, src_mask, tgt_mask: nnx.merge(graphdef, params)(
      src, tgt, src_mask, tgt_mask
    )
  )


def _padded(ids, width):
  buf = np.zeros((1, width), np.int32)
  buf[0, : len(ids)] = ids
  return jnp.asarray(buf), jnp.asarray(np.arange(width)[None, :] < len(ids))


def reference_last_logits(model, src, tgt):
  """The full model (encoder + decoder, no cache) on one source and the target so far.

  Source and target are padded to fixed buffers (one compilation per config) with their padding
  masked by ``src_mask``/``tgt_mask``.
  """
  _, params = nnx.split(model)
  src_buf, src_valid = _padded(src, SRC_BUFFER)
  tgt_buf, tgt_valid = _padded(tgt, BUFFER)
  logits = full(model.config)(params, src_buf, tgt_buf, src_valid, tgt_valid)
  return np.asarray(logits[0, len(tgt) - 1])


@pytest.mark.parametrize("name", ["transformer-tiny", "t5-tiny"])
def test_cached_decoder_logits_match_full_model_every_step(name):
  model = seq2seq(name)
  config = model.config
  graphdef, params = nnx.split(model)

  @jax.jit
  def start(params, src, src_mask):
    m = nnx.merge(graphdef, params)
    cache = generate.init_cache(config, src.shape[0], BUFFER)
    return generate.with_encoder(m, cache, m.encode(src, src_mask), src_mask)

  @jax.jit
  def extend(params, tokens, cache, num_valid):
    return generate.extend(nnx.merge(graphdef, params), tokens, cache, num_valid)

  srcs = random_prompts(20, [7, 4])
  src = np.zeros((2, 8), np.int32)
  for i, s in enumerate(srcs):
    src[i, : len(s)] = s
  src_mask = np.arange(8)[None, :] < np.asarray([len(s) for s in srcs])[:, None]
  cache = start(params, jnp.asarray(src), jnp.asarray(src_mask))

  tgts = random_prompts(21, [3, 1])
  tgt = np.full((2, 4), 7, np.int32)
  for i, t in enumerate(tgts):
    tgt[i, : len(t)] = t
  logits, cache = extend(params, jnp.asarray(tgt), cache, jnp.asarray([3, 1], jnp.int32))
  for i in range(2):
    for j in range(len(tgts[i])):
      want = reference_last_logits(model, srcs[i], tgts[i][: j + 1])
      assert np.abs(np.asarray(logits[i, j]) - want).max() <= TOL, (name, "prefill", i, j)

  # Steps past T5's exact-distance buckets (8) into its logarithmic ones.
  steps = np.random.RandomState(22).randint(0, VOCAB, size=(14, 2))
  for step, toks in enumerate(steps):
    logits, cache = extend(params, jnp.asarray(toks[:, None], jnp.int32), cache, None)
    for i in range(2):
      tgts[i].append(int(toks[i]))
      diff = np.abs(np.asarray(logits[i, 0]) - reference_last_logits(model, srcs[i], tgts[i])).max()
      assert diff <= TOL, (name, step, i, diff)


def naive_greedy_seq2seq(model, src, start, max_new_tokens, eos_id=None):
  tgt, out = [start], []
  for _ in range(max_new_tokens):
    tok = int(np.argmax(reference_last_logits(model, src, tgt)))
    out.append(tok)
    tgt.append(tok)
    if tok == eos_id:
      break
  return out


@pytest.mark.parametrize("name", ["transformer-tiny", "t5-tiny"])
def test_greedy_seq2seq_batch_equals_naive_loop_per_source(name):
  model = seq2seq(name)
  srcs = random_prompts(23, [9, 2, 5])
  out = np.asarray(generate.generate(model, srcs, max_new_tokens=10, decoder_start_id=1))
  assert out.shape == (3, 10)
  for i, s in enumerate(srcs):
    assert out[i].tolist() == naive_greedy_seq2seq(model, s, 1, 10), (name, i)


def test_seq2seq_eos_and_start_id_checks():
  model = seq2seq("t5-tiny")
  srcs = random_prompts(24, [6, 3])
  free = naive_greedy_seq2seq(model, srcs[0], 0, 6)
  eos = free[1]
  out = np.asarray(generate.generate(model, srcs, max_new_tokens=6, decoder_start_id=0, eos_id=eos))
  first = out[0].tolist().index(eos)
  assert out[0, : first + 1].tolist() == free[: first + 1]
  assert (out[0, first:] == eos).all()
  with pytest.raises(ValueError, match="decoder_start_id=None"):
    generate.generate(model, srcs, max_new_tokens=4)
  with pytest.raises(ValueError, match="max_new_tokens=65"):
    generate.generate(model, srcs, max_new_tokens=65, decoder_start_id=0)
