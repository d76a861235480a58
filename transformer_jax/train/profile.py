"""``train.profile_steps: [a, b]``: a profiler trace of the steps after step ``a`` up to step ``b``
(``b - a`` steps, the lines ``a + 1`` to ``b`` of ``metrics.jsonl``), written by
``jax.profiler`` to ``RUN_DIR/profile/`` (TensorBoard's profile plugin and xprof read it).

The trace starts before the batch of step ``a + 1`` is read (or at the first step of a run resumed
between ``a`` and ``b``) and stops once the state of step ``b`` is ready: the stop waits for the
device, the one sync the trace adds.
"""

from __future__ import annotations

import os

import jax

from transformer_jax.train.console import log0


class Tracer:
  """Starts and stops the trace of ``steps`` (``(a, b)``, or None: no trace) around the loop's
  steps."""

  def __init__(self, steps: tuple[int, int] | None, run_dir: str, start: int):
    self.steps = tuple(steps) if steps else None
    self.dir = os.path.join(run_dir, "profile")
    self.active = False
    if self.steps and start >= self.steps[1]:
      self.steps = None  # resumed past them

  def before(self, s: int) -> None:
    """Called before the step that follows ``s`` steps."""
    if self.steps and not self.active and self.steps[0] <= s < self.steps[1]:
      os.makedirs(self.dir, exist_ok=True)
      jax.profiler.start_trace(self.dir)
      self.active = True

  def after(self, done: int, state) -> None:
    """Called once step ``done`` is dispatched (its new ``state``)."""
    if self.active and done >= self.steps[1]:
      jax.block_until_ready(state)
      self.close()
      log0(f"profile of steps {self.steps[0] + 1} to {done} written to {self.dir}")
      self.steps = None

  def close(self) -> None:
    """Stops a trace still running (the loop ended or failed inside it)."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()
