"""Embeddings, norms and einsum projections: the parameter-holding leaves of every model."""

from __future__ import annotations

import math
import os
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.ops import linear
from transformer_jax.layers.common import normal, ones, param, zeros
from transformer_jax.parallel import axes as ax


# Decoding multiplies a few rows by every weight matrix once per token, so its speed is the rate at
# which the weights stream from memory. Below this many rows, the products are written weight-first
# (``W[out, in] @ x^T``): XLA:CPU's kernels then stream the weights 1.2-2.5x faster than with
# ``x @ W`` (experiments/PERFORMANCE.md, "Decoding").
SKINNY_ROWS = 64


def einsum_dims(einsum: str) -> tuple[str, str, str]:
  """``"BTD,DNH->BTNH"`` -> (x letters, kernel letters, output letters)."""
  lhs, out = einsum.replace(" ", "").split("->")
  x, kernel = lhs.split(",")
  return x, kernel, out


def weight_first(w_OI: jax.Array, x_RI: jax.Array) -> jax.Array:
  """``x @ w^T`` for a weight stored ``[out, in]``, computed as ``(w @ x^T)^T``: ``[rows, out]``.

  The product is kept in its ``[out, rows]`` layout (an optimization barrier stops XLA from
  folding the transpose back into the dot), and the small result is transposed afterwards.
  """
  return weight_first_pieces((w_OI,), x_RI)


# XLA:CPU's own matrix-vector kernel (jaxlib 0.10; its name in the compiled code,
# ``row_major_gemv_F32_<tile>_<tile>_<rows>_<cols>_<blocks>``, says how it is cut) splits a float32
# product ``W[out, in] @ x`` into min(8, ceil(bytes / 2 MiB)) blocks of rows and shares them over
# its thread pool. When the count is not a multiple of the threads, one thread streams the last
# block alone: GPT-2 small's MLP down projection (768 x 3072, 9.4 MB, 5 blocks) streams at 80% of
# the rate of an evenly shared product on 2 threads (experiments/PERFORMANCE.md, "Even blocks").
GEMV_BLOCK_BYTES = 2 << 20
GEMV_MAX_BLOCKS = 8
GEMV_TILE_ROWS = 8  # the kernel's tile: blocks hold a multiple of 8 rows


def gemv_blocks(nbytes: int) -> int:
  """How many blocks of rows XLA:CPU cuts a float32 matrix-vector product of ``nbytes`` into."""
  return min(GEMV_MAX_BLOCKS, max(1, -(-nbytes // GEMV_BLOCK_BYTES)))


def gemv_threads() -> int:
  """The threads XLA shares a product over when it runs on CPU (its pool has one per CPU this
  process may use); 1 on an accelerator, where the pieces below do not apply."""
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


def weight_first_pieces(ws_OI: Sequence[jax.Array], x_RI: jax.Array) -> jax.Array:
  """``weight_first`` of a kernel cut into row pieces ``ws_OI`` (along ``out``): one product per
  piece, each kept in its own ``[out_i, rows]`` layout, joined along ``out``.

  bfloat16 with 2 or more rows, on a CPU with bf16 units (``linear.matmul_pays``): the products
  sum in float32 (``preferred_element_type``) and are rounded to bfloat16 after, which is what
  XLA:CPU computes for a bfloat16 result too, but in this form YNNPACK's bf16 kernel takes them.
  With a bfloat16 result, XLA upcasts both operands to float32 first: a 32-row prefill of GPT-2
  small then converts every weight (experiments/PERFORMANCE.md, "bfloat16 prompts"). One row
  keeps the bfloat16 result: YNNPACK does not take matrix-vector products, and XLA's float32
  kernel on the upcast weights is the faster one there.
  """
  dims = (((1,), (1,)), ((), ()))
  if x_RI.shape[0] >= 2 and linear.matmul_pays(x_RI.dtype) and all(
      w.dtype == x_RI.dtype for w in ws_OI):
    ys_OR = [jax.lax.dot_general(w, x_RI, dims, preferred_element_type=jnp.float32
                                 ).astype(x_RI.dtype) for w in ws_OI]
  else:
    ys_OR = [jax.lax.dot_general(w, x_RI, dims) for w in ws_OI]
  return jnp.concatenate(jax.lax.optimization_barrier(ys_OR), axis=0).T


class OutInKernel(nnx.Variable):
  """A ``Projection`` kernel with its output dims first and contracted dims last (``[out..., in...]``,
  PyTorch's ``Linear`` layout), for decoding.

  ``Projection.decode_layout`` makes it (``split_layers`` calls that once per set of weights, in a
  program of its own: ``generate.decode.decode_layers``); the projection then multiplies
  weight-first (``weight_first``). It is a read-only copy: training, checkpoints and conversion see
  only the ``Param``.
  """


class OutInPieces(OutInKernel):
  """An ``OutInKernel`` cut along its leading output dim: a tuple of ``[out_i, ..., in...]``
  arrays (``decode_pieces``), multiplied one product per piece (``weight_first_pieces``)."""


class Projection(nnx.Module):
  """A linear map written as an einsum, e.g. ``"BTD,DNH->BTNH"``, with an optional bias.

  The kernel's shape and logical axes are given explicitly, so attention projections keep their
  head structure (``[D, N, H]``) and need no reshapes. ``lora``: an optional low-rank adapter
  (``transformer_jax.lora``) whose output is added; None in a plain model.
  """

  def __init__(self, einsum: str, kernel_shape: Sequence[int], kernel_axes: Sequence[str], *,
               bias_shape: Sequence[int] | None = None, bias_axes: Sequence[str] | None = None,
               init_std: float, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs):
    self.einsum = einsum
    self.dtype = dtype
    self.kernel = param(rngs, normal(init_std), kernel_shape, kernel_axes, param_dtype)
    self.bias = (param(rngs, zeros, bias_shape, bias_axes, param_dtype)
                 if bias_shape is not None else None)
    self.lora = nnx.data(None)

  def contracted_dims(self) -> int:
    """How many leading kernel dims the einsum contracts with x's trailing ones (the decoding
    layout and LoRA adapters rely on that order; every projection here has it).

    Raises:
      ValueError: for an einsum whose kernel does not lead with the dims it contracts.
    """
    x_letters, k_letters, out_letters = einsum_dims(self.einsum)
    n_in = sum(1 for c in k_letters if c in x_letters)
    if (k_letters[:n_in] != x_letters[len(x_letters) - n_in:]
        or out_letters != x_letters[:len(x_letters) - n_in] + k_letters[n_in:]):
      raise ValueError(f"projection {self.einsum!r}: contracted dims must lead its kernel and "
                       "close x")
    return n_in

  def decode_layout(self, threads: int | None = None) -> None:
    """Replaces the kernel by its ``OutInKernel`` transpose (``[in..., out...]`` ->
    ``[out..., in...]``): the layout in which a few rows at a time multiply fastest.

    A float32 kernel whose product XLA:CPU would not share evenly over its ``threads`` (default
    ``gemv_threads()``) is cut along its leading output dim into ``decode_pieces``
    (``OutInPieces``).
    """
    if isinstance(self.kernel, OutInKernel):
      return
    n_in = self.contracted_dims()
    kernel = self.kernel[...]
    kernel = jnp.transpose(kernel, (*range(n_in, kernel.ndim), *range(n_in)))
    pieces = 1
    if kernel.dtype == jnp.float32 and jnp.dtype(self.dtype) == jnp.float32:
      n_out = kernel.ndim - n_in
      pieces = decode_pieces(kernel.shape[0], math.prod(kernel.shape[1:n_out]),
                             math.prod(kernel.shape[n_out:]) * kernel.dtype.itemsize,
                             gemv_threads() if threads is None else threads)
    self.kernel = (OutInKernel(kernel) if pieces == 1 else
                   OutInPieces(tuple(jnp.split(kernel, pieces, axis=0))))

  def __call__(self, x: jax.Array) -> jax.Array:
    if isinstance(self.kernel, OutInKernel):
      # The decoding layout: one weight-first product, or one per piece (OutInPieces).
      value = self.kernel.get_value()
      pieces = [w.astype(self.dtype)
                for w in (value if isinstance(self.kernel, OutInPieces) else (value,))]
      n_in = self.contracted_dims()
      n_out = pieces[0].ndim - n_in
      lead = x.shape[:x.ndim - n_in]
      out = (sum(w.shape[0] for w in pieces), *pieces[0].shape[1:n_out])
      y = weight_first_pieces([w.reshape(math.prod(w.shape[:n_out]), -1) for w in pieces],
                              x.astype(self.dtype).reshape(math.prod(lead), -1))
      y = y.reshape(*lead, *out)
      if self.bias is not None:
        y = y + self.bias[...].astype(self.dtype)
    elif linear.matmul_pays(self.dtype):
      # bfloat16 on a CPU with bf16 units: one [rows, in] @ [in, out] product, bias included
      # (added in float32), whose backward dots stay in bfloat16 too (ops.linear). The reshapes
      # are free: the contracted dims close x and lead the kernel.
      n_in = self.contracted_dims()
      w = self.kernel[...]
      lead, k_in, out = x.shape[:x.ndim - n_in], math.prod(w.shape[:n_in]), w.shape[n_in:]
      bias = None if self.bias is None else self.bias[...].reshape(-1)
      y = linear.matmul(x.reshape(*lead, k_in), w.reshape(k_in, -1), dtype=self.dtype,
                        bias=bias).reshape(*lead, *out)
    else:
      y = jnp.einsum(self.einsum, x.astype(self.dtype), self.kernel[...].astype(self.dtype))
      if self.bias is not None:
        y = y + self.bias[...].astype(self.dtype)
    if self.lora is not None:
      y = y + self.lora(x.astype(self.dtype)).astype(y.dtype)
    return y


class Embed(nnx.Module):
  """A lookup table ``[V, D]``; ``attend`` reuses it as the (tied) output projection."""

  def __init__(self, num_embeddings: int, features: int, *, init_std: float, dtype: jnp.dtype,
               param_dtype: jnp.dtype, rngs: nnx.Rngs,
               axes: tuple[str, str] = (ax.VOCAB, ax.EMBED)):
    self.dtype = dtype
    self.embedding = param(rngs, normal(init_std), (num_embeddings, features), axes, param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    # Ids are range-checked by the models before tracing; "clip" keeps XLA from producing NaN.
    return jnp.take(self.embedding[...], ids, axis=0, mode="clip").astype(self.dtype)

  def attend(self, x_BTD: jax.Array) -> jax.Array:
    """``x @ E^T``: logits ``[B, T, V]`` from hidden states (on CPU weight-first for a few rows, as
    when decoding: the table is already ``[out, in]``)."""
    x_BTD = x_BTD.astype(self.dtype)
    table_VD = self.embedding[...].astype(self.dtype)
    b, t, d = x_BTD.shape
    if b * t <= SKINNY_ROWS and jax.default_backend() == "cpu":
      return weight_first(table_VD, x_BTD.reshape(b * t, d)).reshape(b, t, -1)
    if linear.matmul_pays(self.dtype):
      # bfloat16 on a CPU with bf16 units: the three dots in bfloat16 (ops.linear), the logits
      # kept in float32.
      return linear.matmul(x_BTD, self.embedding[...], dtype=self.dtype, out_dtype=jnp.float32,
                           transpose_w=True)
    return jnp.einsum("BTD,VD->BTV", x_BTD, table_VD)


class Norm(nnx.Module):
  """LayerNorm (scale and bias) or RMSNorm (scale only), statistics in float32."""

  def __init__(self, features: int, *, kind: Literal["layernorm", "rmsnorm"], eps: float,
               param_dtype: jnp.dtype, rngs: nnx.Rngs):
    match kind:
      case "layernorm" | "rmsnorm":
        pass
      case _:
        raise ValueError(f"norm kind {kind!r} must be 'layernorm' or 'rmsnorm'")
    self.kind = kind
    self.eps = eps
    self.scale = param(rngs, ones, (features,), (ax.EMBED,), param_dtype)
    self.bias = (param(rngs, zeros, (features,), (ax.EMBED,), param_dtype)
                 if kind == "layernorm" else None)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.kind == "layernorm":
      return ops.layer_norm(x, self.scale[...], self.bias[...], self.eps)
    return ops.rms_norm(x, self.scale[...], self.eps)


class RelativePositionBias(nnx.Module):
  """T5's learned per-head bias over bucketed relative positions.

  Attention evaluates it on positions (``ops.RelativeBias``, block by block in memory-efficient
  kernels): pass ``bias_fn=layer.bias_fn, bias_params=layer.table()``. The table is a traced
  argument of the kernel, so its gradient flows.
  """

  def __init__(self, num_heads: int, *, num_buckets: int, max_distance: int, bidirectional: bool,
               init_std: float, param_dtype: jnp.dtype, rngs: nnx.Rngs):
    self.bias_fn = ops.RelativeBias(num_buckets=num_buckets, max_distance=max_distance,
                                    bidirectional=bidirectional)
    self.embedding = param(rngs, normal(init_std), (num_buckets, num_heads),
                           (ax.BUCKETS, ax.HEADS), param_dtype)

  def table(self) -> jax.Array:
    """The bias table ``[U, N]`` (U buckets), ``bias_params`` of ``bias_fn``."""
    return self.embedding[...]
