"""Checkpoints (orbax ``CheckpointManager``) and the run-directory model format.

A checkpoint step holds three items: ``params`` (the model's ``nnx.State``), ``opt_state`` and
``meta`` (JSON: step, loader state). Evaluation and conversion restore ``params`` alone. The best
parameters by validation loss are kept apart in ``checkpoints/best`` so that "keep the last N"
never deletes them.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
import yaml

from transformer_jax import models


def _abstract(tree):
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


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
    self.best.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
                   metrics={"val_loss": float(val_loss)})

  def restore(self, step: int, params, opt_state):
    """Restores (params, opt_state, meta) of ``step`` into the structure of the given trees."""
    out = self.latest.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(params)),
        opt_state=ocp.args.StandardRestore(_abstract(opt_state)), meta=ocp.args.JsonRestore()))
    return out.params, out.opt_state, out.meta

  def wait(self) -> None:
    self.latest.wait_until_finished()
    self.best.wait_until_finished()

  def close(self) -> None:
    self.latest.close()
    self.best.close()


def restore_params(directory: str, config: models.ModelConfig, *, best: bool = False):
  """The model parameters of the latest (or best) checkpoint under ``directory``."""
  directory = os.path.abspath(directory)
  if best:
    directory = os.path.join(directory, "best")
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step() if not best else (manager.best_step() or manager.latest_step())
  if step is None:
    raise ValueError(f"no checkpoint found in {directory}")
  abstract = _abstract(models.init_abstract(config))
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
