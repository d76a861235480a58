"""A matrix product whose three dots (the forward's, and the backward's two) run in a low-precision
dtype with float32 accumulation, each in a layout XLA:CPU's bfloat16 kernels take.

Why: XLA:CPU runs a bfloat16 dot on the CPU's bfloat16 units (AVX-512 BF16, AMX; through YNNPACK)
only when the result is float32, the left operand is row-major ``[m, k]`` and the right one is
``[k, n]`` or ``[n, k]``. A dot in another layout, or with a bfloat16 result, is converted to
float32 first (XLA's ``operand_upcaster``) and runs at the float32 rate, plus the conversions.
Autodiff of ``x @ W`` gives ``dy @ W^T`` (fine) and ``x^T @ dy``, whose left operand is
transposed: left to XLA, with bfloat16 results, every dot of a bfloat16 training step is upcast.
Here the backward is written out: ``dx = dy @ W^T`` in the ``[n, k]`` form, and ``dW`` from a
row-major copy of ``x^T`` made in the forward, where ``x`` is made (``transposed``).

Measured on a 2-core AMD EPYC with ``avx512_bf16``, GPT-2-small shapes: bfloat16 dots in these
layouts 400-430 GFLOP/s, float32 200-218, bfloat16 left to XLA 155-208 (upcast); the GPT-2-small
bfloat16 train step went from 6.47 s (slower than float32) to about 3 s, 1.5x PyTorch eager
float32 (experiments/PERFORMANCE.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from transformer_jax.ops import precision, residuals


def _dot(a_MK: jax.Array, b_KN: jax.Array) -> jax.Array:
  """``a @ b`` for row-major ``[m, k]`` and ``[k, n]``, accumulated and returned in float32."""
  return jax.lax.dot_general(a_MK, b_KN, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _dot_t(a_MK: jax.Array, b_NK: jax.Array) -> jax.Array:
  """``a @ b.T`` for row-major ``[m, k]`` and ``[n, k]`` (both contracted on their last dim), in
  float32: XLA:CPU's bfloat16 kernels take this layout as it is (the right operand is packed
  transposed), with no copy."""
  return jax.lax.dot_general(a_MK, b_NK, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _small_factor(n: int) -> int | None:
  """The smallest factor of ``n`` in [2, 64], or None."""
  return next((f for f in range(2, 65) if n % f == 0 and n > f), None)


def transposed(a_MK: jax.Array) -> jax.Array:
  """``a.T`` (the last two dims swapped, ``[..., M, K] -> [..., K, M]``) as an array of its own in
  row-major order, which XLA keeps as the operand of a bfloat16 dot instead of folding it into the
  dot's dimension numbers.

  XLA gives a plain transpose the layout that makes it free (the operand's memory, strides
  permuted); its check of a bfloat16 dot then sees a column-major operand and upcasts the dot to
  float32. And a transpose that reaches a dot is later folded into the dot's dimension numbers,
  after the dot's dtype has been chosen, which leaves a bfloat16 dot that only the slow (Eigen)
  kernel would take, and it takes none. Written as a transpose of ``a`` split along one dim, then
  a reshape, the copy is an op XLA neither folds nor reorders (one pass over ``a``).
  ``tests/ops/test_linear.py`` checks the compiled product for upcast and misplaced dots, so an
  XLA change that breaks this shows up there. If neither dim has a small factor, this is the plain
  transpose: correct, and the dot runs at the float32 rate.
  """
  *lead, m, k = a_MK.shape
  r = len(lead)
  if (f := _small_factor(m)) is not None:        # [f, m/f, k] -> [k, f, m/f] -> [k, m]
    split = a_MK.reshape(*lead, f, m // f, k)
    return split.transpose(*range(r), r + 2, r, r + 1).reshape(*lead, k, m)
  if (f := _small_factor(k)) is not None:        # [m, f, k/f] -> [f, k/f, m] -> [k, m]
    split = a_MK.reshape(*lead, m, f, k // f)
    return split.transpose(*range(r), r + 1, r + 2, r).reshape(*lead, k, m)
  return jnp.swapaxes(a_MK, -1, -2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _matmul(x_MK, w, b_N, transpose_w: bool, dtype, out_dtype, matmul_precision):
  return _matmul_fwd(x_MK, w, b_N, transpose_w, dtype, out_dtype, matmul_precision)[0]


def _matmul_fwd(x_MK, w, b_N, transpose_w, dtype, out_dtype, matmul_precision):
  w_lo = w.astype(dtype)
  y = _dot_t(x_MK, w_lo) if transpose_w else _dot(x_MK, w_lo)
  if b_N is not None:   # added to the float32 accumulator, before the rounding to out_dtype
    y = y + b_N.astype(jnp.float32)
  # The weight gradient needs x transposed; transposing it here, where x is made, is a plain copy,
  # where in the backward the copy would be fused with the slicing of a scanned layer's
  # residuals, which XLA:CPU emits as a slow strided loop. w itself is kept (not its
  # low-precision copy): it lives anyway, and a scan over layers would otherwise stack a second
  # copy of every weight. x goes as its bits (ops.residuals: the scan stacks those in place).
  return y.astype(out_dtype), (residuals.packed(x_MK if transpose_w else transposed(x_MK)), w, b_N)


def _matmul_bwd(transpose_w, dtype, out_dtype, matmul_precision, res, dy_MN):
  with jax.default_matmul_precision(matmul_precision):   # the forward's (ops/precision.py)
    return _matmul_grads(transpose_w, dtype, res, dy_MN)


def _matmul_grads(transpose_w, dtype, res, dy_MN):
  x, w, b_N = res   # x: [M, K], or [K, M] (transposed already) when w is [K, N]
  x = residuals.unpacked(x)
  w_lo, dy_MN = w.astype(dtype), dy_MN.astype(dtype)
  if transpose_w:   # w is [N, K]
    dx_MK = _dot(dy_MN, w_lo)                 # [M, N] @ [N, K]
    dw = _dot(transposed(dy_MN), x)           # [N, M] @ [M, K]
  else:             # w is [K, N]
    dx_MK = _dot_t(dy_MN, w_lo)               # [M, N] @ [K, N]^T
    dw = _dot(x, dy_MN)                       # [K, M] @ [M, N]
  # The bias gradient, the column sums of dy, as a product with a block of ones: the same kernel
  # reads dy once, where XLA:CPU's reduction over the rows is a slow windowed loop.
  db = None
  if b_N is not None:
    db = _dot(jnp.ones((8, dy_MN.shape[0]), dtype), dy_MN)[0].astype(b_N.dtype)
  # w's gradient straight from the float32 accumulator into w's dtype: a float32 master weight
  # gets it without a bfloat16 rounding in between.
  return dx_MK.astype(dtype), dw.astype(w.dtype), db


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul(x: jax.Array, w: jax.Array, *, dtype, out_dtype=None, transpose_w: bool = False,
           bias: jax.Array | None = None) -> jax.Array:
  """``x @ w`` (``x @ w.T`` with ``transpose_w``) over ``x``'s last dim, computed in ``dtype`` with
  float32 accumulation, forward and backward, every dot in the layout XLA:CPU runs fastest.

  Args:
    x: ``[..., K]``, any float dtype (cast to ``dtype``).
    w: ``[K, N]`` (``[N, K]`` with ``transpose_w``, e.g. a tied embedding table), typically the
      float32 master weight: it is cast to ``dtype`` inside, and its gradient is the float32
      accumulator's value in ``w.dtype``.
    dtype: the operands' compute dtype, e.g. ``jnp.bfloat16``.
    out_dtype: the result's dtype (default ``dtype``); float32 keeps the accumulator's precision,
      e.g. for logits.
    bias: optional ``[N]``, added to the float32 accumulator; its gradient (the column sums of the
      output's gradient) is a product too.

  Returns:
    ``[..., N]`` in ``out_dtype``.
  """
  if w.ndim != 2 or x.shape[-1] != w.shape[1 if transpose_w else 0]:
    raise ValueError(f"matmul: x.shape={x.shape} must end in the contracted dim of "
                     f"w.shape={w.shape} ({'[N, K]' if transpose_w else '[K, N]'})")
  dtype = jnp.dtype(dtype)
  out_dtype = dtype if out_dtype is None else jnp.dtype(out_dtype)
  lead, k = x.shape[:-1], x.shape[-1]
  if bias is not None and bias.shape != (w.shape[0] if transpose_w else w.shape[1],):
    raise ValueError(f"matmul: bias.shape={bias.shape} must be the output dim of w.shape={w.shape}")
  y = _matmul(x.reshape(-1, k).astype(dtype), w, bias, bool(transpose_w), dtype, out_dtype,
              precision.current())
  if (dtype == jnp.bfloat16 and out_dtype == jnp.float32 and not transpose_w
      and jax.default_backend() == "cpu"):
    # XLA:CPU (jaxlib 0.10.2) folds a caller's transpose of this float32 result (``y.T``) into the
    # product after it has kept the product in bfloat16, and the program then fails when it runs
    # ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32"; plain
    # ``jnp.dot(..., preferred_element_type=float32).T`` fails the same way). The barrier keeps
    # the transpose out of the product. Only this form is guarded: a barrier on every projection
    # made GPT-2 small's bfloat16 step 2% slower, and the library's own products do not take it.
    y = jax.lax.optimization_barrier(y)
  return y.reshape(*lead, y.shape[-1])


def matmul_pays(dtype) -> bool:
  """Whether ``matmul`` is the better way to compute a ``dtype`` projection here: bfloat16 on a CPU
  with bfloat16 units (``avx512_bf16``, ``amx_bf16``), where XLA upcasts the other layouts to
  float32. Without such units a bfloat16 kernel is emulated and slower than float32, so XLA's
  float32 fallback is left alone; GPUs and TPUs run every layout natively, so the einsum is too.
  """
  if jnp.dtype(dtype) != jnp.bfloat16 or jax.default_backend() != "cpu":
    return False
  from transformer_jax import hardware  # noqa: PLC0415

  return hardware.has_bf16_units()
