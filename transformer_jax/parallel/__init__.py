"""Meshes, logical-axis rules and multi-host start-up. Depends only on JAX."""

from transformer_jax.parallel import axes

__all__ = ["axes"]
