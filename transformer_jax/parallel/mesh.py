"""The device mesh (``data``, ``fsdp``, ``tensor``, ``sequence``, ``expert``) and the checks that a
model, batch and sequence length fit it, made before anything compiles.

A mesh has the ``expert`` axis only where it splits something (size above 1): a dense model's
programs are then the ones they were before mixtures of experts existed, sharding annotations
included. Code reads it as ``mesh.shape.get("expert", 1)``."""

from __future__ import annotations

import math
from typing import Mapping

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor", "sequence", "expert")
# A batch's rows split over the data axes and over ``expert`` (expert parallelism is data parallel
# outside the experts: parallel/experts.py).
BATCH_AXES = ("data", "fsdp", "expert")
OPTIONAL_AXES = ("expert",)  # left out of a mesh where they would be of size 1


def mesh_axes_of(sizes: Mapping[str, int]) -> tuple[str, ...]:
  """The axes a mesh of ``sizes`` (each axis of ``AXES``) has: all but an optional one of size 1."""
  return tuple(a for a in AXES if a not in OPTIONAL_AXES or sizes[a] > 1)


def mesh_shape(shape: Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
  """Resolves the one ``-1`` entry (the remaining devices) and checks the product.

  Raises:
    ValueError: unknown axes, more than one -1, sizes below 1, or a product other than
      ``num_devices`` (the message names the sizes and the device count).
  """
  shape = dict(shape or {"data": -1})
  unknown = set(shape) - set(AXES)
  if unknown:
    raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {', '.join(AXES)}")
  sizes = {n: int(shape.get(n, 1)) for n in AXES}
  free = [n for n, s in sizes.items() if s == -1]
  bad = [f"{n}={s}" for n, s in sizes.items() if s < 1 and s != -1]
  if bad:
    raise ValueError(f"mesh sizes must be >= 1 (or one -1): {', '.join(bad)}")
  if len(free) > 1:
    raise ValueError(f"only one mesh axis may be -1; got {sizes}")
  known = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % known:
      raise ValueError(
        f"mesh {sizes}: the other axes ({known} devices) do not divide the {num_devices} devices"
      )
    sizes[free[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(
      f"mesh {sizes} has {math.prod(sizes.values())} devices, but there are {num_devices}"
    )
  return sizes


def make_mesh(shape: Mapping[str, int] | None = None, devices=None) -> Mesh:
  """A mesh with axes (data, fsdp, tensor, sequence[, expert]); one entry may be -1 (the remaining
  devices). ``expert`` is an axis only when its size is above 1 (``mesh_axes_of``).

  Devices are laid out by ``jax.make_mesh``-style topology order when all devices are used, so the
  innermost axes (tensor, sequence) land on the closest devices (same host/slice).
  """
  devices = jax.devices() if devices is None else list(devices)
  sizes = mesh_shape(shape, len(devices))
  names = mesh_axes_of(sizes)
  dims = tuple(sizes[n] for n in names)
  if len(devices) == jax.device_count() and devices == jax.devices():
    try:
      arr = mesh_utils.create_device_mesh(dims, devices=devices)
    except (ValueError, NotImplementedError, AssertionError):
      arr = np.asarray(devices).reshape(dims)
  else:
    arr = np.asarray(devices).reshape(dims)
  return Mesh(arr, names)


def batch_shards(shape: Mapping[str, int]) -> int:
  """How many devices a batch's rows split over: the product of the ``BATCH_AXES`` sizes in
  ``shape`` (a mesh's ``shape``, or a dict of axis sizes; an axis not there counts as 1)."""
  return math.prod(shape.get(a, 1) for a in BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows split over the data-parallel axes (``data``, ``fsdp`` and ``expert``)."""
  return NamedSharding(mesh, P(tuple(a for a in BATCH_AXES if a in mesh.axis_names)))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def check_config(
  config,
  mesh: Mesh,
  *,
  batch_size: int | None = None,
  seq_len: int | None = None,
  microbatches: int = 1,
) -> None:
  """Fails before compiling when ``config`` (a model config), the batch or the sequence length do
  not fit ``mesh``; each message names the numbers.

  Raises:
    ValueError: heads not divisible by ``tensor``, sequence length not divisible by ``sequence``,
      batch not divisible by the data-parallel devices times microbatches.
  """
  tensor, sequence = mesh.shape["tensor"], mesh.shape["sequence"]
  ep = mesh.shape.get("expert", 1)
  n_batch = batch_shards(mesh.shape)
  experts = getattr(config, "num_experts", 0)
  if ep > 1 and (not experts or experts % ep):
    raise ValueError(f"num_experts={experts} is not divisible by mesh.expert={ep}")
  if config.num_heads % tensor:
    raise ValueError(f"num_heads={config.num_heads} is not divisible by mesh.tensor={tensor}")
  if seq_len is not None and seq_len % sequence:
    raise ValueError(f"sequence length {seq_len} is not divisible by mesh.sequence={sequence}")
  if batch_size is not None and batch_size % (n_batch * microbatches):
    raise ValueError(
      f"batch size {batch_size} is not divisible by the {n_batch} data-parallel devices "
      f"(mesh.data={mesh.shape['data']} x mesh.fsdp={mesh.shape['fsdp']} x "
      f"mesh.expert={ep}) x "
      f"microbatches={microbatches}"
    )
