"""The Reformer model (``models.Reformer``): reversible gradients equal ordinary autodiff through
the same layers, chunked feed-forward changes nothing, it is causal, and it learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from transformer_jax import models, ops

CONFIG = models.ReformerConfig(
  vocab_size=32,
  d_model=16,
  num_heads=2,
  head_dim=8,
  d_ff=32,
  attn_layers=("local", "lsh"),
  axial_pos_shape=(4, 16),
  axial_pos_dims=(6, 10),
  max_len=64,
  n_buckets=4,
  n_hashes=2,
  lsh_chunk_length=8,
  local_chunk_length=8,
)


@pytest.mark.slow
def test_recomputed_gradients_equal_autodiff_and_chunked_ff_changes_nothing():
  config = dataclasses.replace(CONFIG, dropout_rate=0.1)
  params = models.init(config, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 64)))
  mask = jnp.asarray(np.arange(64)[None] < np.array([[64], [45]]))

  def loss(params, recompute, config=config):
    logits = models.apply(
      config, params, tokens, mask, dropout_rng=jax.random.key(3), recompute=recompute
    )
    return ops.cross_entropy(logits[:, :-1], tokens[:, 1:], mask=mask[:, 1:])[0]

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  got, want = grad(params, True), grad(params, False)
  want_flat = dict(nnx.to_flat_state(want))
  for path, a in nnx.to_flat_state(got):
    e = np.asarray(want_flat[path].get_value())
    assert np.max(np.abs(np.asarray(a.get_value()) - e)) <= 1e-5 * max(np.max(np.abs(e)), 1e-6)
  np.testing.assert_array_equal(np.asarray(got["lsh_rotations"].get_value()), 0.0)
  # The feed-forward 16 positions at a time (no dropout: its masks are drawn per chunk).
  chunked = dataclasses.replace(CONFIG, ff_chunk=16)
  np.testing.assert_allclose(
    np.asarray(models.apply(chunked, params, tokens, mask)),
    np.asarray(models.apply(CONFIG, params, tokens, mask)),
    atol=1e-5,
    rtol=1e-5,
  )


@pytest.mark.slow
@pytest.mark.long
def test_causal_and_it_learns():
  params = models.init(CONFIG, jax.random.key(1))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 32, (1, 64)))
  # Position 40's logits do not depend on later tokens' embeddings.
  jac = jax.grad(
    lambda e: models.apply(
      CONFIG, nnx.merge_state(params, nnx.State({"embed": {"embedding": nnx.Param(e)}})), tokens
    )[0, 40].sum()
  )(params["embed"]["embedding"].get_value())
  later = np.unique(np.asarray(tokens[0, 41:]))
  earlier = np.unique(np.asarray(tokens[0, :41]))
  only_later = np.setdiff1d(later, earlier)
  assert np.all(np.asarray(jac)[only_later] == 0.0)
  # A repeated sequence: the second half is predictable from the first.
  half = np.random.default_rng(2).integers(0, 32, (8, 32))
  batch = jnp.asarray(np.concatenate([half, half], axis=1))
  opt = optax.adam(1e-2)
  state = opt.init(params)

  @jax.jit
  def step(p, s):
    def loss(p):
      logits = models.apply(CONFIG, p, batch)
      return ops.cross_entropy(logits[:, 32:-1], batch[:, 33:])[0]

    value, g = jax.value_and_grad(loss)(p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, value

  losses = []
  for _ in range(60):
    params, state, value = step(params, state)
    losses.append(float(value))
  assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.slow
def test_bad_configs_are_named():
  with pytest.raises(ValueError, match="attn_layers"):
    dataclasses.replace(CONFIG, attn_layers=("lsh", "dense"))
  with pytest.raises(ValueError, match="n_buckets=5"):
    dataclasses.replace(CONFIG, n_buckets=5)
  with pytest.raises(ValueError, match="summing to d_model"):
    dataclasses.replace(CONFIG, axial_pos_dims=(8, 4))
