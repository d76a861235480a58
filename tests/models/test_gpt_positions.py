"""A GPT with sinusoidal positions: what reaches the blocks."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests.models.conftest import VOCAB, tiny
from transformer_jax import models, ops


def _sinusoidal_gpt(**overrides):
  config = tiny(
    "gpt2-tiny",
    d_model=32,
    num_layers=2,
    num_heads=2,
    d_ff=64,
    max_len=32,
    position="sinusoidal",
    **overrides,
  )
  return models.GPT(config, rngs=nnx.Rngs(0))


def test_sinusoidal_gpt_feeds_the_blocks_scaled_tokens_plus_the_table():
  model = _sinusoidal_gpt()
  tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 11), 0, VOCAB))
  positions = np.array([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4], list(range(11))])
  x_BTD = model._block_inputs(tokens, positions)[0]
  # float64 reference: Vaswani et al. 3.4/3.5, PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos.
  p, i = np.arange(32, dtype=np.float64)[:, None], np.arange(0, 32, 2)[None, :]
  table = np.zeros((32, 32))
  table[:, 0::2], table[:, 1::2] = np.sin(p / 10000 ** (i / 32)), np.cos(p / 10000 ** (i / 32))
  embedding = np.asarray(model.embed.embedding[...], np.float64)
  ref = embedding[tokens] * np.sqrt(32) + table[positions]
  np.testing.assert_allclose(np.asarray(x_BTD), ref, rtol=1e-5, atol=1e-5)


def test_sinusoidal_gpt_tokens_and_positions_start_at_one_scale():
  # Tokens far smaller than the fixed table reach the blocks as noise on the positions.
  model = _sinusoidal_gpt()
  tokens_rms = float(jnp.sqrt(jnp.mean(model.embed.embedding[...] ** 2))) * np.sqrt(32)
  table_rms = float(jnp.sqrt(jnp.mean(ops.sinusoidal_positions(32, 32) ** 2)))
  assert 0.5 < tokens_rms / table_rms < 2.0, (tokens_rms, table_rms)
