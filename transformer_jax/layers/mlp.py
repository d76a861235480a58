"""Position-wise feed-forward: ``down(act(up x))`` or the gated ``down(act(gate x) * up x)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import backends, ops
from transformer_jax.layers.dense import Projection
from transformer_jax.parallel import axes as ax


class MLP(nnx.Module):
  """ReLU/GELU MLP, or SwiGLU/GeGLU when ``gated``; products and activation are the
  ``backend``'s (default ``backends.current()``)."""

  def __init__(
    self,
    d_model: int,
    d_ff: int,
    *,
    activation: ops.Activation,
    gated: bool,
    use_bias: bool,
    init_std: float,
    out_init_std: float,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    backend: backends.Backend | None = None,
  ):
    ops.get_activation(activation)  # fail early on an unknown name
    self.activation = activation
    self.backend = backend = backend or backends.current()
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend)
    up = dict(bias_shape=(d_ff,) if use_bias else None, bias_axes=(ax.MLP,), init_std=init_std)
    self.up = Projection("BTD,DF->BTF", (d_model, d_ff), (ax.EMBED, ax.MLP), **up, **common)
    self.gate = (
      Projection("BTD,DF->BTF", (d_model, d_ff), (ax.EMBED, ax.MLP), **up, **common)
      if gated
      else None
    )
    self.down = Projection(
      "BTF,FD->BTD",
      (d_ff, d_model),
      (ax.MLP, ax.EMBED),
      bias_shape=(d_model,) if use_bias else None,
      bias_axes=(ax.EMBED,),
      init_std=out_init_std,
      **common,
    )

  def __call__(
    self, x_BTD: jax.Array, *, dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None
  ) -> jax.Array:
    inputs = (self.up(x_BTD),) if self.gate is None else (self.gate(x_BTD), self.up(x_BTD))
    h_BTF = self.backend.activate(self.activation, *inputs, dtype=self.down.dtype)
    h_BTF = ops.dropout(h_BTF, dropout_rate, dropout_rng)
    return self.down(h_BTF)
