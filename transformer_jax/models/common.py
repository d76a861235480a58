"""Input checks and small pieces shared by the model families."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.ops import precision


def with_matmul_precision(method):
  """A model method whose dots, forward and backward, take the precision of the model's
  ``config.matmul_precision`` (``ops.precision.scope``) when it computes in float32 (the setting is
  about float32 products). bfloat16 or float16 compute keeps JAX's own setting, so that nothing
  asks an accelerator for more than the half-precision products that dtype means. Nested calls
  set it again."""
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    c = self.config
    scope = (precision.scope(c.matmul_precision) if jnp.dtype(c.dtype) == jnp.float32
             else contextlib.nullcontext())
    with scope:
      return method(self, *args, **kwargs)
  return wrapped


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_tokens(name: str, ids, vocab_size: int) -> None:
  """Raises ``ValueError`` naming the first out-of-range id and where it is.

  Only concrete arrays can be checked (under ``jit`` the values are unknown); the data loaders check
  ids when a dataset is loaded, so traced calls are covered there.
  """
  if ids is None or not is_concrete(ids):
    return
  arr = np.asarray(ids)
  if arr.ndim != 2:
    raise ValueError(f"{name} must be [batch, length] integers; got shape {arr.shape}")
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must be integers; got dtype {arr.dtype}")
  bad = (arr < 0) | (arr >= vocab_size)
  if bad.any():
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
        f"{name}[{idx[0]}, {idx[1]}] = {int(arr[idx])} is outside the vocabulary [0, {vocab_size})")


def check_length(name: str, length: int, max_len: int) -> None:
  if length > max_len:
    raise ValueError(f"{name} has length {length}, more than max_len={max_len} positions")


def check_same_shape(name: str, x, ref_name: str, ref) -> None:
  if x is not None and tuple(x.shape) != tuple(ref.shape):
    raise ValueError(f"{name}.shape={tuple(x.shape)} must equal {ref_name}.shape={tuple(ref.shape)}")
