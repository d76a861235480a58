"""Checkpoints (orbax ``CheckpointManager``) and the run-directory model format.

A checkpoint step holds three items: ``params`` (the model's ``nnx.State``), ``opt_state`` and
``meta`` (JSON: step, loader state). Evaluation and conversion restore ``params`` alone. The best
parameters by validation loss are kept apart in ``checkpoints/best`` so that "keep the last N"
never deletes them.

Multi-host: every process calls every method here (orbax synchronises them); each writes the shards
of its own devices and process 0 alone writes metadata and JSON. A restore places arrays where its
target says: give ``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))`` leaves
(or arrays) and each array lands directly on those shards, whatever mesh or device count saved it.
Leaves without a sharding go to :func:`default_sharding`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, Sharding

from transformer_jax import models


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


class Checkpoints:
  """Last-N training checkpoints plus the best parameters by validation loss."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    directory = os.path.abspath(directory)
    self.directory = directory
    self.latest = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True))
    self.best = ocp.CheckpointManager(
        os.path.join(directory, "best"), options=ocp.CheckpointManagerOptions(
            max_to_keep=1, best_fn=lambda m: m["val_loss"], best_mode="min",
            enable_async_checkpointing=async_save, create=True))

  def latest_step(self) -> int | None:
    return self.latest.latest_step()

  def save(self, step: int, params, opt_state, meta: dict[str, Any]) -> None:
    self.latest.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)))

  def save_best(self, step: int, params, val_loss: float) -> None:
    # Two managers saving the same step at once would run orbax's multi-host barriers under the
    # same names ("... is already ongoing"): let the training checkpoint finish first.
    if jax.process_count() > 1:
      self.latest.wait_until_finished()
    self.best.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                   metrics={"val_loss": float(val_loss)})

  def has_opt_state(self, step: int) -> bool:
    """Whether ``step`` holds optimizer state (a converted model holds parameters only)."""
    # A fresh manager cannot describe items it has no handler for yet: look at the files instead.
    return os.path.isdir(os.path.join(self.directory, str(step), "opt_state"))

  def restore(self, step: int, params, opt_state, *, sharding: Sharding | None = None):
    """Restores ``(params, opt_state, meta)`` of ``step`` into the structure of the given trees.

    Args:
      step: The checkpoint step.
      params: Target parameters: arrays or ``ShapeDtypeStruct`` leaves. Each restored array takes
        the leaf's sharding, so a mesh different from the one that saved is fine.
      opt_state: Target optimizer state, likewise.
      sharding: For leaves without a sharding (default :func:`default_sharding`).

    Returns:
      ``(params, opt_state, meta)``; ``opt_state`` is None when ``step`` has none (see
      :meth:`has_opt_state`): start a fresh optimizer then.
    """
    items = dict(params=ocp.args.StandardRestore(abstract_target(params, sharding)),
                 meta=ocp.args.JsonRestore())
    if self.has_opt_state(step):
      items["opt_state"] = ocp.args.StandardRestore(abstract_target(opt_state, sharding))
    out = self.latest.restore(step, args=ocp.args.Composite(**items))
    return out.params, out.get("opt_state"), out.meta

  def wait(self) -> None:
    self.latest.wait_until_finished()
    self.best.wait_until_finished()

  def close(self) -> None:
    self.latest.close()
    self.best.close()


def restore_params(directory: str, config: models.ModelConfig, *, best: bool = False,
                   target=None, sharding: Sharding | None = None):
  """The model parameters of the latest (or best) checkpoint under ``directory``, and its step.

  Args:
    directory: A ``checkpoints/`` directory.
    config: The model's config (gives the parameter shapes).
    best: Restore ``best/`` (the lowest validation loss) instead of the latest step.
    target: Parameter shapes with shardings (``ShapeDtypeStruct`` leaves) to restore into; default
      the model's shapes.
    sharding: For target leaves without a sharding (default :func:`default_sharding`).
  """
  directory = os.path.abspath(directory)
  if best:
    directory = os.path.join(directory, "best")
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step() if not best else (manager.best_step() or manager.latest_step())
  if step is None:
    manager.close()
    raise ValueError(f"no checkpoint found in {directory}")
  abstract = abstract_target(models.init_abstract(config) if target is None else target, sharding)
  params = manager.restore(step, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract))).params
  manager.close()
  return params, step


# -------------------------------------------------------------------------------------------------
# The run-directory model format shared with `tjax convert`.


def model_spec(config: models.ModelConfig) -> dict[str, Any]:
  """A YAML-able description of ``config``: its family and every field."""
  return models.config_to_dict(config)


def save_model(run_dir: str, config: models.ModelConfig, params) -> None:
  """Writes a run directory holding ``config`` and ``params`` (step 0, fresh optimizer state).

  ``tjax eval`` reads it, and ``tjax train`` fine-tunes from it (the optimizer starts fresh).
  """
  if jax.process_index() == 0:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "model.yaml"), "w") as f:
      yaml.safe_dump(model_spec(config), f, sort_keys=False)
  ckpt = Checkpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
  ckpt.latest.save(0, args=ocp.args.Composite(
      params=ocp.args.StandardSave(params), meta=ocp.args.JsonSave({"step": 0, "loader": None})))
  ckpt.wait()
  ckpt.close()


def load_model(run_dir: str, *, best: bool = False):
  """``(config, params)`` from a run directory written by ``tjax train`` or ``save_model``."""
  path = os.path.join(run_dir, "model.yaml")
  if not os.path.exists(path):
    raise ValueError(f"{run_dir} is not a run directory (no model.yaml)")
  with open(path) as f:
    config = models.config_from_dict(yaml.safe_load(f))
  params, _ = restore_params(os.path.join(run_dir, "checkpoints"), config, best=best)
  return config, params
