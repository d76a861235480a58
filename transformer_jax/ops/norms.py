"""Normalisation layers as pure functions; statistics always in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _feature(p: jax.Array, ndim: int) -> jax.Array:
  """A ``[D]`` parameter as float32 ``[1, ..., 1, D]`` (explicit ranks, no implicit promotion)."""
  return jnp.expand_dims(p.astype(jnp.float32), tuple(range(ndim - 1)))


def layer_norm(x: jax.Array, scale: jax.Array | None, bias: jax.Array | None,
               eps: float = 1e-5) -> jax.Array:
  """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis (biased variance, Ba et al.).

  ``scale`` and ``bias`` are ``[D]`` or ``None`` (skipped). Output has ``x``'s dtype.
  """
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  y = (xf - mean) * jax.lax.rsqrt(var + eps)
  if scale is not None:
    y = y * _feature(scale, y.ndim)
  if bias is not None:
    y = y + _feature(bias, y.ndim)
  return y.astype(x.dtype)


def rms_norm(x: jax.Array, scale: jax.Array | None, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(mean(x^2) + eps) * scale`` over the last axis (Zhang & Sennrich; T5, LLaMA)."""
  xf = x.astype(jnp.float32)
  y = xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * _feature(scale, y.ndim)
  return y.astype(x.dtype)
