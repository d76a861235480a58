"""The decoding layout: projection kernels stored ``[out, in]`` and multiplied weight-first, cut
into pieces that XLA:CPU's matrix-vector kernel shares evenly over its threads.

Decoding multiplies a few rows by every weight matrix once per token, so its speed is the rate at
which the weights stream from memory; XLA:CPU streams a weight stored ``[out, in]`` faster when
the product is written weight-first (``W @ x^T``). The CPU backend's ``decode_layout`` stores a
projection kernel so (``out_in_kernel``) and its ``project`` multiplies it with ``project``; its
``vocab_head`` sends a few rows of the tied embedding table to ``weight_first``. Nothing here runs
on a GPU or TPU.
"""

from __future__ import annotations

import math
import os
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.backends.cpu import matmul

# At most this many rows multiply weight-first (experiments/PERFORMANCE.md, "Decoding").
SKINNY_ROWS = 64

# XLA:CPU's own matrix-vector kernel (jaxlib 0.10; its name in the compiled code,
# ``row_major_gemv_F32_<tile>_<tile>_<rows>_<cols>_<blocks>``, says how it is cut) splits a float32
# product ``W[out, in] @ x`` into min(GEMV_MAX_BLOCKS, ceil(bytes / GEMV_BLOCK_BYTES)) blocks of
# rows and shares them over its thread pool: when the count is not a multiple of the threads, one
# thread streams the last block alone (experiments/PERFORMANCE.md, "Even blocks").
GEMV_BLOCK_BYTES = 2 << 20
GEMV_MAX_BLOCKS = 8
GEMV_TILE_ROWS = 8  # the kernel's tile: blocks hold a multiple of 8 rows


class OutInKernel(nnx.Variable):
  """A ``Projection`` kernel with its output dims first and contracted dims last (``[out...,
  in...]``, PyTorch's ``Linear`` layout), multiplied weight-first. A read-only copy made for
  decoding (``generate.decode.decode_layers``): training, checkpoints and conversion see only the
  ``Param``."""


class OutInPieces(OutInKernel):
  """An ``OutInKernel`` cut along its leading output dim: a tuple of ``[out_i, ..., in...]``
  arrays (``decode_pieces``), multiplied one product per piece (``weight_first_pieces``)."""


def weight_first(w_OI: jax.Array, x_RI: jax.Array) -> jax.Array:
  """``x @ w^T`` for a weight stored ``[out, in]``, computed as ``(w @ x^T)^T``: ``[rows, out]``.

  The product is kept in its ``[out, rows]`` layout (an optimization barrier stops XLA from
  folding the transpose back into the dot), and the small result is transposed afterwards.
  """
  return weight_first_pieces((w_OI,), x_RI)


def weight_first_pieces(ws_OI: Sequence[jax.Array], x_RI: jax.Array) -> jax.Array:
  """``weight_first`` of a kernel cut into row pieces ``ws_OI`` (along ``out``): one product per
  piece, each kept in its own ``[out_i, rows]`` layout, joined along ``out``: ``[rows, out]``.

  bfloat16 with 2 or more rows where ``matmul.bf16_products_native``: the products sum in float32
  and are rounded to bfloat16 after (what XLA:CPU computes for a bfloat16 result too), a form
  YNNPACK's bf16 kernel takes where a bfloat16 result would upcast every weight to float32
  (experiments/PERFORMANCE.md, "bfloat16 prompts"). One row keeps the bfloat16 result: YNNPACK
  takes no matrix-vector product, and XLA's float32 kernel on the upcast weights is the faster one
  there.
  """
  dims = (((1,), (1,)), ((), ()))
  if (
    x_RI.shape[0] >= 2
    and matmul.bf16_products_native(x_RI.dtype)
    and all(w.dtype == x_RI.dtype for w in ws_OI)
  ):
    ys_OR = [
      jax.lax.dot_general(w, x_RI, dims, preferred_element_type=jnp.float32).astype(x_RI.dtype)
      for w in ws_OI
    ]
  else:
    ys_OR = [jax.lax.dot_general(w, x_RI, dims) for w in ws_OI]
  return jnp.concatenate(jax.lax.optimization_barrier(ys_OR), axis=0).T


def gemv_blocks(nbytes: int) -> int:
  """How many blocks of rows XLA:CPU cuts a float32 matrix-vector product of ``nbytes`` into."""
  return min(GEMV_MAX_BLOCKS, max(1, -(-nbytes // GEMV_BLOCK_BYTES)))


def gemv_threads() -> int:
  """The threads XLA shares a product over when it runs on CPU (its pool has one per CPU this
  process may use); 1 off CPU."""
  if jax.default_backend() != "cpu":
    return 1
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    return os.cpu_count() or 1


def decode_pieces(lead: int, rest_rows: int, row_bytes: int, threads: int) -> int:
  """How many pieces to cut a float32 decoding kernel into along its leading output dim so that
  XLA:CPU shares each piece's product evenly over ``threads``.

  Args:
    lead: the kernel's leading output dim (the one cut).
    rest_rows: the product of its other output dims (rows of the flattened ``[out, in]`` kernel
      per index of ``lead``).
    row_bytes: bytes of one row of the flattened kernel (its input width times 4).
    threads: the threads of XLA's pool (``gemv_threads``).

  Returns:
    The fewest pieces, each a whole number of kernel tiles, whose block count (``gemv_blocks``) is
    a multiple of ``threads``; 1 when the kernel already is, when no cut gives that, or on one
    thread or more threads than blocks.
  """
  if not 1 < threads <= GEMV_MAX_BLOCKS:
    return 1
  for p in range(1, GEMV_MAX_BLOCKS + 1):
    if lead % p or (lead // p * rest_rows) % GEMV_TILE_ROWS:
      continue
    blocks = gemv_blocks(lead // p * rest_rows * row_bytes)
    if blocks < threads:
      break
    if blocks % threads == 0:
      return p
  return 1


def out_in_kernel(kernel: jax.Array, n_in: int, dtype, threads: int | None = None) -> OutInKernel:
  """A projection kernel ``[in..., out...]`` (``n_in`` contracted dims first) in the decoding
  layout: transposed to ``[out..., in...]``, and for float32 compute cut into ``decode_pieces``
  along its leading output dim (``OutInPieces``) where XLA:CPU would not share its product evenly
  over ``threads`` (default ``gemv_threads()``)."""
  kernel = jnp.transpose(kernel, (*range(n_in, kernel.ndim), *range(n_in)))
  pieces = 1
  if kernel.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.float32:
    n_out = kernel.ndim - n_in
    pieces = decode_pieces(
      kernel.shape[0],
      math.prod(kernel.shape[1:n_out]),
      math.prod(kernel.shape[n_out:]) * kernel.dtype.itemsize,
      gemv_threads() if threads is None else threads,
    )
  return (
    OutInKernel(kernel) if pieces == 1 else OutInPieces(tuple(jnp.split(kernel, pieces, axis=0)))
  )


def project(kernel: OutInKernel, x: jax.Array, n_in: int, dtype) -> jax.Array:
  """``x`` (its last ``n_in`` dims contracted) times a decoding-layout ``kernel``, in ``dtype``:
  one weight-first product, or one per piece. Returns ``[..., out...]`` (no bias)."""
  value = kernel.get_value()
  pieces = [w.astype(dtype) for w in (value if isinstance(kernel, OutInPieces) else (value,))]
  n_out = pieces[0].ndim - n_in
  lead = x.shape[: x.ndim - n_in]
  out = (sum(w.shape[0] for w in pieces), *pieces[0].shape[1:n_out])
  y = weight_first_pieces(
    [w.reshape(math.prod(w.shape[:n_out]), -1) for w in pieces],
    x.astype(dtype).reshape(math.prod(lead), -1),
  )
  return y.reshape(*lead, *out)
