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


# Large activations: 12 layers at init_std=0.3 grow the streams to about 20 (from 1), and the
# gradient becomes sensitive to rounding. The recomputed gradient may differ from ordinary
# autodiff (same layers, same dtype) by no more than the dtype's rounding already moves ordinary
# autodiff's gradient away from the same layers in float64 (norm statistics stay float32 there):
# recomputation adds less error than the dtype has anyway. Without float32 streams carried with
# their rounding error, bfloat16 missed by 100% (against 56%) and float32 by 2.6e-4 (against
# 2e-5).
_T = 16


@pytest.fixture(scope="module")
def deep_gradients():
  stacks = {}

  def grads(dtype, recompute):
    config = models.get_config(
      "llama-tiny",
      vocab_size=64,
      num_layers=12,
      max_len=64,
      reversible=True,
      init_std=0.3,
      dtype=dtype,
    )
    if dtype not in stacks:
      stacks[dtype] = Stack(config.block_config(), 12, rngs=nnx.Rngs(0), reversible=True)
    graphdef, params = nnx.split(stacks[dtype].layers)
    r = np.random.default_rng(0)
    x = r.standard_normal((2, _T, config.d_model))
    w = r.standard_normal(x.shape)
    wide = jnp.float64 if dtype == "float64" else jnp.float32
    params = jax.tree.map(lambda a: a.astype(wide), params)

    def loss(params, x):
      out = reversible.run_blocks(
        nnx.merge(graphdef, params),
        x.astype(dtype),
        dropout_rng=None,
        num_layers=12,
        recompute=recompute,
        causal=True,
        positions=jnp.arange(_T)[None],
      )
      return jnp.sum(out.astype(wide) * w.astype(wide)), jnp.max(jnp.abs(out))

    (dp, dx), peak = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x.astype(wide))
    assert float(peak) > 10  # large activations
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves((dp, dx))])

  with jax.enable_x64(True):
    reference = grads("float64", False)
  return grads, reference


def _rel(a, b):
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recomputed_gradients_with_large_activations(deep_gradients, dtype):
  grads, reference = deep_gradients
  autodiff, recomputed = grads(dtype, False), grads(dtype, True)
  assert _rel(recomputed, autodiff) <= _rel(autodiff, reference), dtype


@pytest.mark.slow
def test_bfloat16_reformer_recomputes_within_its_rounding():
  # The same bound for the Reformer (LSH and local layers) in bfloat16: before its streams were
  # float32 pairs, the recomputed gradient missed ordinary autodiff's by more than bfloat16's
  # own rounding error.
  config = models.ReformerConfig(
    vocab_size=32,
    d_model=16,
    num_heads=2,
    head_dim=8,
    d_ff=32,
    attn_layers=("local", "lsh") * 3,
    axial_pos_shape=(4, 16),
    axial_pos_dims=(6, 10),
    max_len=64,
    n_buckets=4,
    n_hashes=2,
    lsh_chunk_length=8,
    local_chunk_length=8,
    init_std=0.3,
  )
  params = models.init(config, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 64)))

  def grads(dtype, recompute):
    c = dataclasses.replace(config, dtype=dtype)
    wide = jnp.float64 if dtype == "float64" else jnp.float32
    p = jax.tree.map(lambda a: a.astype(wide), params)
    g = jax.jit(
      jax.grad(lambda p: jnp.sum(models.apply(c, p, tokens, recompute=recompute)[..., 0]))
    )(p)
    return np.concatenate([np.ravel(np.asarray(a, np.float64)) for a in jax.tree.leaves(g)])

  with jax.enable_x64(True):
    reference = grads("float64", False)
  autodiff, recomputed = grads("bfloat16", False), grads("bfloat16", True)
  assert _rel(recomputed, autodiff) <= _rel(autodiff, reference)
