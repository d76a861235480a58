"""Validation: the loss and accuracies of parameters on a run's validation batches, and
``tjax eval`` on a run directory's checkpoint."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np

from transformer_jax import models, parallel, runs
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.config import load_experiment, parse_overrides
from transformer_jax.train.plan import Run, eval_batches


def evaluate(run: Run, params, eval_step) -> tuple[dict[str, float], dict[str, Any] | None]:
  """Evaluates ``params`` on the validation batches of ``run``.

  Args:
    run: The run (dataset, task, mesh).
    params: Every parameter of the model ``run.graphdef`` describes.
    eval_step: ``step_lib.jit_eval_step`` of the run's eval step.

  Returns:
    ``(metrics, per_class)``: ``val_loss``, ``val_<term>_loss`` and ``val_<term>_accuracy`` per
    loss term, then ``val_perplexity`` (``val_accuracy`` and ``val_macro_f1`` for classify);
    ``per_class`` is the classify task's per-label report, else None.

  Raises:
    ValueError: the validation split gives no batch of ``train.batch_size``.
  """
  sums, counts = None, None
  for batch in eval_batches(run.exp, run.dataset, run.task):
    tasks_lib.check_token_ids(run.task, batch, run.model_config.vocab_size)
    s, c = eval_step(params, step_lib.shard_batch(batch, run.mesh, run.task.keys))
    sums = s if sums is None else jax.tree.map(np.add, sums, s)
    counts = c if counts is None else jax.tree.map(np.add, counts, c)
  if sums is None:
    raise ValueError(f"the validation split of {run.dataset.path} gives no batch of "
                     f"{run.exp.train.batch_size}; lower train.batch_size")
  out = {k: float(v) for k, v in tasks_lib.summarize(run.task, sums, counts).items()}
  result = {"val_loss": out.pop("loss")}
  for term in run.task.loss_terms:
    result[f"val_{term}_loss"] = out[f"{term}_loss"]
    result[f"val_{term}_accuracy"] = out[f"{term}_accuracy"]
  first = run.task.loss_terms[0]
  per_class = None
  if run.task.name == "classify":
    report = run.task.report(sums)
    result["val_accuracy"] = report["accuracy"]
    result["val_macro_f1"] = report["macro_f1"]
    per_class = report["per_class"]
  else:
    result["val_perplexity"] = math.exp(min(out[f"{first}_loss"], 50.0))
  return result, per_class


# What ``tjax eval`` may set: where the data is, how much of it to read and in what windows, and
# the mesh.
_EVAL_KEYS = ("data.path", "train.eval_batches", "train.batch_size", "train.seq_len", "mesh.data",
              "mesh.fsdp", "mesh.tensor", "mesh.sequence")


def evaluate_run(run_dir: str, overrides: list[str] = (), *,
                 best: bool = False) -> dict[str, float]:
  """``tjax eval RUN_DIR [key=value ...]``: evaluates the latest (or best) intact checkpoint on the
  validation split of the run's dataset. A directory made by ``tjax convert`` has no experiment
  yet: give it data with ``data.path=DIR`` (the task follows the model's family).

  Returns:
    ``{"step": ..., **metrics}`` with :func:`evaluate`'s metrics.

  Raises:
    ValueError: not a run directory, an override other than data, batch and mesh settings, a
      missing or changed dataset, a vocabulary that differs from the model's, or no intact
      checkpoint.
  """
  rd = runs.RunDir(run_dir)
  model_config = rd.require_model()
  for key, _ in parse_overrides(list(overrides)):
    if key not in _EVAL_KEYS:
      raise ValueError(f"{key}: tjax eval takes only {', '.join(_EVAL_KEYS)} (the model and the "
                       "rest of the run are its own)")
  raw = rd.read_config()
  if raw is None:
    family = tasks_lib.family_task(model_config)
    raw = {"model": runs.model_spec(model_config), "data": {"task": family}}
  raw = {**raw, "run_dir": rd.path}
  ref = rd.read_dataset_ref()
  if ref is not None and isinstance(raw.get("data") or {}, dict):
    # the dataset the run trained on, wherever the command runs from
    raw["data"] = {**(raw.get("data") or {}), "path": ref["path"]}
  exp = load_experiment(None, list(overrides), raw=raw, source=rd.file(runs.CONFIG)).absolute()
  run = Run.build(exp, model_config, prepare=False)
  if (ref is not None and "hash" in ref
      and os.path.abspath(run.dataset.path) == os.path.abspath(ref["path"])):
    now = runs.dataset_fingerprint(ref["path"])
    if now != ref["hash"]:
      raise ValueError(f"the dataset {ref['path']} changed since the run trained on it (content "
                       f"hash {ref['hash'][:12]} -> {now[:12]})")
  from transformer_jax.train import finetune
  if finetune.lora_run_config(rd.path) is not None:  # adapters merged: the base architecture
    _, params = finetune.load_lora_merged(rd.path, best=best)
    step = rd.checkpoint_steps(best)[-1]
    run.graphdef = models.graphdef(model_config, run.mesh, run.backend)
  else:
    params, step = runs.restore_params(rd.checkpoint_dir, model_config, best=best)
  params = jax.device_put(params, parallel.param_shardings(params, run.mesh))
  metrics, _ = evaluate(run, params, step_lib.jit_eval_step(
      step_lib.make_eval_step(run.graphdef, run.task), run.mesh, params, backend=run.backend))
  return {"step": step, **metrics}
