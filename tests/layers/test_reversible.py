"""Reversible residual layers (``layers.reversible``): the recomputing backward gives the
gradients of ordinary autodiff through the same layers, and a reversible GPT decodes from a
cache as its full forward does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import generate, models
from transformer_jax.layers import Stack, reversible
from tests.models.conftest import full_forward_greedy


def _config(**kw):
  return models.get_config(
    "llama-tiny", vocab_size=64, num_layers=4, max_len=64, reversible=True, **kw
  )


@pytest.mark.slow
@pytest.mark.parametrize("dropout", [False, True])
def test_recomputed_gradients_equal_autodiff(dropout):
  config = _config(
    dropout_rate=0.1 if dropout else 0.0, attention_dropout_rate=0.1 if dropout else 0.0
  )
  stack = Stack(config.block_config(), config.num_layers, rngs=nnx.Rngs(0), reversible=True)
  graphdef, params = nnx.split(stack.layers)
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((2, 24, config.d_model)), jnp.float32)
  w = jnp.asarray(r.standard_normal(x.shape), jnp.float32)
  kv_valid = jnp.asarray(np.arange(24)[None] < np.array([[24], [17]]))
  key = jax.random.key(1) if dropout else None

  def loss(params, x, recompute):
    layers = nnx.merge(graphdef, params)
    out = reversible.run_blocks(
      layers,
      x,
      dropout_rng=key,
      num_layers=config.num_layers,
      recompute=recompute,
      causal=True,
      kv_valid=kv_valid,
      positions=jnp.arange(24)[None],
    )
    return jnp.sum(out * w)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  got, want = grad(params, x, True), grad(params, x, False)
  for path, a in nnx.to_flat_state(got[0]):
    e = dict(nnx.to_flat_state(want[0]))[path]
    a, e = np.asarray(a.get_value()), np.asarray(e.get_value())
    assert np.max(np.abs(a - e)) <= 1e-5 * max(np.max(np.abs(e)), 1e-6), path
  np.testing.assert_allclose(
    np.asarray(got[1]), np.asarray(want[1]), atol=1e-5 * float(np.max(np.abs(want[1])))
  )


@pytest.mark.slow
def test_reversible_gpt_decodes_from_a_cache_as_its_full_forward():
  config = _config()
  model = nnx.merge(models.graphdef(config), models.init(config, jax.random.key(2)))
  rows = [np.random.default_rng(3).integers(0, 64, 7), np.random.default_rng(4).integers(0, 64, 3)]
  ours = np.asarray(generate.generate(model, [list(r) for r in rows], max_new_tokens=10))
  for i, row in enumerate(rows):
    np.testing.assert_array_equal(ours[i], full_forward_greedy(model, row[None], 10)[0])


def test_post_norm_blocks_and_remat_are_refused():
  with pytest.raises(ValueError, match="pre-norm"):
    Stack(
      models.BERTConfig(d_model=16, num_heads=2, d_ff=32, num_layers=1).block_config(),
      1,
      rngs=nnx.Rngs(0),
      reversible=True,
    )
  with pytest.raises(ValueError, match="remat='full' must be 'none'"):
    dataclasses.replace(_config(), remat="full")
