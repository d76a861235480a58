"""Activations and the gated feed-forward pieces (GLU variants, Shazeer 2020)."""

from __future__ import annotations

from typing import Callable, Literal

import jax
import jax.numpy as jnp

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]


def relu(x: jax.Array) -> jax.Array:
  return jax.nn.relu(x)


def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU, ``x * Phi(x)`` (BERT)."""
  return jax.nn.gelu(x, approximate=False)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """The tanh approximation of GELU (GPT-2, T5 v1.1's "gelu_new")."""
  return jax.nn.gelu(x, approximate=True)


def silu(x: jax.Array) -> jax.Array:
  """``x * sigmoid(x)`` (a.k.a. swish)."""
  return jax.nn.silu(x)


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu,
}


def get_activation(name: Activation) -> Callable[[jax.Array], jax.Array]:
  """The activation function called ``name``; ``ValueError`` lists the known names."""
  try:
    return _ACTIVATIONS[name]
  except KeyError:
    raise ValueError(f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}") from None


def gated(activation: Activation, gate: jax.Array, up: jax.Array) -> jax.Array:
  """``act(gate) * up``: SwiGLU with ``silu``, GeGLU with ``gelu``/``gelu_tanh``, ReGLU with relu."""
  return get_activation(activation)(gate) * up


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return gated("silu", gate, up)


def geglu(gate: jax.Array, up: jax.Array, *, approximate: bool = False) -> jax.Array:
  return gated("gelu_tanh" if approximate else "gelu", gate, up)


def dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
  """Inverted dropout; the identity when ``rng`` is None or ``rate`` is 0."""
  if rng is None or rate == 0.0:
    return x
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"dropout rate={rate} must be in [0, 1)")
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
