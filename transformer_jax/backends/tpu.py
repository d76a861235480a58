"""The TPU backend: Pallas splash attention where the table chooses it (per device under a mesh
that splits the batch or heads), Megablox's grouped product for mixtures of experts, everything
else as on any platform."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from transformer_jax.backends.base import Backend, value

try:  # Pallas's TPU kernels ship with jax; a build without them keeps ragged_dot.
  from jax.experimental.pallas.ops.tpu.megablox import ops as megablox
except ImportError:  # pragma: no cover
  megablox = None

GMM_TILE = 128  # Megablox's row/column tile


def megablox_grouped_matmul(
  x_MK: jax.Array, w_EKN: jax.Array, group_sizes_E: jax.Array, *, dtype, interpret: bool = False
) -> jax.Array:
  """``Backend.grouped_matmul`` through Megablox ``gmm`` (differentiable: its own transposed
  kernels). The rows are padded to a multiple of the row tile (the pad joins the last expert's
  group and is sliced off); ``interpret`` runs the Pallas kernel in interpret mode (any CPU)."""
  m, k = x_MK.shape
  n = w_EKN.shape[2]
  tm = min(GMM_TILE, max(8, -(-m // 8) * 8))
  pad = -m % tm
  x = jnp.pad(x_MK.astype(dtype), ((0, pad), (0, 0)))
  sizes = group_sizes_E.astype(jnp.int32).at[-1].add(pad)
  y = megablox.gmm(
    x,
    w_EKN.astype(dtype),
    sizes,
    dtype,
    (tm, min(GMM_TILE, k), min(GMM_TILE, n)),
    interpret=interpret,
  )
  return y[:m]


@dataclasses.dataclass(frozen=True)
class TpuBackend(Backend):
  """TPUs through XLA:TPU."""

  platform = "tpu"

  def grouped_matmul(self, x_MK, w_EKN, group_sizes_E, *, dtype):
    """Megablox ``gmm`` (``megablox_grouped_matmul``); ``jax.lax.ragged_dot`` without it."""
    if megablox is None:
      return super().grouped_matmul(x_MK, w_EKN, group_sizes_E, dtype=dtype)
    return megablox_grouped_matmul(x_MK, value(w_EKN), group_sizes_E, dtype=dtype)
