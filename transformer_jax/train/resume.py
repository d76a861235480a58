"""Where a run starts: the run already in the directory (checked against the experiment), the
newest intact checkpoint restored, or a fresh state (initialised, ``model.init_from`` loaded, or
a LoRA run's adapters).

Resuming follows MaxText and the HF Trainer: a larger ``train.steps`` continues a run; a setting
that would change its model or data is refused by name; optimisation, logging and mesh settings
may change. A changed ``train.steps`` re-plans a decaying schedule over the new length, which a
notice says with the learning rate before and after at the resume point.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from transformer_jax import models, runs
from transformer_jax.train import finetune, lora_run
from transformer_jax.train import step as step_lib
from transformer_jax.train.config import Experiment, TrainConfig, fixed_changes, load_experiment
from transformer_jax.train.console import log0
from transformer_jax.train.optim import learning_rate_schedule
from transformer_jax.train.plan import Run

# Schedules whose learning rate at a step depends on ``train.steps``.
_DECAYING = ("cosine", "linear")


def stored_experiment(raw: dict, rd: runs.RunDir) -> Experiment:
  """A stored ``config.yaml`` (of ``rd``) as a full, absolute experiment.

  Raises:
    ValueError: the stored experiment does not validate (naming the file and the key).
  """
  return load_experiment(None, raw=raw, source=rd.file(runs.CONFIG)).absolute()


def model_changes(stored: models.ModelConfig, exp: Experiment) -> list[tuple[str, Any, Any]]:
  """``(model.FIELD, stored, new)`` for each field where the experiment's model differs from the
  run's ``model.yaml``, both resolved: a field spelled out at its default is no change. The
  dataset's vocabulary and label count are the stored model's (they came from the dataset)."""
  from_dataset = {"vocab_size": stored.vocab_size}
  if hasattr(stored, "num_labels"):   # families without a classification head have none
    from_dataset["num_labels"] = stored.num_labels
  new = exp.model_config(**from_dataset)
  if type(new) is not type(stored):
    return [("model", type(stored).__name__, type(new).__name__)]
  return [(f"model.{f.name}", getattr(stored, f.name), getattr(new, f.name))
          for f in dataclasses.fields(stored) if getattr(stored, f.name) != getattr(new, f.name)]


def resumed_model(exp: Experiment, rd: runs.RunDir, stored: dict | None, force_new: bool):
  """Checks ``exp`` against the run already in ``rd`` (``stored``: its ``config.yaml``).

  Returns:
    ``(model_config, resuming)``: the model config to use (None: the experiment's) and whether
    there is a run to resume.

  Raises:
    ValueError: checkpoints without a model config, a change of model or data (each key named),
      or ``train.steps`` below the last checkpoint.
  """
  steps = rd.checkpoint_steps()
  if force_new or not steps:
    return None, False      # nothing to lose: a failed start's snapshot files are replaced
  stored_model = rd.read_model()
  if stored_model is None:
    raise ValueError(f"run_dir {rd.path} has checkpoints but no {runs.MODEL}; use --force-new "
                     "to start over, or another run_dir")
  if stored is None:        # a converted model: its own model.yaml decides the model
    log0(f"fine-tuning the model in {rd.path} ({runs.MODEL}; the experiment's model section is "
         "not used)")
    return stored_model, True
  changes = [c for c in fixed_changes(stored_experiment(stored, rd).to_dict(), exp.to_dict())
             if c[0] != "model" and not c[0].startswith("model.")]
  changes = model_changes(stored_model, exp) + changes
  if changes:
    listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
    raise ValueError(f"run_dir {rd.path} holds a run with another model or data ({listed}); "
                     "resume it without these changes, or start over with --force-new or another "
                     "run_dir")
  if steps[-1] > exp.train.steps:
    raise ValueError(f"train.steps={exp.train.steps} is below the run's last checkpoint (step "
                     f"{steps[-1]}); give train.steps >= {steps[-1]}")
  # The run's own model.yaml (a fine-tuned converted model has no preset to rebuild it from); a
  # model.yaml that does not fit the checkpoints fails the restore's shape check.
  return stored_model, True


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
  return (f"notice: train.steps changed from {before.steps} to {after.steps}: the {after.schedule} "
          f"schedule is re-planned over {after.steps} steps, so at the resume point (step {step}) "
          f"the learning rate goes from {old:.3e} to {new:.3e}")


def start_state(run: Run, rd: runs.RunDir, ckpt: runs.Checkpoints, loader,
                before: TrainConfig | None) -> tuple[step_lib.TrainState, int]:
  """The placed train state the run starts from, and its step; sets ``loader``'s position.

  Restores the newest intact checkpoint into shapes carrying this run's shardings (orbax places
  each array straight onto its shards: the checkpoint may come from another mesh or device count);
  damaged newer steps are set aside as ``damaged-<step>``. Without a checkpoint: a fresh state
  (``model.init_from`` loaded), or a LoRA run's adapters over its rebuilt base.

  Args:
    run: The run.
    rd: Its directory (``init_from.json`` is written there).
    ckpt: Its checkpoints.
    loader: The training loader.
    before: The train settings of the run being resumed (None: not known), for
      :func:`schedule_notice`.
  """
  t = run.exp.train
  frozen = fresh = None
  if t.lora is not None:  # the frozen base is rebuilt (deterministically); adapters restored
    fresh, frozen = lora_run.start(run, rd)
    target = lora_run.abstract_state(run)
  else:
    target = step_lib.abstract_state(run.model_config, run.optimizer, run.mesh)
  start, params, opt_state, meta, damaged = ckpt.restore_newest_good(target.params,
                                                                     target.opt_state)
  if start is None:
    loader.set_state({"step": 0})
    return _fresh_state(run, rd, fresh, frozen), 0
  if damaged:
    ckpt.set_aside([s for s, _ in damaged])
    runs.warn(f"resuming from step {start}, the newest intact checkpoint; the damaged steps "
              f"are kept as damaged-<step> in {ckpt.directory}")
  if opt_state is None:     # a converted model: parameters only
    log0(f"fine-tuning the parameters of step {start} with a fresh optimizer state")
    opt_state = run.optimizer.init(params)
  state = step_lib.place_state(
      step_lib.TrainState(step=np.int32(start), params=params, opt_state=opt_state,
                          frozen=frozen), run.mesh)
  if meta.get("loader"):
    loader.set_state(meta["loader"])
  log0(f"resuming from {ckpt.directory} at step {start}")
  notice = None if before is None else schedule_notice(before, t, start)
  if notice:
    log0(notice)
  return state, start


def _fresh_state(run: Run, rd: runs.RunDir, lora_params, frozen) -> step_lib.TrainState:
  """Step 0: a LoRA run's ``(lora_params, frozen)``, else parameters from ``train.seed`` with
  ``model.init_from``'s tensors loaded (then a fresh optimizer state)."""
  if lora_params is not None:
    return step_lib.place_state(step_lib.TrainState(
        step=np.int32(0), params=lora_params, opt_state=run.optimizer.init(lora_params),
        frozen=frozen), run.mesh)
  state = step_lib.init_state(run.model_config, run.optimizer, run.mesh,
                              jax.random.key(run.exp.train.seed))
  init_from = run.exp.model.get("init_from")
  if not init_from:
    return state
  params, report = finetune.load_pretrained(jax.device_get(state.params), init_from)
  finetune.record_loaded(rd.path, init_from, report)
  return step_lib.place_state(step_lib.TrainState(
      step=state.step, params=params, opt_state=run.optimizer.init(params)), run.mesh)
