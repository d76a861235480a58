"""bfloat16 residuals of the hand-written backward passes, saved as their bits.

A scan over layers stacks each layer's saved residuals into ``[L, ...]`` arrays with
``dynamic_update_slice``, which XLA does in place. XLA:CPU does a bfloat16 update in float32: the
fusion converts the whole stacked array to float32 and back at every layer, so each layer rewrites
all twelve layers' worth of it. On its uint16 bits the update is a plain in-place copy. The bits
are the same numbers: ``unpacked(packed(x))`` is ``x``. Other dtypes pass through unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def packed(x: jax.Array) -> jax.Array:
  """A bfloat16 array as its uint16 bits (other dtypes unchanged)."""
  return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x


def unpacked(x: jax.Array) -> jax.Array:
  """The bfloat16 array whose bits ``packed`` gave (other dtypes unchanged)."""
  return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x
