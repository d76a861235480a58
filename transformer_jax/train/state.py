"""Where a run starts: the newest intact checkpoint restored, or a fresh state (the method's step
0: initialised, ``model.init_from`` loaded, or a LoRA run's adapters over its base).

Resuming follows MaxText and the HF Trainer: a larger ``train.steps`` continues a run (the plan
has refused any change of model, and of data unless accepted); optimisation, logging and mesh
settings may change. A changed ``train.steps`` re-plans a decaying schedule over the new length,
which a notice says with the learning rate before and after at the resume point. The mesh and the
process count may change (the state is restored onto the new mesh's shardings), and the global
batch size by an integer ratio (the data position is kept in sequences, the schedule in steps).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from transformer_jax import runs
from transformer_jax.train import step as step_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.console import log0
from transformer_jax.train.optim import learning_rate_schedule
from transformer_jax.train.plan import Plan

# Schedules whose learning rate at a step depends on ``train.steps``.
_DECAYING = ("cosine", "linear")


@dataclasses.dataclass
class Start:
  """The placed train state a run starts from, and its step."""

  state: step_lib.TrainState
  step: int


def schedule_notice(before: TrainConfig, after: TrainConfig, step: int) -> str | None:
  """The line a resume at ``step`` prints when ``train.steps`` changed from ``before``'s and the
  schedule decays over it (cosine, linear), else None.

  The schedule is a function of ``train.steps``: the resumed run follows the new one from
  ``step`` on, as if it had been planned over the new length from the start.
  """
  if before.steps == after.steps or after.schedule not in _DECAYING:
    return None
  old = float(learning_rate_schedule(before)(step))
  new = float(learning_rate_schedule(after)(step))
  return (
    f"notice: train.steps changed from {before.steps} to {after.steps}: the {after.schedule} "
    f"schedule is re-planned over {after.steps} steps, so at the resume point (step {step}) "
    f"the learning rate goes from {old:.3e} to {new:.3e}"
  )


def data_position(loader_state: dict, before: TrainConfig | None) -> dict:
  """A checkpoint's loader state with its data position in sequences: a step written before the
  position was recorded consumed ``step`` batches of the run's stored ``train.batch_size``."""
  if "sequences" in loader_state or before is None:
    return loader_state
  return {**loader_state, "sequences": loader_state["step"] * before.batch_size}


def restore_or_init(plan: Plan, ckpt: runs.Checkpoints) -> Start:
  """The state the run starts from; then (only now: everything is checked) the run directory's
  snapshot (``config.yaml``, ``model.yaml``, ``dataset.json``) is written from the plan.

  Restores the newest intact checkpoint into the method's sharded shapes (orbax places each array
  straight onto its shards: the checkpoint may come from another mesh or device count); damaged
  newer steps are set aside as ``damaged-<step>``. Without a checkpoint: the method's fresh state
  (``init_from.json`` written when ``model.init_from`` is loaded). Sets the loader's position,
  in sequences: a run resumed with another ``train.batch_size`` starts at the first sequence not
  yet consumed (its learning-rate schedule stays in steps).

  Raises:
    CheckpointDamaged: no checkpoint of the directory is intact (nothing is rewritten).
  """
  start = _restore(plan, ckpt)
  if start is None:
    plan.loader.set_state({"step": 0})
    start = Start(plan.method.fresh_state(plan.optimizer, plan.mesh, plan.run_dir.path), 0)
  plan.run_dir.write_snapshot(plan.exp.to_dict(), plan.model_config, plan.dataset_ref)
  return start


def _restore(plan: Plan, ckpt: runs.Checkpoints) -> Start | None:
  """The newest intact checkpoint as a placed state (None: no checkpoint)."""
  method, resume = plan.method, plan.resume
  target = method.abstract_state(plan.optimizer, plan.mesh)
  start, params, opt_state, meta, damaged = ckpt.restore_newest_good(
    target.params, target.opt_state
  )
  if start is None:
    return None
  if damaged:
    ckpt.set_aside([s for s, _ in damaged])
    runs.warn(
      f"resuming from step {start}, the newest intact checkpoint; the damaged steps "
      f"are kept as damaged-<step> in {ckpt.directory}"
    )
  if opt_state is None:  # a converted model: parameters only
    log0(f"fine-tuning the parameters of step {start} with a fresh optimizer state")
    opt_state = plan.optimizer.init(params)
  restored = step_lib.TrainState(step=np.int32(start), params=params, opt_state=opt_state)
  state = step_lib.place_state(method.restored(restored, plan.run_dir.path), plan.mesh)
  before = resume.stored.train if resume.stored is not None else None
  if meta.get("loader"):
    plan.loader.set_state(data_position(meta["loader"], before))
  log0(f"resuming from {ckpt.directory} at step {start}")
  if before is not None and before.batch_size != plan.exp.train.batch_size:
    log0(
      f"notice: train.batch_size changed from {before.batch_size} to "
      f"{plan.exp.train.batch_size}: step {start} starts at sequence "
      f"{plan.loader.sequences_at(start)}, the first not yet consumed; the schedule stays in steps"
    )
  notice = None if before is None else schedule_notice(before, plan.exp.train, start)
  if notice:
    log0(notice)
  return Start(state, start)
