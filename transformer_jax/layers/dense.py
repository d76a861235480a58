"""Embeddings, norms and einsum projections: the parameter-holding leaves of every model."""

from __future__ import annotations

import math
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers.common import normal, ones, param, zeros
from transformer_jax.ops import dispatch
from transformer_jax.parallel import axes as ax


def einsum_dims(einsum: str) -> tuple[str, str, str]:
  """``"BTD,DNH->BTNH"`` -> (x letters, kernel letters, output letters)."""
  lhs, out = einsum.replace(" ", "").split("->")
  x, kernel = lhs.split(",")
  return x, kernel, out


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
    layout, ``cpu.matmul`` and LoRA adapters rely on that order; every projection here has it).

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

  def in_decode_layout(self) -> bool:
    """Whether the kernel is in the decoding layout (``decode_layout``; on CPU only)."""
    if jax.default_backend() != "cpu":
      return False
    from transformer_jax.cpu import decode  # noqa: PLC0415 - CPU only

    return isinstance(self.kernel, decode.OutInKernel)

  def decode_layout(self, threads: int | None = None) -> None:
    """On CPU, replaces the kernel by its read-only decoding-layout copy
    (``cpu.decode.out_in_kernel``: ``[out..., in...]``, multiplied weight-first, cut into pieces
    that share evenly over XLA's ``threads``). Does nothing off CPU or when already done."""
    if jax.default_backend() != "cpu" or self.in_decode_layout():
      return
    from transformer_jax.cpu import decode  # noqa: PLC0415 - CPU only

    self.kernel = decode.out_in_kernel(self.kernel[...], self.contracted_dims(), self.dtype,
                                       threads)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``einsum(x, kernel) + bias`` (plus the LoRA adapter's output) in ``self.dtype``."""
    if self.in_decode_layout():
      from transformer_jax.cpu import decode  # noqa: PLC0415 - CPU only

      y = decode.project(self.kernel, x, self.contracted_dims(), self.dtype)
      if self.bias is not None:
        y = y + self.bias[...].astype(self.dtype)
    elif dispatch.choose_product(self.dtype) == "cpu_bf16":
      from transformer_jax.cpu import matmul  # noqa: PLC0415 - CPU only

      # One [rows, in] @ [in, out] product, bias included (added in float32); the reshapes are
      # free: the contracted dims close x and lead the kernel.
      n_in = self.contracted_dims()
      w = self.kernel[...]
      lead, k_in, out = x.shape[:x.ndim - n_in], math.prod(w.shape[:n_in]), w.shape[n_in:]
      bias = None if self.bias is None else self.bias[...].reshape(-1)
      y = matmul.matmul(x.reshape(*lead, k_in), w.reshape(k_in, -1), dtype=self.dtype,
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
    """``x @ E^T``: logits ``[B, T, V]`` from hidden states, in the product form
    ``ops.dispatch.choose_product`` gives a weight stored ``[out, in]`` (on CPU, weight-first for
    a few rows, as when decoding)."""
    x_BTD = x_BTD.astype(self.dtype)
    table_VD = self.embedding[...].astype(self.dtype)
    b, t, d = x_BTD.shape
    match dispatch.choose_product(self.dtype, rows=b * t, cols=table_VD.shape[0]):
      case "weight_first":
        from transformer_jax.cpu import decode  # noqa: PLC0415 - CPU only

        return decode.weight_first(table_VD, x_BTD.reshape(b * t, d)).reshape(b, t, -1)
      case "cpu_bf16":
        from transformer_jax.cpu import matmul  # noqa: PLC0415 - CPU only

        # The logits kept in float32.
        return matmul.matmul(x_BTD, self.embedding[...], dtype=self.dtype,
                             out_dtype=jnp.float32, transpose_w=True)
      case "padded":
        return padded_attend(x_BTD, table_VD, dispatch.PAD_COLS[jax.default_backend()])
      case _:
        return jnp.einsum("BTD,VD->BTV", x_BTD, table_VD)


def padded_attend(x_BTD: jax.Array, table_VD: jax.Array, multiple: int) -> jax.Array:
  """``x @ E^T`` (``[B, T, V]``) through a table padded with zero rows to a multiple of
  ``multiple``, the padded columns sliced off: the same values, with the product and its
  transposes at an aligned width (``ops.dispatch.PAD_COLS``)."""
  v = table_VD.shape[0]
  table_PD = jnp.pad(table_VD, ((0, -v % multiple), (0, 0)))
  return jnp.einsum("BTD,PD->BTP", x_BTD, table_PD)[..., :v]


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
