"""The training loop: the plan's compiled step from the start state to ``train.steps``, with
logging, evaluation, checkpoints, the divergence guard and SIGINT/SIGTERM.

Its state is the loop's own locals (the train state, the steps dispatched since the last write,
the newest evaluation), passed to and returned from plain functions; the objects it holds own
their files (:class:`metrics.TrainLog`, ``runs.Checkpoints``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from typing import Any

from transformer_jax import runs, runtime
from transformer_jax.train import goodput, profile
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.console import log0
from transformer_jax.train.divergence import Guard
from transformer_jax.train.evaluation import evaluate
from transformer_jax.train.method import all_params
from transformer_jax.train.metrics import StepMetrics, TrainLog
from transformer_jax.train.plan import Plan
from transformer_jax.train.state import Start


@dataclasses.dataclass
class Outcome:
  """How the loop ended."""

  state: step_lib.TrainState
  step: int  # steps taken
  last_eval: dict[str, float]  # {"step", "val_*"}: of ``step`` unless interrupted
  per_class: dict[str, Any] | None  # classify: the last evaluation's per-label report
  stopped_by: str | None  # SIGINT/SIGTERM, when it stopped before train.steps
  goodput: dict[str, Any] | None = None  # goodput.summary of the run's metrics.jsonl (process 0)


class StopFlag:
  """SIGINT/SIGTERM set ``signal`` (its name); the loop saves and stops at the end of the step. A
  second signal acts as usual (KeyboardInterrupt or termination)."""

  def __init__(self):
    self.signal: str | None = None

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name
    signal.signal(signum, self._previous[signum])
    log0(f"\n{self.signal}: saving a checkpoint at the end of this step (again to abort)")

  @contextlib.contextmanager
  def installed(self):
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in self._previous:
      signal.signal(s, self._handle)
    try:
      yield
    finally:
      for s, h in self._previous.items():
        signal.signal(s, h)


def loop(
  plan: Plan,
  ckpt: runs.Checkpoints,
  start: Start,
  *,
  progress: bool,
  started: float | None = None,
) -> Outcome:
  """Trains from ``start`` to ``train.steps`` with the plan's step; ``progress``: a tqdm bar,
  else one plain line per ``train.log_every`` steps; ``started``: the ``time.perf_counter()`` at
  which the run began (its start-up is counted from there; default now).

  Every ``train.log_every`` steps (and before an evaluation or a checkpoint) the metrics of the
  steps since are fetched, checked finite and written; every ``train.eval_every`` steps and at the
  end the parameters are evaluated; every ``train.checkpoint_every`` steps and at the end they are
  saved (and as ``best/`` when evaluated). SIGINT/SIGTERM save at the end of the step and stop.
  Where the time goes is written with the lines (``goodput``); ``train.profile_steps`` writes a
  profiler trace (``profile``).

  Raises:
    TrainingDiverged: a non-finite loss, parameter or validation loss (the checkpoints left are
      good: see ``divergence``).
  """
  t, loader = plan.exp.train, plan.loader
  state, start = start.state, start.step
  train_step = plan.step
  # XLA:CPU's temporaries past what the allocator reuses: said once the first step has run.
  notice = (
    plan.backend.scratch_notice(runtime.temp_bytes(plan.compiled)) if start < t.steps else None
  )
  eval_step = step_lib.jit_eval_step(
    step_lib.make_eval_step(plan.graphdef, plan.task),
    plan.mesh,
    all_params(state),
    backend=plan.backend,
  )
  guard = Guard(plan, ckpt, eval_step)
  log = TrainLog(plan, plan.run_dir.path, start, progress)
  clock = goodput.Clock()
  began = clock.mark if started is None else started
  log.write_times(startup_record(plan, start, log, clock.mark - began))
  tracer = profile.Tracer(t.profile_steps, plan.run_dir.path, start)
  stop = StopFlag()
  pending: list[StepMetrics] = []
  last_eval: dict[str, float] = {}
  per_class = None
  done = start
  try:
    with stop.installed():
      for s in range(start, t.steps):
        with clock.timing("log"):
          tracer.before(s)
        with clock.timing("data"):
          host = loader.batch_at(s)
          tasks_lib.check_token_ids(plan.task, host, plan.model_config.vocab_size)
        loader.set_state({"step": s + 1})
        state, metrics = train_step(state, step_lib.shard_batch(host, plan.mesh, plan.task.keys))
        if s == start and notice:
          log0(notice)
        done = s + 1
        with clock.timing("log"):
          tracer.after(done, state)
        pending.append(StepMetrics.of(done, metrics, host))
        is_last = done == t.steps
        eval_due = done % t.eval_every == 0 or is_last
        ckpt_due = done % t.checkpoint_every == 0 or is_last
        if done % t.log_every == 0 or eval_due or ckpt_due or stop.signal:
          write_steps(log, pending, guard, state, clock)  # checks each loss before a save
          pending = []
        if eval_due:
          with clock.timing("eval"):
            metrics, per_class = evaluate(plan, all_params(state), eval_step)
            guard.check_eval(metrics, state, done)
            last_eval = {"step": done, **metrics}
            log.write_eval(last_eval)
        if ckpt_due or stop.signal:
          with clock.timing("checkpoint"):
            save(ckpt, guard, state, done, loader, last_eval)
        if stop.signal and not is_last:
          break
  finally:
    tracer.close()
    log.close_bar()
    try:
      with clock.timing("checkpoint"):
        ckpt.wait()
      log.write_times({"step": done, **clock.lap()})
    finally:
      log.close()
  summary = goodput.summary(plan.run_dir.read_metrics()) if log.log.enabled else None
  if stop.signal and done < t.steps:
    return Outcome(state, done, last_eval, per_class, stop.signal, summary)
  if not last_eval:  # resumed at the end (the previous run stopped before its final report)
    metrics, per_class = evaluate(plan, all_params(state), eval_step)
    last_eval = {"step": done, **metrics}
  return Outcome(state, done, last_eval, per_class, None, summary)


def startup_record(plan: Plan, start: int, log: TrainLog, seconds: float) -> dict[str, Any]:
  """The line that opens an attempt: its start-up (``compile``: the plan's part of it) and what
  it runs again of an earlier attempt (``goodput.lost``)."""
  steps, lost = log.log.lost
  return {
    "step": start,
    "time_startup": round(seconds, 6),
    "time_compile": round(plan.compile_seconds or 0.0, 6),
    "time_lost": round(lost, 6),
    "steps_lost": steps,
  }


def write_steps(
  log: TrainLog, pending: list[StepMetrics], guard: Guard, state, clock: goodput.Clock
) -> None:
  """Writes the lines of ``pending``; raises ``TrainingDiverged`` at the first non-finite loss
  (whose step's parameters, the checkpoint before it, gave it)."""
  bad = log.write_steps(pending, clock)
  if bad is not None:
    step, loss = bad
    raise guard.error(f"loss became {loss} at step {step}; stopping", step - 1, state)


def save(
  ckpt: runs.Checkpoints, guard: Guard, state, step: int, loader, last_eval: dict[str, float]
) -> None:
  """Saves the checkpoint of ``step`` (and ``best/`` when ``last_eval`` is of ``step``); raises
  ``TrainingDiverged`` instead when its parameters are not finite."""
  guard.check_params(state, step)
  ckpt.save(step, state.params, state.opt_state, {"step": step, "loader": loader.get_state()})
  if last_eval.get("step") == step:
    ckpt.save_best(step, state.params, last_eval["val_loss"])
