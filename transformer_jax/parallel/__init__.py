"""Meshes, logical-axis rules, ring attention and multi-host start-up. Depends only on JAX (Flax
just to read parameters' axis metadata)."""

from transformer_jax.parallel import axes, distributed
from transformer_jax.parallel.mesh import (
  AXES,
  BATCH_AXES,
  batch_shards,
  batch_sharding,
  check_config,
  make_mesh,
  mesh_axes_of,
  mesh_shape,
  replicated,
)
from transformer_jax.parallel.rules import (
  ACTIVATION_BTD,
  RULES,
  Rules,
  bytes_per_device,
  constrain,
  logical_specs,
  mesh_axes,
  param_shardings,
  shardings_like,
)
from transformer_jax.parallel.ring import ring_attention

__all__ = [
  "ACTIVATION_BTD",
  "AXES",
  "BATCH_AXES",
  "RULES",
  "Rules",
  "axes",
  "batch_shards",
  "batch_sharding",
  "bytes_per_device",
  "check_config",
  "constrain",
  "distributed",
  "logical_specs",
  "make_mesh",
  "mesh_axes_of",
  "mesh_axes",
  "mesh_shape",
  "param_shardings",
  "replicated",
  "ring_attention",
  "shardings_like",
]
