"""Logical axis names -> mesh axes: one table decides how every parameter and activation is split.

Parameters name their dimensions when they are built (``layers.common.param``: the query kernel is
``("embed", "heads", "head_dim")``, stacked blocks add ``"layers"`` in front). ``RULES`` maps each
name onto mesh axes (``data``, ``fsdp``, ``tensor``, ``sequence``):

- data parallel: the ``batch`` of activations over ``data`` (and ``fsdp``); parameters replicated.
- FSDP: parameters' ``embed`` dimension (present in every large matrix) over ``fsdp``, so
  parameters, gradients and optimizer state are split 1/fsdp per device; inside the layer scan XLA
  gathers one layer's weights at a time. The batch is split over ``fsdp`` as well (FSDP is data
  parallel).
- tensor (Megatron): attention ``heads``/``kv_heads`` and ``mlp`` columns over ``tensor``, so the
  query/key/value and MLP-in projections are column-split and the output projections row-split; the
  vocabulary too (embedding rows, logits).
- sequence: the ``length`` of activations over ``sequence``; self-attention then runs as ring
  attention (``parallel.ring``) in models built with that mesh (``mesh=`` of the model
  constructors).

A dimension that a mesh axis does not divide stays whole along that axis (a 97-token vocabulary on
``tensor=2`` is replicated, say); the splits that must divide (heads, sequence length, batch) are
checked up front by ``parallel.mesh.check_config``. To change the parallelism, change the table (or
pass another one), never the model code.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer_jax.parallel import axes as ax

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

RULES: Rules = (
  # Activations.
  (ax.BATCH, ("data", "fsdp", "expert")),
  (ax.LENGTH, "sequence"),
  # Vocabulary: embedding rows and logits.
  (ax.VOCAB, "tensor"),
  # Attention: Megatron column split of q/k/v, row split of the output projection.
  (ax.HEADS, "tensor"),
  (ax.KV_HEADS, "tensor"),
  (ax.HEAD_DIM, None),
  # Dense: the model width of every matrix is where FSDP splits; MLP columns/rows over tensor.
  (ax.EMBED, "fsdp"),
  (ax.MLP, "tensor"),
  # Small or scanned axes stay whole.
  (ax.LAYERS, None),
  (ax.POSITIONS, None),
  (ax.TYPES, None),
  (ax.BUCKETS, None),
  (ax.CLASSES, None),
  # LoRA adapters: A [in, r] and B [r, out] name their in/out dims like the kernel they adapt
  # (embed over fsdp, heads/mlp over tensor); the rank is small and stays whole.
  (ax.LORA_RANK, None),
  # Mixtures of experts: the stacked experts' leading axis over ``expert`` (expert parallelism).
  (ax.EXPERT, "expert"),
  # State-space mixers: Mamba-1's channels over tensor (column split in, row split out, as the
  # MLP); fused projections, states and taps stay whole.
  (ax.SSM_INNER, "tensor"),
  (ax.SSM_STATE, None),
  (ax.SSM_HEADS, None),
  (ax.SSM_PROJ, None),
  (ax.SSM_RANK, None),
  (ax.CONV, None),
)

# Activations at block boundaries: [B, T, D] split over batch and length, the width whole.
ACTIVATION_BTD = (ax.BATCH, ax.LENGTH, None)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
  if axes is None:
    return ()
  return (axes,) if isinstance(axes, str) else tuple(axes)


def mesh_axes(
  logical: Sequence[str | None],
  rules: Rules = RULES,
  mesh: Mesh | None = None,
  shape: Sequence[int] | None = None,
) -> P:
  """The ``PartitionSpec`` over mesh axes for a tensor whose dimensions have ``logical`` names.

  With ``mesh`` and ``shape``, mesh axes absent from the mesh, of size 1, already used by an earlier
  dimension, or not dividing the dimension are left out (that dimension is replicated over them).

  Raises:
    KeyError: a logical name the rules do not know.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for i, name in enumerate(logical):
    if name is None:
      out.append(None)
      continue
    if name not in table:
      raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
    kept, size = [], 1
    for axis in _as_tuple(table[name]):
      if axis in used:
        continue
      if mesh is not None:
        n = mesh.shape.get(axis, 1)
        if n == 1 or (shape is not None and shape[i] % (size * n)):
          continue
        size *= n
      kept.append(axis)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def logical_specs(params) -> Any:
  """The logical ``PartitionSpec`` (axis names) of each leaf of an ``nnx.State`` of parameters."""
  # parallel/ depends only on JAX; Flax is needed just to read the metadata.
  from flax import nnx  # noqa: PLC0415

  return nnx.get_partition_spec(params)


def param_shardings(params, mesh: Mesh, rules: Rules = RULES) -> Any:
  """``NamedSharding`` for every parameter (concrete or ``ShapeDtypeStruct``) from its axis
  names."""
  specs = logical_specs(params)
  return jax.tree.map(
    lambda spec, x: NamedSharding(mesh, mesh_axes(tuple(spec), rules, mesh, x.shape)),
    specs,
    params,
    is_leaf=lambda x: isinstance(x, P),
  )


def shardings_like(tree, params, params_shardings, mesh: Mesh) -> Any:
  """Shardings for a tree holding copies of ``params`` (optimizer moments): every subtree shaped
  like ``params`` gets ``params_shardings``; everything else (step counts, scalars) is
  replicated."""
  params_def = jax.tree.structure(params)
  replicated = NamedSharding(mesh, P())

  def is_params(x):
    return jax.tree.structure(x) == params_def and jax.tree.leaves(x) != [x]

  def visit(sub):
    if is_params(sub):
      return params_shardings
    return jax.tree.map(lambda _: replicated, sub)

  return jax.tree.map(visit, tree, is_leaf=is_params)


def bytes_per_device(tree, shardings) -> int:
  """Bytes one device holds of ``tree`` (arrays or ``ShapeDtypeStruct``) under ``shardings``."""
  total = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    total += math.prod(s.shard_shape(x.shape)) * jax.numpy.dtype(x.dtype).itemsize
  return total


def constrain(
  x: jax.Array, logical: Sequence[str | None], mesh: Mesh | None, rules: Rules = RULES
) -> jax.Array:
  """``with_sharding_constraint`` of ``x`` to its logical axes on ``mesh``; ``x`` itself without
  one.

  Layers call it with the mesh their model was built with (``mesh=`` of the model constructors), so
  the same model code runs on one device (``mesh=None``) and on a mesh.
  """
  if mesh is None:
    return x
  spec = mesh_axes(logical, rules, mesh, x.shape)
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
