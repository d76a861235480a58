"""Validation: the loss and accuracies of parameters on a plan's validation batches, and
``tjax eval`` on a run directory's checkpoint (through the same plan as training)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from transformer_jax import parallel
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.plan import Plan, eval_experiment, make_plan


def evaluate(plan: Plan, params, eval_step) -> tuple[dict[str, float], dict[str, Any] | None]:
  """Evaluates ``params`` on the validation batches of ``plan``.

  Args:
    plan: The plan (dataset, task, mesh).
    params: Every parameter of the model ``plan.graphdef`` describes.
    eval_step: ``step_lib.jit_eval_step`` of the plan's eval step.

  Returns:
    ``(metrics, per_class)``: ``val_loss``, ``val_<term>_loss`` and ``val_<term>_accuracy`` per
    loss term, then what the task adds (``tasks.*.eval_summary``: ``val_perplexity``, or
    ``val_accuracy`` and ``val_macro_f1`` for classify); ``per_class`` is the classify task's
    per-label report, else None.

  Raises:
    ValueError: the validation split gives no batch of ``train.batch_size``.
  """
  task = plan.task
  sums, counts = None, None
  for batch in plan.eval_batches():
    tasks_lib.check_token_ids(task, batch, plan.model_config.vocab_size)
    s, c = eval_step(params, step_lib.shard_batch(batch, plan.mesh, task.keys))
    sums = s if sums is None else jax.tree.map(np.add, sums, s)
    counts = c if counts is None else jax.tree.map(np.add, counts, c)
  if sums is None:
    raise ValueError(
      f"the validation split of {plan.dataset.path} gives no batch of "
      f"{plan.exp.train.batch_size}; lower train.batch_size"
    )
  summary = tasks_lib.summarize(task, sums, counts)
  out = {k: float(v) for k, v in summary.items() if np.ndim(v) == 0}  # not per-expert counts
  result = {"val_loss": out.pop("loss")}
  for term in task.loss_terms:
    result[f"val_{term}_loss"] = out[f"{term}_loss"]
    result[f"val_{term}_accuracy"] = out[f"{term}_accuracy"]
  extra, per_class = task.eval_summary(sums, out)
  return {**result, **extra}, per_class


def evaluate_run(
  run_dir: str, overrides: list[str] = (), *, best: bool = False
) -> dict[str, float]:
  """``tjax eval RUN_DIR [key=value ...]``: evaluates the latest (or best) intact checkpoint on the
  validation split of the run's dataset (``plan.eval_experiment``: a directory made by ``tjax
  convert`` is given data with ``data.path=DIR``). A LoRA run is evaluated with its adapters
  merged into the base.

  Returns:
    ``{"step": ..., **metrics}`` with :func:`evaluate`'s metrics.

  Raises:
    ValueError: not a run directory, an override other than data, batch and mesh settings, a
      missing or changed dataset, a vocabulary that differs from the model's, or no intact
      checkpoint.
  """
  plan = make_plan(eval_experiment(run_dir, overrides), purpose="eval")
  params, step = plan.method.restore_base(plan.run_dir, best)
  params = jax.device_put(params, parallel.param_shardings(params, plan.mesh))
  metrics, _ = evaluate(
    plan,
    params,
    step_lib.jit_eval_step(
      step_lib.make_eval_step(plan.graphdef, plan.task), plan.mesh, params, backend=plan.backend
    ),
  )
  return {"step": step, **metrics}
