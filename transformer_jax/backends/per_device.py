"""A fused attention kernel on each device's share of a mesh.

A Pallas call (splash) is one custom call that GSPMD cannot split, and jax splits a cuDNN call with
a Python callback while compiling, which an exported program cannot hold (``train.export``); so
each kernel is given its shards explicitly with ``jax.shard_map``: the batch over the mesh's
``data`` and ``fsdp`` axes, the heads over ``tensor`` where it divides them.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def _mesh_axes(mesh: Mesh, q_BTNH) -> tuple[tuple[str, ...], str | None]:
  """The mesh axes that split the batch (``data``, ``fsdp``) and the heads (``tensor``, when it
  divides the query heads) of one attention call."""
  sizes = mesh.shape
  batch = tuple(a for a in ("data", "fsdp") if sizes.get(a, 1) > 1)
  tensor = sizes.get("tensor", 1)
  return batch, "tensor" if tensor > 1 and q_BTNH.shape[2] % tensor == 0 else None


def mesh_splits(mesh: Mesh | None, q_BTNH) -> bool:
  """``mesh`` splits this call's batch or heads (and divides the batch)."""
  if mesh is None:
    return False
  batch, head = _mesh_axes(mesh, q_BTNH)
  rows = 1
  for a in batch:
    rows *= mesh.shape[a]
  return bool(batch or head) and q_BTNH.shape[0] % rows == 0


def attention(
  mesh: Mesh, kernel: Callable[..., jax.Array], q_BTNH, k_BSKH, v_BSKH, segment_ids=None
) -> jax.Array:
  """``kernel(q, k, v, seg)`` on each device's rows and heads (``jax.shard_map``).

  Args:
    mesh: the model's mesh (``mesh_splits(mesh, q_BTNH)`` holds).
    kernel: ``(q [b, T, n, H], k [b, S, k, H], v, seg [b, T] | None) -> [b, T, n, H]`` on one
      device's share.
    q_BTNH, k_BSKH, v_BSKH: the whole inputs.
    segment_ids: ``[B, T]`` segment ids for queries and keys, or None.

  Returns:
    ``[B, T, N, H]``, sharded as q.
  """
  batch, head = _mesh_axes(mesh, q_BTNH)
  if head is not None and k_BSKH.shape[2] % mesh.shape[head]:
    head = None  # MQA/GQA with fewer key/value heads than the axis: heads replicated
  x_spec = P(batch or None, None, head, None)
  args, specs = [q_BTNH, k_BSKH, v_BSKH], [x_spec, x_spec, x_spec]
  if segment_ids is not None:
    args.append(segment_ids)
    specs.append(P(batch or None, None))

  def attend(q, k, v, seg=None):
    return kernel(q, k, v, seg)

  return jax.shard_map(attend, mesh=mesh, in_specs=tuple(specs), out_specs=x_spec, check_vma=False)(
    *args
  )
