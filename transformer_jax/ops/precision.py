"""The precision of float32 matrix products, and how it reaches hand-written backward passes.

A float32 dot's precision is the hardware's business: CPUs compute it in float32, recent NVIDIA GPUs
by default in TensorFloat-32 (a 10-bit mantissa, errors ~1e-3), TPUs by default in one bfloat16
pass. The models run their methods under ``jax.default_matmul_precision`` set from their config's
``matmul_precision`` (``scope``): every dot traced inside takes it, and autodiff's transposed dots
inherit it from the forward's. A ``jax.custom_vjp``'s backward does not: JAX traces it when the
backward pass runs, after the forward's ``with`` block has closed. So the ops that write out their
backward read ``current()`` in the forward and trace the backward ``within`` it.
"""

from __future__ import annotations

import contextlib
import functools

import jax

# Values of the model configs' ``matmul_precision`` (JAX's own names): full float32 products (what
# PyTorch and NumPy compute, the default), TensorFloat-32 (GPU) / three bfloat16 passes (TPU), one
# bfloat16 pass, or "default": whatever JAX's global setting gives (the backend's fastest).
PRECISIONS = ("float32", "tensorfloat32", "bfloat16", "default")


def current() -> str | None:
  """The precision that dots traced now take by default (None: the backend's own)."""
  return jax.config.jax_default_matmul_precision


def scope(precision: str):
  """A context in which float32 dots take ``precision`` (one of ``PRECISIONS``); "default" leaves
  JAX's setting (``jax.default_matmul_precision``, ``JAX_DEFAULT_MATMUL_PRECISION``) as it is."""
  if precision not in PRECISIONS:
    raise ValueError(
      f"matmul_precision={precision!r} must be one of {', '.join(map(repr, PRECISIONS))}"
    )
  if precision == "default":
    return contextlib.nullcontext()
  return jax.default_matmul_precision(precision)


def within(precision: str | None, fn):
  """``fn`` traced under ``precision``, a value of ``current()`` read where the forward ran."""

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.default_matmul_precision(precision):
      return fn(*args, **kwargs)

  return wrapped
