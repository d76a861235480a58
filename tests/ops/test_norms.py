"""Tests for ``transformer_jax.ops.norms`` against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from jax.test_util import check_grads

from transformer_jax.ops import layer_norm, rms_norm

D = 16


def layer_norm_ref(x, scale, bias, eps=1e-5):
  x = np.asarray(x, np.float64)
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)  # biased
  y = (x - mean) / np.sqrt(var + eps)
  if scale is not None:
    y = y * np.asarray(scale, np.float64)
  if bias is not None:
    y = y + np.asarray(bias, np.float64)
  return y


def rms_norm_ref(x, scale, eps=1e-6):
  x = np.asarray(x, np.float64)
  y = x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)
  if scale is not None:
    y = y * np.asarray(scale, np.float64)
  return y


def rand(shape, seed, dtype=jnp.float32, loc=0.0, std=1.0):
  return jnp.asarray(loc + std * np.random.default_rng(seed).standard_normal(shape), dtype)


ln = jax.jit(layer_norm, static_argnames="eps")
rms = jax.jit(rms_norm, static_argnames="eps")


@pytest.mark.parametrize(
  "with_scale,with_bias", [(True, True), (True, False), (False, True), (False, False)]
)
def test_layer_norm_matches_reference(with_scale, with_bias):
  x = rand((2, 5, D), 0, loc=3.0, std=2.0)
  scale = rand((D,), 1) if with_scale else None
  bias = rand((D,), 2) if with_bias else None
  got = ln(x, scale, bias)
  assert got.shape == x.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, layer_norm_ref(x, scale, bias), atol=1e-5, rtol=1e-5)


def test_layer_norm_uses_biased_variance():
  x = jnp.asarray([[1.0, 2.0, 3.0, 4.0]])
  # Biased variance is 1.25; unbiased (ddof=1) would be 5/3.
  want = (np.array([1.0, 2.0, 3.0, 4.0]) - 2.5) / np.sqrt(1.25 + 1e-5)
  np.testing.assert_allclose(ln(x, None, None)[0], want, rtol=1e-6)


def test_layer_norm_without_affine_gives_zero_mean_unit_variance():
  y = np.asarray(ln(rand((4, D), 3, loc=-7.0, std=5.0), None, None), np.float64)
  np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-5)
  np.testing.assert_allclose(y.var(-1), 1.0, atol=1e-4)


def test_layer_norm_custom_eps_matches_reference():
  x = rand((3, D), 4, std=0.01)  # variance comparable to eps, so eps matters
  got = ln(x, None, None, eps=1e-4)
  np.testing.assert_allclose(got, layer_norm_ref(x, None, None, eps=1e-4), atol=1e-5, rtol=1e-5)
  assert not np.allclose(got, layer_norm_ref(x, None, None, eps=1e-5), atol=1e-3)


def test_layer_norm_constant_input_gives_bias():
  bias = rand((D,), 5)
  got = ln(jnp.full((2, D), 3.5), jnp.ones(D), bias)
  assert np.all(np.isfinite(np.asarray(got)))
  np.testing.assert_allclose(got, np.broadcast_to(np.asarray(bias), (2, D)), atol=1e-6)


@pytest.mark.parametrize("with_scale", [True, False])
def test_rms_norm_matches_reference(with_scale):
  x = rand((2, 5, D), 6, loc=1.0, std=3.0)
  scale = rand((D,), 7) if with_scale else None
  got = rms(x, scale)
  assert got.shape == x.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, rms_norm_ref(x, scale), atol=1e-5, rtol=1e-5)


def test_rms_norm_does_not_subtract_mean():
  x = jnp.full((1, D), 4.0)
  np.testing.assert_allclose(rms(x, None), np.ones((1, D)), rtol=1e-6)


def test_rms_norm_custom_eps_matches_reference():
  x = rand((3, D), 8, std=0.01)
  got = rms(x, None, eps=1e-4)
  np.testing.assert_allclose(got, rms_norm_ref(x, None, eps=1e-4), atol=1e-5, rtol=1e-5)
  assert not np.allclose(got, rms_norm_ref(x, None, eps=1e-6), atol=1e-3)


def test_rms_norm_zero_input_is_finite():
  got = np.asarray(rms(jnp.zeros((2, D)), jnp.ones(D)))
  assert np.all(got == 0.0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_layer_norm_low_precision_keeps_dtype_and_is_accurate(dtype):
  # A large offset: statistics in the input dtype would lose most of the signal.
  x = rand((4, 64), 9, dtype, loc=100.0, std=1.0)
  scale, bias = rand((64,), 10, dtype), rand((64,), 11, dtype)
  got = ln(x, scale, bias)
  assert got.dtype == dtype
  want = layer_norm_ref(x, scale, bias)  # from the same rounded inputs
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rms_norm_low_precision_keeps_dtype_and_is_accurate(dtype):
  x = rand((4, 64), 12, dtype, std=4.0)
  scale = rand((64,), 13, dtype)
  got = rms(x, scale)
  assert got.dtype == dtype
  np.testing.assert_allclose(
    np.asarray(got, np.float32), rms_norm_ref(x, scale), atol=3e-2, rtol=2e-2
  )


def test_norms_eager_match_jit():
  x, scale, bias = rand((2, 3, D), 14), rand((D,), 15), rand((D,), 16)
  np.testing.assert_allclose(layer_norm(x, scale, bias), ln(x, scale, bias), atol=1e-6)
  np.testing.assert_allclose(rms_norm(x, scale), rms(x, scale), atol=1e-6)


def test_norms_vmap_over_extra_axis_equal_loop():
  x = rand((3, 2, D), 17)
  scale, bias = rand((3, D), 18), rand((3, D), 19)
  got_ln = jax.vmap(layer_norm)(x, scale, bias)
  got_rms = jax.vmap(rms_norm)(x, scale)
  for e in range(3):
    np.testing.assert_allclose(got_ln[e], layer_norm_ref(x[e], scale[e], bias[e]), atol=1e-5)
    np.testing.assert_allclose(got_rms[e], rms_norm_ref(x[e], scale[e]), atol=1e-5)


def test_layer_norm_gradients_match_numerical():
  with jax.enable_x64(True):
    x, scale, bias = (
      rand((2, 6), 20, jnp.float64),
      rand((6,), 21, jnp.float64),
      rand((6,), 22, jnp.float64),
    )
    check_grads(
      jax.jit(layer_norm),
      (x, scale, bias),
      order=2,
      modes=["fwd", "rev"],
      atol=1e-2,
      rtol=1e-2,
      eps=1e-3,
    )


def test_rms_norm_gradients_match_numerical():
  with jax.enable_x64(True):
    x, scale = rand((2, 6), 23, jnp.float64), rand((6,), 24, jnp.float64)
    check_grads(
      jax.jit(rms_norm), (x, scale), order=2, modes=["fwd", "rev"], atol=1e-2, rtol=1e-2, eps=1e-3
    )


def test_layer_norm_works_under_strict_rank_promotion():
  # STYLE.md: tests run with jax_numpy_rank_promotion="raise"; a [D] scale on [B, T, D] must not
  # rely on implicit rank promotion.
  x, scale, bias = rand((2, 3, D), 25), rand((D,), 26), rand((D,), 27)
  with jax.numpy_rank_promotion("raise"):
    out = jax.eval_shape(lambda: layer_norm(x, scale, bias))  # tracing hits the check
  assert out.shape == x.shape


def test_rms_norm_works_under_strict_rank_promotion():
  x, scale = rand((2, 3, D), 28), rand((D,), 29)
  with jax.numpy_rank_promotion("raise"):
    out = jax.eval_shape(lambda: rms_norm(x, scale))
  assert out.shape == x.shape


def _central_differences(f, args, eps=1e-6):
  """float64 central differences of the scalar ``f(*args)`` with respect to every argument."""
  grads = []
  for i, a in enumerate(args):
    a = np.asarray(a, np.float64)
    g = np.zeros_like(a)
    for idx in np.ndindex(a.shape):
      up, down = a.copy(), a.copy()
      up[idx] += eps
      down[idx] -= eps
      hi = f(*args[:i], up, *args[i + 1 :])
      lo = f(*args[:i], down, *args[i + 1 :])
      g[idx] = (hi - lo) / (2 * eps)
    grads.append(g)
  return grads


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_gradients_match_float64_differences_of_the_reference(norm):
  """The derivative rules against central differences of the NumPy float64 references (no JAX on
  that side), with inputs far from zero mean so that the mean's share of the gradient matters."""
  x, w = rand((3, 8), 40, loc=2.0, std=3.0), rand((3, 8), 41)
  scale, bias = rand((8,), 42), rand((8,), 43)
  if norm == "layer":
    args = (x, scale, bias)
    got = jax.grad(lambda *a: jnp.sum(layer_norm(*a) * w), argnums=(0, 1, 2))(*args)
    want = _central_differences(lambda *a: np.sum(layer_norm_ref(*a) * np.float64(w)), args)
  else:
    args = (x, scale)
    got = jax.grad(lambda *a: jnp.sum(rms_norm(*a) * w), argnums=(0, 1))(*args)
    want = _central_differences(lambda *a: np.sum(rms_norm_ref(*a) * np.float64(w)), args)
  for g, r in zip(got, want):
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-4)
  # Forward mode gives the same directional derivative.
  dx = rand((3, 8), 44)
  fn = (lambda x: layer_norm(x, scale, bias)) if norm == "layer" else (lambda x: rms_norm(x, scale))
  _, tangent = jax.jvp(fn, (x,), (dx,))
  np.testing.assert_allclose(jnp.sum(tangent * w), jnp.sum(got[0] * dx), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_norm_backward_keeps_one_array_of_the_input_shape(norm, capsys):
  """Autodiff of the written-out norm kept three arrays of x's shape (``x - mean``, twice it and
  the normalised x); the rule keeps the normalised x and the ``[..., 1]`` row scale."""
  x, scale, bias = jnp.ones((3, 16), jnp.float32), jnp.ones(16), jnp.zeros(16)
  fn = (lambda x: layer_norm(x, scale, bias)) if norm == "layer" else (lambda x: rms_norm(x, scale))
  print_saved_residuals(lambda x: fn(x).sum(), x)
  lines = capsys.readouterr().out.splitlines()
  assert len([ln for ln in lines if ln.startswith("f32[3,16]")]) == 1, lines
  assert len([ln for ln in lines if ln.startswith("f32[3,1]")]) == 1, lines
