"""Tests for ``transformer_jax.ops.reductions`` against NumPy's argmax."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import ops


@pytest.mark.parametrize("shape,axis", [((3, 50257), -1), ((2, 5, 7), 1), ((4, 6), 0), ((9,), 0)])
def test_argmax_matches_numpy_on_random_rows(shape, axis):
  x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
  got = jax.jit(ops.argmax, static_argnums=1)(jnp.asarray(x), axis)
  chex.assert_shape(got, np.delete(np.array(shape), axis % len(shape)).tolist())
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=axis))


def test_argmax_ties_infinities_and_nans_follow_numpy():
  nan, inf = np.nan, np.inf
  x = np.array(
    [
      [1.0, 3.0, 3.0, 2.0],  # tie: the first one
      [-inf, -inf, -inf, -inf],  # all -inf: index 0
      [inf, 2.0, inf, 0.0],  # +inf wins, first one
      [1.0, nan, 5.0, nan],  # a NaN wins, the first one
      [nan, nan, nan, nan],
    ],
    np.float32,
  )
  np.testing.assert_array_equal(np.asarray(ops.argmax(jnp.asarray(x))), np.argmax(x, axis=-1))
  np.testing.assert_array_equal(
    np.asarray(ops.argmax(jnp.asarray(x))), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
  )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_argmax_other_dtypes(dtype):
  x = np.random.default_rng(1).integers(-50, 50, (6, 33))
  got = ops.argmax(jnp.asarray(x, dtype))
  np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))


def test_argmax_under_vmap():
  x = np.random.default_rng(2).standard_normal((3, 4, 17)).astype(np.float32)
  got = jax.vmap(ops.argmax)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(got), np.argmax(x, axis=-1))


@pytest.mark.parametrize("chunk,shape", [(64, (7, 3, 20)), (16, (5, 40)), (64, (2, 3, 64))])
def test_argmax_in_chunks_of_rows_matches_numpy(monkeypatch, chunk, shape):
  """Large inputs go through a few rows at a time (with a remainder, or one row per step when a
  row alone fills a chunk): the same indices."""
  from transformer_jax.ops import reductions

  monkeypatch.setattr(reductions, "_CHUNK", chunk)
  x = np.random.default_rng(3).integers(0, 4, shape).astype(np.float32)  # many ties
  x[0, 1] = np.nan
  for axis in (-1, 0):
    np.testing.assert_array_equal(
      np.asarray(jax.jit(ops.argmax, static_argnums=1)(x, axis)), np.argmax(x, axis=axis)
    )
