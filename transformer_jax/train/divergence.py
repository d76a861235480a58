"""The divergence guard: a run stops at the first non-finite loss, parameter or validation loss,
and leaves only good checkpoints behind.

A checkpoint is *good* when its parameters are finite, the loss they gave on the next step's batch
was finite (when that step ran), and they evaluate to a finite loss on the validation batches. So
when the loss of step ``s`` is not finite, the checkpoint of step ``s - 1`` (whose parameters gave
it) is set aside as ``diverged-<step>``; then the newest remaining checkpoints are evaluated, newest
first, and set aside likewise until one evaluates to a finite loss: that one is named as the last
good checkpoint, and a resumed run or ``tjax eval`` starts from it. Non-finite parameters are never
saved.
"""

from __future__ import annotations

import dataclasses
import math

from transformer_jax import runs
from transformer_jax.train import step as step_lib
from transformer_jax.train.evaluation import evaluate
from transformer_jax.train.method import all_params
from transformer_jax.train.plan import Plan


class TrainingDiverged(RuntimeError):
  """The loss or the parameters became NaN or infinite."""


@dataclasses.dataclass
class Guard:
  """Builds the error that stops a diverged run, once its checkpoints are left good."""

  plan: Plan
  ckpt: runs.Checkpoints
  eval_step: object  # step_lib.jit_eval_step of the run's eval step

  def check_params(self, state: step_lib.TrainState, step: int) -> None:
    """Raises :class:`TrainingDiverged` when the parameters of ``step`` (about to be saved) are
    not finite."""
    bad = runs.nonfinite_leaves(state.params)
    if bad:
      raise self.error(
        f"parameters became non-finite at step {step} (in {', '.join(bad[:3])}); not saved",
        step,
        state,
      )

  def check_eval(self, metrics: dict[str, float], state: step_lib.TrainState, step: int) -> None:
    """Raises :class:`TrainingDiverged` when the validation loss of ``step`` is not finite."""
    if not math.isfinite(metrics["val_loss"]):
      raise self.error(
        f"validation loss became {metrics['val_loss']} at step {step}; stopping", step, state
      )

  def error(self, what: str, bad_step: int, state: step_lib.TrainState) -> TrainingDiverged:
    """``what`` (the parameters of ``bad_step`` gave it) followed by what the checkpoints hold
    now: the steps set aside, and the last good checkpoint or that there is none.

    Args:
      what: What became non-finite, and where.
      bad_step: The step whose parameters gave ``what``.
      state: The current train state (its parameters are the shapes to restore into).
    """
    self.ckpt.wait()
    saved_before = self.ckpt.latest_step() is not None
    set_aside = []
    if self.ckpt.latest_step() == bad_step:
      set_aside.append(bad_step)
      self.ckpt.set_aside([bad_step], "diverged")
    good, val_loss, failed = self._newest_good(state)
    set_aside += failed
    text = f"{what}. "
    if len(set_aside) == 1:
      text += (
        f"Checkpoint step {set_aside[0]} gives non-finite losses: set aside as "
        f"diverged-{set_aside[0]} in {self.ckpt.directory}. "
      )
    elif set_aside:
      text += (
        f"Checkpoint steps {', '.join(map(str, set_aside))} give non-finite losses: set "
        f"aside as diverged-<step> in {self.ckpt.directory}. "
      )
    if good is not None:
      text += f"The last good checkpoint (step {good}) is intact"
      text += "." if val_loss is None else f" (validation loss {val_loss:.4g})."
    elif saved_before:
      text += "No good checkpoint remains."
    else:
      text += "No checkpoint was saved before it."
    return TrainingDiverged(text)

  def _newest_good(self, state: step_lib.TrainState):
    """``(step, val_loss, set_aside)``: the newest checkpoint whose parameters evaluate to a
    finite loss (None: none), and the newer steps set aside as diverged. A damaged step is
    skipped (a resume sets it aside); ``val_loss`` is None when the validation split gives no
    batch."""
    set_aside = []
    for step in sorted(self.ckpt.latest.all_steps(), reverse=True):
      try:
        params = self.ckpt.read_params(step, state.params)
      except Exception:  # noqa: BLE001 (damaged: orbax, tensorstore and our checks all raise)
        continue
      try:
        metrics, _ = evaluate(self.plan, all_params(state.replace(params=params)), self.eval_step)
      except ValueError:  # no validation batch: the next step's loss vouches for it
        return step, None, set_aside
      if math.isfinite(metrics["val_loss"]):
        return step, metrics["val_loss"], set_aside
      self.ckpt.set_aside([step], "diverged")
      set_aside.append(step)
    return None, None, set_aside
