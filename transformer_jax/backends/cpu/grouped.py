"""A mixture of experts' grouped product as blocks of rows, each multiplied by its one expert's
weight: the chosen experts' work only, where XLA:CPU lowers ``jax.lax.ragged_dot`` (and its
transposes) as a masked product over every expert.

The rows arrive sorted by expert (``ops.moe.sort_by_expert``). Each expert's group is padded up to
a whole number of blocks of ``block`` rows, so a block holds one expert's rows (and zeros); the
padded rows are at most ``M + E * (block - 1)``, a static bound, so the blocks are
``ceil((M + E * (block - 1)) / block)``. The block is at most ``M / E`` rows (``block_rows``), so
the padding at most doubles the work. Every block is multiplied by its expert's weight (one
batched product over the blocks, the weights gathered per block) and the padding rows are dropped.
Autodiff gives the backward: the weights' gradient is each block's ``x^T dy`` summed into its
expert, the rows' is ``dy w^T`` per block. Blocks past the last group hold only zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The most rows per block: of 32, 64 and 128, 128 ran fastest at 8 experts and 64 and 128 within
# the noise of shared cores at 64 (experiments/results/grouped_matmul_xeon.json).
BLOCK = 128


def block_rows(rows: int, experts: int, limit: int = BLOCK) -> int:
  """Rows per block for ``rows`` sorted rows over ``experts`` groups: the largest power of two
  up to ``limit`` and at most ``rows / experts``, so that the padding (under one block per
  expert) adds at most ``rows`` rows of work (a decoding step's few rows go one per block)."""
  b = 1
  while b * 2 <= min(limit, rows // max(experts, 1)):
    b *= 2
  return b


def num_blocks(rows: int, experts: int, block: int) -> int:
  """The static bound on the blocks of ``rows`` sorted rows over ``experts`` groups."""
  return -(-(rows + experts * (block - 1)) // block)


def blocked_grouped_matmul(
  x_MK: jax.Array,
  w_EKN: jax.Array,
  group_sizes_E: jax.Array,
  *,
  dtype,
  block: int | None = None,
  max_block: int = BLOCK,
) -> jax.Array:
  """``y[m] = x[m] @ w[e(m)]`` for rows sorted by expert, ``e(m)`` the group of row m: the same
  numbers as ``jax.lax.ragged_dot`` (rows past ``sum(group_sizes)`` give zeros).

  Args:
    x_MK: ``[M, K]`` rows in expert order.
    w_EKN: ``[E, K, N]`` the experts' weights.
    group_sizes_E: int ``[E]`` rows per expert (summing to at most M).
    dtype: the compute and output dtype.
    block: rows per block; None: ``block_rows(M, E, max_block)``.
    max_block: the most rows per block when ``block`` is None.

  Returns:
    ``[M, N]`` in ``dtype``.
  """
  m, _ = x_MK.shape
  e = w_EKN.shape[0]
  if block is None:
    if max_block < 1:
      raise ValueError(f"max_block={max_block} must be a positive number of rows")
    block = block_rows(m, e, max_block)
  if block < 1:
    raise ValueError(f"block={block} must be a positive number of rows")
  nb = num_blocks(m, e, block)
  sizes = group_sizes_E.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  padded = -(-sizes // block) * block  # each group to whole blocks
  pad_ends = jnp.cumsum(padded)
  pad_starts = pad_ends - padded
  # Row p of the padded layout: its expert, and the sorted row it holds (if any).
  p = jnp.arange(nb * block, dtype=jnp.int32)
  expert_p = jnp.minimum(jnp.searchsorted(pad_ends, p, side="right"), e - 1).astype(jnp.int32)
  offset_p = p - pad_starts[expert_p]
  valid_p = (offset_p < sizes[expert_p]) & (p < pad_ends[-1])
  src_p = jnp.where(valid_p, starts[expert_p] + offset_p, 0)
  x_pK = jnp.where(valid_p[:, None], x_MK.astype(dtype)[src_p], 0)
  expert_b = expert_p[::block]  # one expert per block
  w_bKN = w_EKN.astype(dtype)[expert_b]
  y_bBN = jnp.einsum(
    "bBK,bKN->bBN", x_pK.reshape(nb, block, -1), w_bKN, preferred_element_type=dtype
  )
  # Sorted row r sits at padded row pad_starts[e(r)] + (r - starts[e(r)]).
  r = jnp.arange(m, dtype=jnp.int32)
  expert_r = jnp.minimum(jnp.searchsorted(ends, r, side="right"), e - 1).astype(jnp.int32)
  dest_r = pad_starts[expert_r] + r - starts[expert_r]
  valid_r = r < ends[-1]
  y_MN = y_bBN.reshape(nb * block, -1)[jnp.where(valid_r, dest_r, 0)]
  return jnp.where(valid_r[:, None], y_MN, 0).astype(dtype)
