"""Checkpoints of a run directory (orbax): the last N training steps, the best parameters, and
models saved alone by ``tjax convert``.

A training step ``checkpoints/<N>/`` holds ``params``, ``opt_state`` and ``meta`` (JSON: step,
loader state: the step and the sequences consumed before it, and ``params_only`` for a converted
model, which has no optimizer state); ``checkpoints/best/<N>/`` holds ``params``. A step is
verified when restored (tree structure, shapes and dtypes against the target, finite parameters);
a damaged step is named in a warning and the newest intact one is used. Steps set aside keep their
files as ``<label>-<N>`` beside them. Restoring places every array straight onto the target's
shardings (orbax reads each shard where the target puts it): a step saved on another mesh, device
or process count restores without gathering the state on one host.
Multi-host: every process calls these methods (orbax synchronises them).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Sharding

from transformer_jax import models
from transformer_jax.runs.directory import RunDir, read_json, warn
from transformer_jax.runs.orbax_errors import naming, quiet_aborted_reads, reason
from transformer_jax.runs.trees import abstract_target, check_finite, nonfinite_leaves, verify_tree


def _count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class CheckpointDamaged(ValueError):
  """No checkpoint step of a directory can be restored intact."""


class Checkpoints:
  """Last-N training checkpoints plus the best parameters by validation loss."""

  def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
    directory = os.path.abspath(directory)
    self.directory = directory
    self.latest = ocp.CheckpointManager(
      directory,
      options=ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True
      ),
    )
    self.best = ocp.CheckpointManager(
      os.path.join(directory, "best"),
      options=ocp.CheckpointManagerOptions(
        max_to_keep=1,
        best_fn=lambda m: m["val_loss"],
        best_mode="min",
        enable_async_checkpointing=async_save,
        create=True,
      ),
    )

  def latest_step(self) -> int | None:
    return self.latest.latest_step()

  def save(self, step: int, params, opt_state, meta: dict[str, Any]) -> None:
    with naming(self.directory):  # a failed earlier async save surfaces here
      self.latest.save(
        step,
        args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          opt_state=ocp.args.StandardSave(opt_state),
          meta=ocp.args.JsonSave(meta),
        ),
      )

  def save_best(self, step: int, params, val_loss: float) -> None:
    # Two managers saving the same step at once would run orbax's multi-host barriers under the
    # same names ("... is already ongoing"): let the training checkpoint finish first.
    with naming(self.directory):
      if jax.process_count() > 1:
        self.latest.wait_until_finished()
      self.best.save(
        step,
        args=ocp.args.Composite(params=ocp.args.StandardSave(params)),
        metrics={"val_loss": float(val_loss)},
      )

  def read_meta(self, step: int) -> dict:
    """The ``meta`` item of ``step``, read from its file: an object whose ``loader`` (the data
    position to resume from) is null or an object with an integer ``step`` >= 0 and, in steps
    written since the data position is kept in sequences, an integer ``sequences`` >= 0 (the
    sequences consumed before ``step``; without it, ``step`` x the run's batch size).

    Raises:
      ValueError: the item is missing or damaged (the file and the field named).
    """
    path = os.path.join(self.directory, str(step), "meta", "metadata")
    if not os.path.exists(path):
      raise ValueError(f"item meta/ is missing ({path})")
    meta = read_json(path)
    loader = meta.get("loader")
    if loader is not None and not (
      isinstance(loader, dict)
      and _count(loader.get("step"))
      and ("sequences" not in loader or _count(loader["sequences"]))
    ):
      raise ValueError(
        f"{path}: loader={loader!r}: expected null or an object with an integer step >= 0 "
        "(and, where present, an integer sequences >= 0)"
      )
    return meta

  def restore(self, step: int, params, opt_state, *, sharding: Sharding | None = None):
    """Restores and verifies ``(params, opt_state, meta)`` of ``step``.

    Args:
      step: The checkpoint step.
      params: Target parameters: arrays or ``ShapeDtypeStruct`` leaves. Each restored array takes
        the leaf's sharding, so a mesh different from the one that saved is fine.
      opt_state: Target optimizer state, likewise.
      sharding: For leaves without a sharding (default :func:`trees.default_sharding`).

    Returns:
      ``(params, opt_state, meta)``; ``opt_state`` is None only for a step written by
      :func:`save_model` (``meta["params_only"]``): start a fresh optimizer then.

    Raises:
      ValueError: the step is damaged (a missing item, unreadable or truncated files, a tree,
        shape or dtype that differs from the target, or non-finite parameters), named.
    """
    meta = self.read_meta(step)
    params_only = bool(meta.get("params_only"))
    has_opt = os.path.isdir(os.path.join(self.directory, str(step), "opt_state"))
    if not params_only and not has_opt:
      raise ValueError("item opt_state/ is missing (the optimizer state would be lost)")
    for item in ("params",) + (() if params_only else ("opt_state",)):
      if not os.path.exists(os.path.join(self.directory, str(step), item, "_METADATA")):
        raise ValueError(f"{item}/_METADATA is missing")
    target_p = abstract_target(params, sharding)
    items = dict(params=ocp.args.StandardRestore(target_p))
    if not params_only:
      target_o = abstract_target(opt_state, sharding)
      items["opt_state"] = ocp.args.StandardRestore(target_o)
    out = self.latest.restore(step, args=ocp.args.Composite(**items))
    verify_tree("params", out.params, target_p)
    restored_opt = None
    if not params_only:
      restored_opt = out.opt_state
      verify_tree("opt_state", restored_opt, target_o)
    check_finite(out.params)
    return out.params, restored_opt, meta

  def read_params(self, step: int, params, *, sharding: Sharding | None = None):
    """The verified parameters of ``step`` alone (no optimizer state), restored into ``params``'
    shapes and shardings.

    Raises:
      ValueError: the step is damaged, or its parameters are not finite.
    """
    target = abstract_target(params, sharding)
    with quiet_aborted_reads():
      out = self.latest.restore(
        step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target))
      ).params
    verify_tree("params", out, target)
    check_finite(out)
    return out

  def restore_newest_good(self, params, opt_state, *, sharding: Sharding | None = None):
    """Restores the newest step that passes :meth:`restore`'s checks.

    Returns:
      ``(step, params, opt_state, meta, damaged)`` with ``damaged`` the newer steps skipped, as
      ``[(step, reason)]``; each was named in a warning line. ``step`` is None when there is none.

    Raises:
      CheckpointDamaged: steps exist but none is intact (every reason listed).
    """
    damaged = []
    steps = sorted(self.latest.all_steps(), reverse=True)
    for step in steps:
      try:
        with quiet_aborted_reads():
          p, o, meta = self.restore(step, params, opt_state, sharding=sharding)
      except Exception as e:  # noqa: BLE001 - orbax, tensorstore and our checks each raise theirs
        why = reason(e)
        damaged.append((step, why))
        warn(
          f"checkpoint step {step} in {self.directory} is damaged ({why}); trying the previous step"
        )
        continue
      return step, p, o, meta, damaged
    if damaged:
      raise CheckpointDamaged(
        f"no intact checkpoint in {self.directory}: "
        + "; ".join(f"step {s}: {r}" for s, r in damaged)
      )
    return None, None, None, None, []

  def set_aside(self, steps: list[int], label: str = "damaged") -> None:
    """Moves ``steps`` to ``<label>-<step>`` (kept for inspection, out of orbax's sight), so that
    training can write those steps again. Waits for pending saves; reopens the manager."""
    if not steps:
      return
    options = self.latest._options  # noqa: SLF001 (the same options as when opened)
    self.wait()
    self.latest.close()
    if jax.process_index() == 0:
      for step in steps:
        src = os.path.join(self.directory, str(step))
        dst = os.path.join(self.directory, f"{label}-{step}")
        if os.path.exists(dst):
          shutil.rmtree(dst)
        os.rename(src, dst)
    if jax.process_count() > 1:  # the others reopen once process 0 has moved the steps
      from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

      multihost_utils.sync_global_devices(f"tjax set aside {steps}")
    self.latest = ocp.CheckpointManager(self.directory, options=options)

  def wait(self) -> None:
    with naming(self.directory):
      self.latest.wait_until_finished()
      self.best.wait_until_finished()

  def close(self) -> None:
    with naming(self.directory):
      self.latest.close()
      self.best.close()


def restore_params(
  directory: str,
  config: models.ModelConfig,
  *,
  best: bool = False,
  target=None,
  sharding: Sharding | None = None,
):
  """The verified model parameters of the latest (or best) intact checkpoint, and its step.

  Args:
    directory: A ``checkpoints/`` directory.
    config: The model's config (gives the parameter shapes).
    best: Restore ``best/`` (the lowest validation loss) instead of the latest step.
    target: Parameter shapes with shardings (``ShapeDtypeStruct`` leaves) to restore into; default
      the model's shapes.
    sharding: For target leaves without a sharding (default :func:`trees.default_sharding`).

  Raises:
    ValueError: no checkpoint, or none intact (each damaged step named).
  """
  directory = os.path.abspath(directory)
  if best:
    directory = os.path.join(directory, "best")
  if not os.path.isdir(directory):
    raise ValueError(f"no checkpoint found in {directory}")
  abstract = abstract_target(models.init_abstract(config) if target is None else target, sharding)
  manager = ocp.CheckpointManager(directory)
  try:
    steps = sorted(manager.all_steps(), reverse=True)
    if best and manager.best_step() is not None:
      steps.remove(manager.best_step())
      steps.insert(0, manager.best_step())
    if not steps:
      raise ValueError(f"no checkpoint found in {directory}")
    damaged = []
    for step in steps:
      try:
        with quiet_aborted_reads():
          params = manager.restore(
            step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract))
          ).params
        verify_tree("params", params, abstract)
        check_finite(params)
      except Exception as e:  # noqa: BLE001 - orbax, tensorstore and our checks each raise theirs
        damaged.append((step, reason(e)))
        warn(
          f"checkpoint step {step} in {directory} is damaged ({reason(e)}); trying the "
          "previous step"
        )
        continue
      return params, step
    raise CheckpointDamaged(
      f"no intact checkpoint in {directory}: " + "; ".join(f"step {s}: {r}" for s, r in damaged)
    )
  finally:
    manager.close()


# -------------------------------------------------------------------------------------------------
# Models alone (``tjax convert``).


def save_model(run_dir: str, config: models.ModelConfig, params) -> None:
  """Writes a new run directory holding ``config`` and ``params`` (step 0, no optimizer state).

  ``tjax eval`` reads it, and ``tjax train`` fine-tunes from it (the optimizer starts fresh).

  Raises:
    ValueError: ``run_dir`` exists and is not empty (nothing there is touched).
  """
  rd = RunDir(run_dir)
  if not rd.is_empty():
    raise ValueError(f"{rd.path} exists and is not empty; give a new directory to write to")
  rd.check_usable()
  bad = nonfinite_leaves(params)
  if bad:
    raise ValueError(f"non-finite parameters in {', '.join(bad[:3])}; nothing written")
  rd.mark()  # first: whatever follows is this run's
  ckpt = Checkpoints(rd.checkpoint_dir, async_save=False)
  try:
    ckpt.latest.save(
      0,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        meta=ocp.args.JsonSave({"step": 0, "loader": None, "params_only": True}),
      ),
    )
    ckpt.wait()
  finally:
    ckpt.close()
  rd.write_snapshot(None, config, None)  # last: a directory with model.yaml is complete


def load_model(run_dir: str, *, best: bool = False):
  """``(config, params)`` from a run directory written by ``tjax train`` or ``save_model``."""
  rd = RunDir(run_dir)
  config = rd.require_model()
  params, _ = restore_params(rd.checkpoint_dir, config, best=best)
  return config, params
