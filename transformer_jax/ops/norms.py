"""Normalisation layers as pure functions; statistics always in float32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _feature(p: jax.Array, ndim: int) -> jax.Array:
  """A ``[D]`` parameter as float32 ``[1, ..., 1, D]`` (explicit ranks, no implicit promotion)."""
  return jnp.expand_dims(p.astype(jnp.float32), tuple(range(ndim - 1)))


def layer_norm(
  x: jax.Array, scale: jax.Array | None, bias: jax.Array | None, eps: float = 1e-5
) -> jax.Array:
  """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis (biased variance, Ba et
  al.).

  ``scale`` and ``bias`` are ``[D]`` or ``None`` (skipped). Output has ``x``'s dtype.
  """
  y = _normalized(x.astype(jnp.float32), eps, True)
  if scale is not None:
    y = y * _feature(scale, y.ndim)
  if bias is not None:
    y = y + _feature(bias, y.ndim)
  return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (Zhang & Sennrich; T5, LLaMA)."""
  y = _normalized(x.astype(jnp.float32), eps, False)
  if scale is not None:
    y = y * _feature(scale, y.ndim)
  return y.astype(x.dtype)


# Both normalisations carry their derivative as a rule (``jax.custom_jvp``), written with the
# normalised output ``n`` and the row's ``r = 1 / sqrt(var + eps)``: reverse mode then keeps just
# those two (``n`` is also what the scale's gradient reads). Left to autodiff, a layer norm kept
# three arrays of the input's shape (``x - mean``, twice it, and ``n``), each of which the scan
# over layers stacks and unstacks at every step (experiments/PERFORMANCE.md).


def _normalized_parts(xf: jax.Array, eps: float, centre: bool) -> tuple[jax.Array, jax.Array]:
  if centre:
    xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
  r = jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
  return xf * r, r


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _normalized(xf: jax.Array, eps: float, centre: bool) -> jax.Array:
  """``(x - mean) / sqrt(var + eps)`` (``centre``) or ``x / sqrt(mean(x^2) + eps)`` over the last
  axis, float32."""
  return _normalized_parts(xf, eps, centre)[0]


@_normalized.defjvp
def _normalized_jvp(eps, centre, primals, tangents):
  (xf,), (dx,) = primals, tangents
  n, r = _normalized_parts(xf, eps, centre)
  # d n = r * (dx - mean(dx) - n * mean(n * dx)): the mean's share (when centred) and the
  # variance's share taken out.
  if centre:
    dx = dx - jnp.mean(dx, axis=-1, keepdims=True)
  return n, r * (dx - n * jnp.mean(n * dx, axis=-1, keepdims=True))
