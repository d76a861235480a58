"""The kinds the conformance suite leaves out (tests/conformance/kinds.py says why): BigBird and
the Reformer, whose rows depend on the length they are padded to. Their configs survive
``config_to_dict``/``config_from_dict`` and they give finite outputs under padding."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import models, ops

BERT = models.BERTConfig(
  vocab_size=64,
  d_model=32,
  num_layers=2,
  num_heads=4,
  d_ff=64,
  max_len=48,
  dropout_rate=0.0,
  attention_dropout_rate=0.0,
)
LENGTH_DEPENDENT = {
  "bert-bigbird": dataclasses.replace(
    BERT, attention_kind="sparse", sparse_pattern=ops.SparsePattern.bigbird(block=8)
  ),
  "bert-bigbird-eval": dataclasses.replace(
    BERT,
    attention_kind="sparse",
    sparse_pattern=ops.SparsePattern.bigbird(block=4, random_blocks=1, eval_mode=True),
  ),
  "reformer": models.ReformerConfig(
    vocab_size=64,
    d_model=16,
    num_heads=2,
    head_dim=8,
    d_ff=32,
    attn_layers=("local", "lsh"),
    max_len=64,
    axial_pos_shape=(8, 8),
    axial_pos_dims=(8, 8),
    n_buckets=4,
    lsh_chunk_length=8,
    local_chunk_length=8,
  ),
}


@pytest.mark.parametrize("name", list(LENGTH_DEPENDENT))
def test_config_round_trip_and_finite(name):
  config = LENGTH_DEPENDENT[name]
  assert models.config_from_dict(models.config_to_dict(config)) == config
  params = models.init(config, jax.random.key(2))
  tokens = jnp.asarray(np.random.default_rng(3).integers(1, 64, (2, 40)))
  mask = jnp.asarray(np.arange(40)[None] < np.array([[40], [11]]))
  if isinstance(config, models.BERTConfig):
    out = models.apply(config, params, tokens, None, mask).mlm_logits
  else:
    out = models.apply(config, params, tokens, mask)
  assert np.all(np.isfinite(np.asarray(out)))
