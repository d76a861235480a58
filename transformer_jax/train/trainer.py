"""``tjax train``: a run that logs, checkpoints, survives faults and resumes exactly.

The run directory's format belongs to :mod:`transformer_jax.runs`: ``config.yaml``, ``model.yaml``,
``dataset.json``, ``checkpoints/`` (orbax: last N plus ``best/``), ``metrics.jsonl``, TensorBoard
events in ``tensorboard/``, ``loss.png`` and ``final.json`` (last metrics and learning bars).

A finished run says so and does nothing; a larger ``train.steps`` continues it; a setting that
would change its model or data is refused by name (start over with ``force_new`` or another
``run_dir``). Nothing in the directory is rewritten before the experiment, the dataset and the
checkpoint to resume from have been checked. SIGINT and SIGTERM save a checkpoint at the end of
the current step and return.

The pieces: ``plan`` (dataset, task, mesh, optimizer, compiled step), ``resume`` (the start
state), ``loop`` (the steps), ``metrics`` (the logs), ``divergence`` (the guard),
``evaluation``, ``bars`` (learning bars and samples).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import jax

from transformer_jax import lora as lora_lib
from transformer_jax import runs, runtime
from transformer_jax.train.bars import check_bars, print_samples
from transformer_jax.train.config import Experiment, load_experiment
from transformer_jax.train.console import log0
from transformer_jax.train.divergence import TrainingDiverged
from transformer_jax.train.evaluation import evaluate_run
from transformer_jax.train.loop import Outcome, train_loop
from transformer_jax.train.lora_run import base_params
from transformer_jax.train.metrics import plot_loss
from transformer_jax.train.plan import (
    Run, compiled_step, ensure_dataset, eval_batches, fixed_microbatches, make_step,
    make_train_loader, plan, preflight)
from transformer_jax.train.resume import resumed_model, start_state, stored_experiment

__all__ = [
    "Run", "TrainingDiverged", "compiled_step", "ensure_dataset", "eval_batches", "evaluate_run",
    "fixed_microbatches", "make_step", "make_train_loader", "plan", "train",
]


def train(exp: Experiment, *, progress: bool | None = None, force_new: bool = False,
          resume_hint: str | None = None) -> dict[str, Any]:
  """Runs (or resumes) the experiment; returns the final metrics and learning-bar results.

  Args:
    exp: The experiment.
    progress: A tqdm bar (True), one plain line per ``train.log_every`` steps (False), or a bar
      only when stderr is a terminal (None).
    force_new: Start over in an existing run directory (what the run wrote is removed).
    resume_hint: The command to print for resuming after an interruption.

  Returns:
    ``final.json``'s contents, plus ``finished_before`` (the run was already done) or
    ``interrupted`` (stopped by SIGINT/SIGTERM after saving).

  Raises:
    ValueError: a bad experiment, dataset, run directory or checkpoint (one line, named); a
      refused start leaves the run directory as it was (a directory it created is removed).
    TrainingDiverged: the loss or the parameters became non-finite.
    RunLocked: another trainer holds the run directory.
  """
  exp = exp.absolute()
  rd = runs.RunDir(exp.run_dir)
  rd.check_usable()   # before a pretraining run that may take hours
  rd.check_owned()
  _pretrain_if_absent(exp, progress)
  preflight(exp)   # before the lock, which creates the directory
  lock = rd.lock() if jax.process_index() == 0 else contextlib.nullcontext()
  with lock:
    return _train_locked(exp, rd, progress, force_new, resume_hint)


def _pretrain_if_absent(exp: Experiment, progress) -> None:
  """Trains ``exp.pretrain`` first when ``model.init_from`` (the run it makes) does not exist yet,
  so a fine-tuning recipe runs on a fresh clone with one command."""
  init_from = exp.model.get("init_from")
  if exp.pretrain is None or init_from is None or runs.RunDir(init_from).exists():
    return
  pre = load_experiment(exp.pretrain, []).absolute()
  if os.path.abspath(pre.run_dir) != os.path.abspath(init_from):
    raise ValueError(f"pretrain={exp.pretrain} writes {pre.run_dir}, not model.init_from="
                     f"{init_from}")
  log0(f"{init_from} does not exist: training it first ({exp.pretrain})")
  result = train(pre, progress=progress)
  if result.get("interrupted"):
    raise ValueError(f"the pretraining run {init_from} was interrupted; run the command again "
                     "to resume it")


def _train_locked(exp: Experiment, rd: runs.RunDir, progress, force_new: bool,
                  resume_hint: str | None) -> dict[str, Any]:
  t = exp.train
  stored = None if force_new else rd.read_config()
  model_config, resuming = resumed_model(exp, rd, stored, force_new)
  if resuming:
    final = rd.read_final()
    last = rd.checkpoint_steps()[-1]
    if last >= t.steps and final is not None and final.get("step") == last:
      log0(f"{rd.path} is finished (step {last} of train.steps={t.steps}); nothing to do. "
           "Give a larger train.steps to continue it.")
      return {**final, "finished_before": True}
  runtime.enable_compilation_cache()
  run = Run.build(exp, model_config)
  runtime.bf16_notice(run.model_config.dtype)
  ref = runs.dataset_ref(run.dataset)
  old_ref = rd.read_dataset_ref() if resuming else None
  if old_ref is not None and old_ref.get("hash") != ref["hash"]:
    raise ValueError(f"the dataset {ref['path']} changed since this run started (content hash "
                     f"{old_ref.get('hash', '?')[:12]} -> {ref['hash'][:12]}); use the same data, "
                     "or --force-new / another run_dir")
  loader = make_train_loader(exp, run.dataset, run.task)
  if force_new and jax.process_index() == 0:
    rd.clear()   # only now: a refused experiment loses nothing of the old run
  ckpt = runs.Checkpoints(rd.checkpoint_dir, keep=t.keep_checkpoints,
                          async_save=t.async_checkpoints)
  try:
    before = (stored_experiment(stored, rd).train if resuming and stored is not None
              else None)
    state, start = start_state(run, rd, ckpt, loader, before)
    # Everything is checked: only now is the directory's snapshot (re)written.
    rd.write_snapshot(exp.to_dict(), run.model_config, ref)
    outcome = train_loop(run, rd, ckpt, loader, state, start,
                         progress=sys.stderr.isatty() if progress is None else progress)
  finally:
    ckpt.close()
  if outcome.stopped_by:
    hint = resume_hint or "run the same training command again"
    log0(f"stopped by {outcome.stopped_by} at step {outcome.step}; checkpoint saved in "
         f"{ckpt.directory}. To resume: {hint}")
    return {"step": outcome.step, "interrupted": outcome.stopped_by}
  return _finish(run, rd, outcome)


def _finish(run: Run, rd: runs.RunDir, outcome: Outcome) -> dict[str, Any]:
  """``final.json`` of a finished run: the last evaluation, then (process 0) ``loss.png``, the
  learning bars and samples, all written to the run directory."""
  state, last_eval = outcome.state, outcome.last_eval
  final = {"step": run.exp.train.steps, **{k: v for k, v in last_eval.items() if k != "step"}}
  if state.frozen is not None:
    final["lora"] = lora_lib.count(state.params, state.frozen)
  if run.task.name == "classify":
    final["majority_baseline"] = run.dataset.meta["majority_baseline"]["val_accuracy"]
    final["labels"] = run.dataset.meta["labels"]
    final["per_class"] = outcome.per_class
  params = base_params(run, state)  # samples and bars run the base architecture
  if jax.process_count() > 1:  # parameters may span hosts: every process joins the gather
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    plot_loss(rd.path)
    final["bars"] = check_bars(run, params, last_eval)
    if run.task.name == "gpt" and run.exp.train.samples:
      final["samples"] = print_samples(run, params)
    rd.write_final(final)
  return final
