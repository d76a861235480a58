"""bfloat16 matrix products whose three dots (the forward's and the backward's two) all run on
XLA:CPU's bfloat16 kernel.

XLA:CPU runs a bfloat16 dot on the CPU's bfloat16 units (AVX-512 BF16, AMX; through YNNPACK) only
when its result is float32, its left operand is row-major ``[m, k]`` and its right one ``[k, n]``
or ``[n, k]``; any other dot is upcast to float32 first (XLA's ``operand_upcaster``). Autodiff of
``x @ W`` gives ``x^T @ dy``, whose left operand is transposed, so ``matmul`` writes its backward
out, with ``x^T`` copied row-major in the forward (``transposed``). The CPU backend
(``backends.cpu.backend``) computes bfloat16 projections with ``matmul`` on a CPU with bf16 units;
nothing else reaches them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from transformer_jax.ops import precision, residuals

# The largest factor ``small_factor`` tries: ``transposed`` splits a dim into that many slices.
MAX_SMALL_FACTOR = 64


def bf16_products_native(dtype) -> bool:
  """Whether ``dtype`` is bfloat16 and runs natively here: the default backend is a CPU with
  bfloat16 units (``hardware.has_bf16_units``). False on GPUs and TPUs, for other dtypes, and on
  CPUs without such units (where a bfloat16 kernel is emulated through float32)."""
  if jnp.dtype(dtype) != jnp.bfloat16 or jax.default_backend() != "cpu":
    return False
  from transformer_jax import hardware  # noqa: PLC0415 - reads /proc/cpuinfo once, on CPU only

  return hardware.has_bf16_units()


def small_factor(n: int) -> int | None:
  """The smallest factor of ``n`` in ``[2, MAX_SMALL_FACTOR]`` (below ``n``), or None."""
  return next((f for f in range(2, MAX_SMALL_FACTOR + 1) if n % f == 0 and n > f), None)


def transposed(a_MK: jax.Array) -> jax.Array:
  """``a.T`` (the last two dims swapped, ``[..., M, K] -> [..., K, M]``) as a row-major copy that
  XLA keeps as a dot's operand.

  A plain transpose is free in XLA (a permuted layout), but XLA:CPU then sees a column-major
  operand and upcasts the dot, or folds the transpose into the dot's dimension numbers after the
  dot's dtype was chosen. A transpose of ``a`` split along one dim, then a reshape, is a copy XLA
  neither folds nor reorders. With no ``small_factor`` of either dim it is the plain transpose.
  """
  *lead, m, k = a_MK.shape
  r = len(lead)
  if (f := small_factor(m)) is not None:  # [f, m/f, k] -> [k, f, m/f] -> [k, m]
    split = a_MK.reshape(*lead, f, m // f, k)
    return split.transpose(*range(r), r + 2, r, r + 1).reshape(*lead, k, m)
  if (f := small_factor(k)) is not None:  # [m, f, k/f] -> [f, k/f, m] -> [k, m]
    split = a_MK.reshape(*lead, m, f, k // f)
    return split.transpose(*range(r), r + 1, r + 2, r).reshape(*lead, k, m)
  return jnp.swapaxes(a_MK, -1, -2)


def _dot(a_MK: jax.Array, b_KN: jax.Array) -> jax.Array:
  """``a @ b`` for row-major ``[m, k]`` and ``[k, n]``, accumulated and returned in float32."""
  return jax.lax.dot_general(
    a_MK, b_KN, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )


def _dot_t(a_MK: jax.Array, b_NK: jax.Array) -> jax.Array:
  """``a @ b.T`` for row-major ``[m, k]`` and ``[n, k]``, in float32: the bfloat16 kernel takes
  this layout as it is (no copy)."""
  return jax.lax.dot_general(
    a_MK, b_NK, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _matmul(x_MK, w, b_N, transpose_w: bool, dtype, out_dtype, matmul_precision):
  return _matmul_fwd(x_MK, w, b_N, transpose_w, dtype, out_dtype, matmul_precision)[0]


def _matmul_fwd(x_MK, w, b_N, transpose_w, dtype, out_dtype, matmul_precision):
  w_lo = w.astype(dtype)
  y = _dot_t(x_MK, w_lo) if transpose_w else _dot(x_MK, w_lo)
  if b_N is not None:  # added to the float32 accumulator, before the rounding to out_dtype
    y = y + b_N.astype(jnp.float32)
  # x^T is copied here, where x is made: in the backward the copy would fuse with the slicing of a
  # scanned layer's residuals into a slow strided loop. w is saved as it is (a scan would stack a
  # second, low-precision copy of every weight), and x as its bits (ops.residuals).
  return y.astype(out_dtype), (residuals.packed(x_MK if transpose_w else transposed(x_MK)), w, b_N)


def _matmul_bwd(transpose_w, dtype, out_dtype, matmul_precision, res, dy_MN):
  with jax.default_matmul_precision(matmul_precision):  # the forward's (ops/precision.py)
    return _matmul_grads(transpose_w, dtype, res, dy_MN)


def _matmul_grads(transpose_w, dtype, res, dy_MN):
  x, w, b_N = res  # x: [M, K], or [K, M] (transposed already) when w is [K, N]
  x = residuals.unpacked(x)
  w_lo, dy_MN = w.astype(dtype), dy_MN.astype(dtype)
  if transpose_w:  # w is [N, K]
    dx_MK = _dot(dy_MN, w_lo)  # [M, N] @ [N, K]
    dw = _dot(transposed(dy_MN), x)  # [N, M] @ [M, K]
  else:  # w is [K, N]
    dx_MK = _dot_t(dy_MN, w_lo)  # [M, N] @ [K, N]^T
    dw = _dot(x, dy_MN)  # [K, M] @ [M, N]
  # The bias gradient (dy's column sums) as a product with a block of ones: one pass of the same
  # kernel, where XLA:CPU's reduction over the rows is a slow windowed loop.
  db = None
  if b_N is not None:
    db = _dot(jnp.ones((8, dy_MN.shape[0]), dtype), dy_MN)[0].astype(b_N.dtype)
  # w's gradient goes from the float32 accumulator straight to w's dtype: no bfloat16 rounding of
  # a float32 master weight's gradient.
  return dx_MK.astype(dtype), dw.astype(w.dtype), db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(
  x: jax.Array,
  w: jax.Array,
  *,
  dtype,
  out_dtype=None,
  transpose_w: bool = False,
  bias: jax.Array | None = None,
) -> jax.Array:
  """``x @ w`` (``x @ w.T`` with ``transpose_w``) over ``x``'s last dim, computed in ``dtype``
  with float32 accumulation, forward and backward, every dot in a layout XLA:CPU's bfloat16
  kernel takes. Reverse-mode differentiable only (a ``jax.custom_vjp``).

  Args:
    x: ``[..., K]``, any float dtype (cast to ``dtype``).
    w: ``[K, N]`` (``[N, K]`` with ``transpose_w``, e.g. a tied embedding table), typically the
      float32 master weight: it is cast to ``dtype`` inside, and its gradient is the float32
      accumulator's value in ``w.dtype``.
    dtype: the operands' compute dtype, e.g. ``jnp.bfloat16``.
    out_dtype: the result's dtype (default ``dtype``); float32 keeps the accumulator's precision,
      e.g. for logits.
    transpose_w: ``w`` is stored ``[N, K]``.
    bias: optional ``[N]``, added to the float32 accumulator.

  Returns:
    ``[..., N]`` in ``out_dtype``.

  Raises:
    ValueError: when ``x``'s last dim is not ``w``'s contracted dim, or ``bias`` is not ``[N]``.
  """
  if w.ndim != 2 or x.shape[-1] != w.shape[1 if transpose_w else 0]:
    raise ValueError(
      f"matmul: x.shape={x.shape} must end in the contracted dim of "
      f"w.shape={w.shape} ({'[N, K]' if transpose_w else '[K, N]'})"
    )
  dtype = jnp.dtype(dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  lead, k = x.shape[:-1], x.shape[-1]
  if bias is not None and bias.shape != (w.shape[0] if transpose_w else w.shape[1],):
    raise ValueError(f"matmul: bias.shape={bias.shape} must be the output dim of w.shape={w.shape}")
  y = _matmul(
    x.reshape(-1, k).astype(dtype),
    w,
    bias,
    bool(transpose_w),
    dtype,
    out_dtype,
    precision.current(),
  )
  if (
    dtype == jnp.bfloat16
    and out_dtype == jnp.float32
    and not transpose_w
    and jax.default_backend() == "cpu"
  ):
    # jaxlib 0.10.2's XLA:CPU folds a caller's transpose of this float32 result into the bfloat16
    # product, which then fails at run time ("Unsupported element type for DotThunk::Execute");
    # the barrier keeps the transpose out. Only this form needs it, and only it takes it.
    y = jax.lax.optimization_barrier(y)
  return y.reshape(*lead, y.shape[-1])
