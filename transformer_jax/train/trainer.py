"""``tjax train``: a run that logs, checkpoints, survives faults and resumes exactly.

The run directory's format belongs to :mod:`transformer_jax.runs`: ``config.yaml``, ``model.yaml``,
``dataset.json``, ``checkpoints/`` (orbax: last N plus ``best/``), ``metrics.jsonl``, TensorBoard
events in ``tensorboard/``, ``loss.png`` and ``final.json`` (last metrics and learning bars).

:func:`train` is config -> plan -> state -> loop: ``plan.make_plan`` checks and resolves
everything (a refused experiment leaves the directory as it was), ``state.restore_or_init`` gives
the start state and writes the directory's snapshot, ``loop.loop`` runs the steps, and the end of
the run is reported (``final.json``, learning bars, samples). A finished run says so and does
nothing; a larger ``train.steps`` continues it. SIGINT and SIGTERM save a checkpoint at the end
of the current step and return.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import jax

from transformer_jax import runs, runtime
from transformer_jax.train.bars import check_bars, print_samples
from transformer_jax.train.config import Experiment, load_experiment
from transformer_jax.train.console import log0
from transformer_jax.train.divergence import TrainingDiverged
from transformer_jax.train.loop import Outcome, loop
from transformer_jax.train.metrics import plot_loss
from transformer_jax.train.plan import Plan, make_plan
from transformer_jax.train.state import restore_or_init

__all__ = ["TrainingDiverged", "train"]


def train(
  exp: Experiment,
  *,
  progress: bool | None = None,
  force_new: bool = False,
  resume_hint: str | None = None,
  accept_data_change: bool = False,
) -> dict[str, Any]:
  """Runs (or resumes) the experiment; returns the final metrics and learning-bar results.

  Args:
    exp: The experiment.
    progress: A tqdm bar (True), one plain line per ``train.log_every`` steps (False), or a bar
      only when stderr is a terminal (None).
    force_new: Start over in an existing run directory (what the run wrote is removed).
    resume_hint: The command to print for resuming after an interruption.
    accept_data_change: Resume on a dataset that changed since the run trained on it.

  Returns:
    ``final.json``'s contents, plus ``finished_before`` (the run was already done) or
    ``interrupted`` (stopped by SIGINT/SIGTERM after saving).

  Raises:
    ValueError: a bad experiment, dataset, run directory or checkpoint (one line, named); a
      refused start leaves the run directory as it was (a directory it created is removed).
    TrainingDiverged: the loss or the parameters became non-finite.
    RunLocked: another trainer holds the run directory.
  """
  pretrain_first(exp.absolute(), progress)
  runtime.enable_compilation_cache()
  plan = make_plan(exp, force_new=force_new, accept_data_change=accept_data_change)
  if plan.finished:
    return finished(plan)
  with claimed(plan) as ckpt:
    start = restore_or_init(plan, ckpt)
    outcome = loop(
      plan, ckpt, start, progress=sys.stderr.isatty() if progress is None else progress
    )
  return report(plan, outcome, resume_hint)


def pretrain_first(exp: Experiment, progress) -> None:
  """Trains ``exp.pretrain`` first when ``model.init_from`` (the run it makes) does not exist yet,
  so a fine-tuning recipe runs on a fresh clone with one command."""
  init_from = exp.model.get("init_from")
  if exp.pretrain is None or init_from is None or runs.RunDir(init_from).exists():
    return
  runs.RunDir(exp.run_dir).check_usable()  # before a pretraining run that may take hours
  runs.RunDir(exp.run_dir).check_owned()
  pre = load_experiment(exp.pretrain, []).absolute()
  if os.path.abspath(pre.run_dir) != os.path.abspath(init_from):
    raise ValueError(
      f"pretrain={exp.pretrain} writes {pre.run_dir}, not model.init_from={init_from}"
    )
  log0(f"{init_from} does not exist: training it first ({exp.pretrain})")
  result = train(pre, progress=progress)
  if result.get("interrupted"):
    raise ValueError(
      f"the pretraining run {init_from} was interrupted; run the command again to resume it"
    )


def finished(plan: Plan) -> dict[str, Any]:
  """What a run that is already done returns (its ``final.json``), once it has said so."""
  steps, last = plan.exp.train.steps, plan.resume.last
  log0(
    f"{plan.run_dir.path} is finished (step {last} of train.steps={steps}); nothing to do. "
    "Give a larger train.steps to continue it."
  )
  return {**plan.resume.final, "finished_before": True}


@contextlib.contextmanager
def claimed(plan: Plan) -> Iterator[runs.Checkpoints]:
  """The run directory held for this run (process 0 takes its lock), its earlier run removed
  with ``force_new`` (only now: a refused plan loses nothing of it), and its checkpoints open
  while the body runs.

  Raises:
    RunLocked: another trainer holds the directory.
    ValueError: its checkpoints changed since the plan read them (another process wrote them).
  """
  rd, t = plan.run_dir, plan.exp.train
  lock = rd.lock() if jax.process_index() == 0 else contextlib.nullcontext()
  with lock:
    if not plan.force_new and tuple(rd.checkpoint_steps()) != plan.resume.steps:
      raise ValueError(
        f"run_dir {rd.path}: its checkpoints changed while this run was planned "
        "(another process wrote them); run the command again"
      )
    if plan.force_new and jax.process_index() == 0:
      rd.clear()
    ckpt = runs.Checkpoints(
      rd.checkpoint_dir, keep=t.keep_checkpoints, async_save=t.async_checkpoints
    )
    try:
      yield ckpt
    finally:
      ckpt.close()


def report(plan: Plan, outcome: Outcome, resume_hint: str | None) -> dict[str, Any]:
  """How the run ended: where to resume an interrupted one; else ``final.json`` of a finished
  run: the last evaluation, what the method and the task add, then (process 0) ``loss.png``, the
  learning bars and samples, all written to the run directory."""
  if outcome.stopped_by:
    hint = resume_hint or "run the same training command again"
    log0(
      f"stopped by {outcome.stopped_by} at step {outcome.step}; checkpoint saved in "
      f"{plan.run_dir.checkpoint_dir}. To resume: {hint}"
    )
    return {"step": outcome.step, "interrupted": outcome.stopped_by}
  state, last_eval, exp = outcome.state, outcome.last_eval, plan.exp
  final = {
    "step": exp.train.steps,
    **{k: v for k, v in last_eval.items() if k != "step"},
    **plan.method.summary(state),
    **plan.task.final_summary(plan.dataset, outcome.per_class),
  }
  if hasattr(plan.loader, "tokens_consumed"):  # a mixture: the tokens each source gave
    final["tokens_per_source"] = plan.loader.tokens_consumed(exp.train.steps)
  params = plan.method.base_params(plan.graphdef, state)  # samples and bars: the base model
  if jax.process_count() > 1:  # parameters may span hosts: every process joins the gather
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    plot_loss(plan.run_dir.path)
    final["bars"] = check_bars(plan, params, last_eval)
    if plan.task.samples and exp.train.samples:
      final["samples"] = print_samples(plan, params)
    plan.run_dir.write_final(final)
  return final
