"""Reductions that XLA:CPU runs slowly as written the obvious way."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def argmax(x: jax.Array, axis: int = -1) -> jax.Array:
  """int32 index of the largest entry along ``axis``: the same result as ``jnp.argmax``.

  Ties go to the first index. If a row holds a NaN, the first NaN's index is returned, as
  ``jnp.argmax`` does.

  ``jnp.argmax`` lowers to one reduction over (value, index) pairs, which XLA:CPU does not
  vectorize; here it is two plain reductions instead, a max and then a min over the indices that
  hold it. The second reads an index array as large as ``x``, so past 2**22 elements the rows go
  through in chunks whose buffer is reused (experiments/PERFORMANCE.md, "Argmax").
  """
  axis = axis % x.ndim
  x = jnp.moveaxis(x, axis, -1)
  lead, n = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, n)
  if rows.size <= _CHUNK:
    return _argmax_rows(rows).reshape(lead)
  # Many rows (a training batch's logits): a few at a time, so the index array the second
  # reduction reads is a small buffer reused by every chunk, not a fresh [rows, n] one per call.
  return jax.lax.map(_argmax_rows, rows, batch_size=max(1, _CHUNK // n)).reshape(lead)


_CHUNK = 1 << 22  # elements per chunk of rows (16 MB of float32)


def _argmax_rows(x_RN: jax.Array) -> jax.Array:
  top = jnp.max(x_RN, axis=-1, keepdims=True)
  hit = x_RN == top
  if jnp.issubdtype(x_RN.dtype, jnp.inexact):
    hit = hit | (jnp.isnan(x_RN) & jnp.isnan(top))
  index = jax.lax.broadcasted_iota(jnp.int32, x_RN.shape, x_RN.ndim - 1)
  return jnp.min(jnp.where(hit, index, x_RN.shape[-1]), axis=-1)
