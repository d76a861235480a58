"""Properties every approximate-attention kind keeps (the conformance suite's checks, written
for these kinds): a row alone equals the same row padded in a batch where the kind allows it,
outputs are finite, configs survive ``config_to_dict``/``config_from_dict``. Kinds that depend
on the padded length refuse nothing but are listed in ``LENGTH_DEPENDENT``, with the reason."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import models, ops

BERT = models.BERTConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
                         max_len=48, dropout_rate=0.0, attention_dropout_rate=0.0)
GPT = models.get_config("llama-tiny", vocab_size=64, max_len=64, num_layers=2)
KINDS = {
    "bert-linformer": dataclasses.replace(BERT, attention_kind="linformer", linformer_rows=12),
    "bert-fixed": dataclasses.replace(BERT, attention_kind="sparse",
                                      sparse_pattern=ops.SparsePattern.fixed(block=8, summary=2)),
    "gpt-strided": dataclasses.replace(GPT, attention_kind="sparse",
                                       sparse_pattern=ops.SparsePattern.strided_pattern(block=8)),
    "gpt-reversible": dataclasses.replace(GPT, reversible=True),
}
# A row's result depends on the length it is padded to: BigBird's last block is global (the
# padded batch moves it), and the Reformer's LSH rounds are chunked over the padded length.
LENGTH_DEPENDENT = {
    "bert-bigbird": dataclasses.replace(BERT, attention_kind="sparse",
                                        sparse_pattern=ops.SparsePattern.bigbird(block=8)),
    "reformer": models.ReformerConfig(vocab_size=64, d_model=16, num_heads=2, head_dim=8,
                                      d_ff=32, attn_layers=("local", "lsh"), max_len=64,
                                      axial_pos_shape=(8, 8), axial_pos_dims=(8, 8),
                                      n_buckets=4, lsh_chunk_length=8, local_chunk_length=8),
}


def _run(config, params, tokens, mask):
  if isinstance(config, models.BERTConfig):
    return models.apply(config, params, tokens, None, mask).mlm_logits
  if isinstance(config, models.ReformerConfig):
    return models.apply(config, params, tokens, mask)
  return models.apply(config, params, tokens, attention_mask=mask)


@pytest.mark.parametrize("name", list(KINDS))
def test_a_row_alone_equals_it_padded_in_a_batch(name):
  config = KINDS[name]
  params = models.init(config, jax.random.key(0))
  rng = np.random.default_rng(1)
  tokens = rng.integers(1, 64, (2, 40))
  lengths = [40, 29]
  mask = np.arange(40)[None] < np.array(lengths)[:, None]
  batched = np.asarray(_run(config, params, jnp.asarray(tokens), jnp.asarray(mask)))
  assert np.all(np.isfinite(batched))
  alone = np.asarray(_run(config, params, jnp.asarray(tokens[1:, :29]), None))
  np.testing.assert_allclose(batched[1, :29], alone[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(KINDS) + list(LENGTH_DEPENDENT))
def test_config_round_trip_and_finite(name):
  config = {**KINDS, **LENGTH_DEPENDENT}[name]
  assert models.config_from_dict(models.config_to_dict(config)) == config
  if name in LENGTH_DEPENDENT:
    params = models.init(config, jax.random.key(2))
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 64, (2, 40)))
    mask = jnp.asarray(np.arange(40)[None] < np.array([[40], [11]]))
    assert np.all(np.isfinite(np.asarray(_run(config, params, tokens, mask))))
