"""Checks on parameter trees read from or written to a checkpoint: restore targets with shardings,
structure/shape/dtype verification, and non-finite leaves named by path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding


def default_sharding() -> Sharding:
  """Where a restored array goes when its target names no sharding.

  A single process: its first local device. A multi-process job: replicated over every device, so
  that each process holds the arrays it computes with.
  """
  if jax.process_count() == 1:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  return NamedSharding(Mesh(np.asarray(jax.devices()), ("devices",)), P())


def abstract_target(tree, sharding: Sharding | None = None):
  """``tree`` as ``ShapeDtypeStruct`` leaves for a restore, each with a sharding.

  Leaves may be arrays or ``ShapeDtypeStruct``; a leaf's own sharding is kept. Leaves without one
  get ``sharding`` (default :func:`default_sharding`), since orbax can only fall back on the
  sharding saved in the checkpoint, which names the devices of the job that wrote it.
  """
  fallback = default_sharding() if sharding is None else sharding

  def leaf(x):
    s = ocp.utils.to_shape_dtype_struct(x)
    if not isinstance(s, jax.ShapeDtypeStruct) or s.sharding is not None:
      return s
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=fallback)

  return jax.tree.map(leaf, tree)


@jax.jit
def _finite_leaves(tree):
  return [
    jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)
  ]


def leaf_path(path) -> str:
  """A key path as dotted names (``layers.attn.query.kernel``), NNX's ``value`` entries dropped."""
  keys = [getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path]
  return ".".join(str(k) for k in keys if k != "value")


def nonfinite_leaves(tree) -> list[str]:
  """Paths of the floating-point leaves of ``tree`` holding a NaN or an infinity."""
  flags = jax.device_get(_finite_leaves(tree))
  paths = [
    leaf_path(p)
    for p, x in jax.tree_util.tree_leaves_with_path(tree)
    if jnp.issubdtype(x.dtype, jnp.inexact)
  ]
  return [p for p, ok in zip(paths, flags) if not ok]


def verify_tree(what: str, tree, target) -> None:
  """Raises ``ValueError`` unless ``tree`` has ``target``'s structure, shapes and dtypes."""
  got, want = jax.tree.structure(tree), jax.tree.structure(target)
  if got != want:
    got_paths = {leaf_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}
    want_paths = {leaf_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(target)}
    missing, extra = sorted(want_paths - got_paths), sorted(got_paths - want_paths)
    raise ValueError(
      f"{what}: tree structure differs (missing {missing[:3]}, unexpected {extra[:3]})"
    )
  for (path, x), t in zip(jax.tree_util.tree_leaves_with_path(tree), jax.tree.leaves(target)):
    if tuple(x.shape) != tuple(t.shape) or jnp.dtype(x.dtype) != jnp.dtype(t.dtype):
      raise ValueError(
        f"{what}.{leaf_path(path)}: {x.dtype}{list(x.shape)}, expected {t.dtype}{list(t.shape)}"
      )


def check_finite(tree) -> None:
  """Raises ``ValueError`` naming (up to three) leaves of ``tree`` that hold a NaN or infinity."""
  bad = nonfinite_leaves(tree)
  if bad:
    raise ValueError(f"non-finite parameters in {', '.join(bad[:3])}")
