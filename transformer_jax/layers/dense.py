"""Embeddings, norms and einsum projections: the parameter-holding leaves of every model."""

from __future__ import annotations

from typing import Literal, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import backends, ops
from transformer_jax.backends import einsum_dims
from transformer_jax.layers.common import normal, ones, param, zeros
from transformer_jax.parallel import axes as ax

__all__ = ["Embed", "Norm", "Projection", "RelativePositionBias", "einsum_dims"]


class Projection(nnx.Module):
  """A linear map written as an einsum, e.g. ``"BTD,DNH->BTNH"``, with an optional bias.

  The kernel's shape and logical axes are given explicitly, so attention projections keep their
  head structure (``[D, N, H]``) and need no reshapes. The product is the ``backend``'s
  (``Backend.project``; default ``backends.current()``). ``lora``: an optional low-rank adapter
  (``transformer_jax.lora``) whose output is added; None in a plain model.
  """

  def __init__(
    self,
    einsum: str,
    kernel_shape: Sequence[int],
    kernel_axes: Sequence[str],
    *,
    bias_shape: Sequence[int] | None = None,
    bias_axes: Sequence[str] | None = None,
    init_std: float,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    backend: backends.Backend | None = None,
  ):
    self.einsum = einsum
    self.dtype = dtype
    self.backend = backend or backends.current()
    self.kernel = param(rngs, normal(init_std), kernel_shape, kernel_axes, param_dtype)
    self.bias = (
      param(rngs, zeros, bias_shape, bias_axes, param_dtype) if bias_shape is not None else None
    )
    self.lora = nnx.data(None)

  def contracted_dims(self) -> int:
    """How many leading kernel dims the einsum contracts with x's trailing ones (the backends'
    products and LoRA adapters rely on that order; every projection here has it).

    Raises:
      ValueError: for an einsum whose kernel does not lead with the dims it contracts.
    """
    x_letters, k_letters, out_letters = einsum_dims(self.einsum)
    n_in = sum(1 for c in k_letters if c in x_letters)
    if (
      k_letters[:n_in] != x_letters[len(x_letters) - n_in :]
      or out_letters != x_letters[: len(x_letters) - n_in] + k_letters[n_in:]
    ):
      raise ValueError(
        f"projection {self.einsum!r}: contracted dims must lead its kernel and close x"
      )
    return n_in

  def __call__(self, x: jax.Array, *, merged: bool = False) -> jax.Array:
    """``einsum(x, kernel) + bias`` (plus the LoRA adapter's output) in ``self.dtype``.

    ``merged``: the contracted dims as one (the same numbers; ``Backend.project``).
    """
    y = self.backend.project(
      x,
      self.kernel,
      self.bias,
      einsum=self.einsum,
      n_in=self.contracted_dims(),
      dtype=self.dtype,
      merged=merged,
    )
    if self.lora is not None:
      y = y + self.lora(x.astype(self.dtype)).astype(y.dtype)
    return y


def to_decode_layout(module: nnx.Module, backend: backends.Backend) -> None:
  """Puts every ``Projection`` kernel inside ``module`` in ``backend``'s decoding layout
  (``Backend.decode_layout``; on CPU, XLA:CPU's matrix-vector products), in place: for a layer's
  own copy of its parameters (``Stack.split_layers``)."""
  for _, node in nnx.iter_graph(module):
    if isinstance(node, Projection):
      kernel = backend.decode_layout(node.kernel, n_in=node.contracted_dims(), dtype=node.dtype)
      if kernel is not node.kernel:
        node.kernel = kernel


class Embed(nnx.Module):
  """A lookup table ``[V, D]``; ``attend`` reuses it as the (tied) output projection, the
  ``backend``'s vocabulary head (default ``backends.current()``)."""

  def __init__(
    self,
    num_embeddings: int,
    features: int,
    *,
    init_std: float,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    axes: tuple[str, str] = (ax.VOCAB, ax.EMBED),
    backend: backends.Backend | None = None,
  ):
    self.dtype = dtype
    self.backend = backend or backends.current()
    self.embedding = param(rngs, normal(init_std), (num_embeddings, features), axes, param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    # Ids are range-checked by the models before tracing; "clip" keeps XLA from producing NaN.
    return jnp.take(self.embedding[...], ids, axis=0, mode="clip").astype(self.dtype)

  def attend(self, x_BTD: jax.Array) -> jax.Array:
    """``x @ E^T``: logits ``[B, T, V]`` from hidden states, the backend's vocabulary head
    (``Backend.vocab_head``: on CPU, weight-first for a few rows, as when decoding)."""
    return self.backend.vocab_head(x_BTD, self.embedding, self.dtype)


class Norm(nnx.Module):
  """LayerNorm (scale and bias) or RMSNorm (scale only), statistics in float32."""

  def __init__(
    self,
    features: int,
    *,
    kind: Literal["layernorm", "rmsnorm"],
    eps: float,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    axis: str = ax.EMBED,
  ):
    """``axis``: the logical name of the normalised axis (``head_dim`` for a per-head norm)."""
    match kind:
      case "layernorm" | "rmsnorm":
        pass
      case _:
        raise ValueError(f"norm kind {kind!r} must be 'layernorm' or 'rmsnorm'")
    self.kind = kind
    self.eps = eps
    self.scale = param(rngs, ones, (features,), (axis,), param_dtype)
    self.bias = (
      param(rngs, zeros, (features,), (axis,), param_dtype) if kind == "layernorm" else None
    )

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

  def __init__(
    self,
    num_heads: int,
    *,
    num_buckets: int,
    max_distance: int,
    bidirectional: bool,
    init_std: float,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
  ):
    self.bias_fn = ops.RelativeBias(
      num_buckets=num_buckets, max_distance=max_distance, bidirectional=bidirectional
    )
    self.embedding = param(
      rngs, normal(init_std), (num_buckets, num_heads), (ax.BUCKETS, ax.HEADS), param_dtype
    )

  def table(self) -> jax.Array:
    """The bias table ``[U, N]`` (U buckets), ``bias_params`` of ``bias_fn``."""
    return self.embedding[...]
