"""Activations and the gated feed-forward pieces (GLU variants, Shazeer 2020)."""

from __future__ import annotations

import functools
import math
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from transformer_jax.ops import residuals

Activation = Literal["relu", "gelu", "gelu_tanh", "silu"]


def relu(x: jax.Array) -> jax.Array:
  return jax.nn.relu(x)


def _derivative_rule(
  f: Callable[[jax.Array], jax.Array], df: Callable[[jax.Array], jax.Array]
) -> Callable[[jax.Array], jax.Array]:
  """``f`` with its derivative ``df`` as its JVP rule (``jax.custom_jvp``).

  Why: left to autodiff, ``jax.nn.gelu(approximate=True)`` keeps five arrays of its input's shape
  (``x``, ``tanh`` and three products) for the backward pass; with the rule, reverse mode keeps
  one, ``df(x)``, computed in the forward's fusion (experiments/PERFORMANCE.md, "Activation
  derivative rule"). Forward mode, ``vmap`` and higher derivatives (the rule is itself
  differentiable) work as before.
  """
  rule = jax.custom_jvp(f)
  rule.defjvp(lambda primals, tangents: (f(primals[0]), df(primals[0]) * tangents[0]))
  return rule  # custom_jvp keeps f's name and docstring


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_derivative(x: jax.Array) -> jax.Array:
  """``Phi(x) + x * phi(x)``."""
  return 0.5 * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0)))) + x * jnp.exp(-0.5 * x * x) * (
    1.0 / math.sqrt(2.0 * math.pi)
  )


def _gelu_tanh_derivative(x: jax.Array) -> jax.Array:
  """d/dx of ``x/2 (1 + tanh(u))``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``."""
  t = jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * (x**3)))  # as in jax.nn.gelu: XLA shares it
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)


def _silu_derivative(x: jax.Array) -> jax.Array:
  """``s (1 + x (1 - s))``, ``s = sigmoid(x)``."""
  s = jax.nn.sigmoid(x)
  return s * (1.0 + x * (1.0 - s))


@functools.partial(_derivative_rule, df=_gelu_derivative)
def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU, ``x * Phi(x)`` (BERT)."""
  return jax.nn.gelu(x, approximate=False)


@functools.partial(_derivative_rule, df=_gelu_tanh_derivative)
def gelu_tanh(x: jax.Array) -> jax.Array:
  """The tanh approximation of GELU (GPT-2, T5 v1.1's "gelu_new")."""
  return jax.nn.gelu(x, approximate=True)


@functools.partial(_derivative_rule, df=_silu_derivative)
def silu(x: jax.Array) -> jax.Array:
  """``x * sigmoid(x)`` (a.k.a. swish)."""
  return jax.nn.silu(x)


_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "relu": relu,
  "gelu": gelu,
  "gelu_tanh": gelu_tanh,
  "silu": silu,
}


def get_activation(name: Activation) -> Callable[[jax.Array], jax.Array]:
  """The activation function called ``name``; ``ValueError`` lists the known names."""
  try:
    return _ACTIVATIONS[name]
  except KeyError:
    raise ValueError(
      f"unknown activation {name!r}; expected one of {sorted(_ACTIVATIONS)}"
    ) from None


def gated(activation: Activation, gate: jax.Array, up: jax.Array) -> jax.Array:
  """``act(gate) * up``: SwiGLU with ``silu``, GeGLU with ``gelu``/``gelu_tanh``, ReGLU with
  relu."""
  return get_activation(activation)(gate) * up


_DERIVATIVES: dict[str, Callable[[jax.Array], jax.Array]] = {
  "relu": lambda x: (x > 0).astype(x.dtype),
  "gelu": _gelu_derivative,
  "gelu_tanh": _gelu_tanh_derivative,
  "silu": _silu_derivative,
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed(name: str, x: jax.Array) -> jax.Array:
  return get_activation(name)(x)


def _packed_fwd(name, x):
  return get_activation(name)(x), residuals.packed(x)


def _packed_bwd(name, x_bits, dy):
  x = residuals.unpacked(x_bits)
  return (_DERIVATIVES[name](x) * dy,)  # the products of the JVP rule above, in its order


_packed.defvjp(_packed_fwd, _packed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _packed_gated(name: str, gate: jax.Array, up: jax.Array) -> jax.Array:
  return gated(name, gate, up)


def _packed_gated_fwd(name, gate, up):
  return gated(name, gate, up), (residuals.packed(gate), residuals.packed(up))


def _packed_gated_bwd(name, res, dy):
  gate, up = map(residuals.unpacked, res)
  return _DERIVATIVES[name](gate) * (dy * up), get_activation(name)(gate) * dy


_packed_gated.defvjp(_packed_gated_fwd, _packed_gated_bwd)


def packed_activation(name: Activation, x: jax.Array, up: jax.Array | None = None) -> jax.Array:
  """``act(x)``, or ``gated(name, x, up)``, for reverse mode only: the backward keeps the inputs
  as their bits (``ops.residuals``) and recomputes the derivative from them.

  Why: the JVP rule above keeps ``df(x)``. In a scan over bfloat16 layers, XLA:CPU stacks that
  residual with a bfloat16 ``dynamic_update_slice``, which it does in float32 by converting the
  whole ``[L, ...]`` stack at every layer; bits are stacked in place. The gradients are the same
  numbers. It is a ``custom_vjp``, so forward mode is lost: ``layers.MLP`` uses it only where its
  projections are the CPU backend's ``matmul`` (also reverse mode only; ``Backend.activate``).
  """
  get_activation(name)  # fail early on an unknown name
  return _packed(name, x) if up is None else _packed_gated(name, x, up)


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
