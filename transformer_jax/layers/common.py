"""Small helpers shared by the layers: parameter creation with logical axes, dtype handling."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = nnx.initializers.Initializer


def param(
  rngs: nnx.Rngs,
  init: Initializer,
  shape: Sequence[int],
  axes: Sequence[str],
  dtype: jnp.dtype = jnp.float32,
) -> nnx.Param:
  """An ``nnx.Param`` initialised with ``init`` that carries the logical ``axes`` of its dimensions.

  Sharding is applied later, from the names, by ``transformer_jax.parallel`` (not eagerly here), so
  the same model code serves one device or a pod.
  """
  if len(shape) != len(axes):
    raise ValueError(f"shape {tuple(shape)} and axes {tuple(axes)} differ in length")
  return nnx.Param(
    init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(axes), eager_sharding=False
  )


def split_key(key: jax.Array | None, n: int) -> list[jax.Array | None]:
  """``n`` independent keys from ``key``, or ``n`` Nones when there is no key (no dropout)."""
  if key is None:
    return [None] * n
  return list(jax.random.split(key, n))


normal = nnx.initializers.normal
zeros = nnx.initializers.zeros_init()
ones = nnx.initializers.ones_init()
