"""The checks :func:`transformer_jax.train.plan.make_plan` makes of an experiment's parts against
each other, the machine and the data (the table in :mod:`transformer_jax.train.plan`): the model
against a resumed run's (``model_changes``), the window against the model's positions, the
training state against the host memory, and the dataset, loaded (or prepared on first use) for the
task, its content the one a run trained on. Only the plan calls them; a refusal is one
``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from transformer_jax import data as data_lib
from transformer_jax import hardware, models
from transformer_jax.backends.table import OPTION_FIELDS
from transformer_jax.train.config import Experiment
from transformer_jax.train.console import log0


def model_changes(stored: models.ModelConfig, exp: Experiment) -> list[tuple[str, Any, Any]]:
  """``(model.FIELD, stored, new)`` for each field where the experiment's model differs from the
  run's ``model.yaml``, both resolved: a field spelled out at its default is no change. The
  dataset's vocabulary and label count are the stored model's (they came from the dataset)."""
  from_dataset = {"vocab_size": stored.vocab_size}
  if hasattr(stored, "num_labels"):  # families without a classification head have none
    from_dataset["num_labels"] = stored.num_labels
  new = exp.model_config(**from_dataset)
  if type(new) is not type(stored):
    return [("model", type(stored).__name__, type(new).__name__)]
  return [
    (f"model.{f.name}", getattr(stored, f.name), getattr(new, f.name))
    for f in dataclasses.fields(stored)
    if getattr(stored, f.name) != getattr(new, f.name)
  ]


def ensure_dataset(exp: Experiment, *, prepare: bool = True) -> data_lib.Dataset:
  """Loads ``data.path`` (default ``RUN_DIR/data``), preparing it from ``data.inputs`` first when
  it holds no dataset yet and ``prepare`` is set.

  Raises:
    ValueError: no dataset and nothing to prepare it from (or ``prepare`` off), a damaged
      dataset, or one prepared for another task.
  """
  d = exp.data
  path = d.dataset_path or os.path.join(exp.run_dir, "data")
  meta = os.path.join(path, "metadata.json")
  if not os.path.exists(meta):
    if not prepare:
      raise ValueError(f"data.path={path!r} holds no prepared dataset; give one with data.path=DIR")
    if not d.inputs:
      raise ValueError(f"data.path={path!r} holds no prepared dataset and data.inputs is empty")
    if jax.process_index() == 0:
      print(f"preparing {', '.join(d.inputs)} -> {path}", flush=True)
      data_lib.prepare(
        list(d.inputs),
        path,
        tokenizer=d.tokenizer,
        compact_vocab=d.compact_vocab,
        task=d.task,
        val_fraction=d.val_fraction,
        seed=exp.train.seed,
        vocab_from=d.vocab_from,
      )
  if jax.process_count() > 1:  # the others wait for process 0's preparation
    from jax.experimental import multihost_utils  # noqa: PLC0415 - multi-process only

    multihost_utils.sync_global_devices("tjax dataset")
  dataset = data_lib.load_dataset(path)
  shared_format = {dataset.task, d.task} <= {"gpt", "bert"}  # both read plain text documents
  if dataset.task != d.task and not shared_format:
    raise ValueError(f"dataset {path} was prepared for task {dataset.task!r}, not {d.task!r}")
  return dataset


def check_dataset_unchanged(
  ref: dict, old: dict | None, *, resuming: bool, accept: bool = False
) -> None:
  """Refuses a dataset whose content changed since the run trained on it.

  Args:
    ref: the dataset's reference now (``runs.dataset_ref``).
    old: the one the run recorded (its ``dataset.json``), or None.
    resuming: a resumed run (its data path cannot change: any other hash is a change) rather than
      an evaluation (whose ``data.path`` may name another dataset: only the recorded one is
      compared, where its hash is known).
    accept: a resumed run continues on the changed dataset (``--accept-data-change``): a notice
      names both hashes instead.

  Raises:
    ValueError: naming the dataset and both content hashes.
  """
  if old is None:
    return
  if resuming:
    if old.get("hash") != ref["hash"]:
      what = (
        f"the dataset {ref['path']} changed since this run started (content hash "
        f"{old.get('hash', '?')[:12]} -> {ref['hash'][:12]})"
      )
      if accept:
        log0(f"notice: {what}; --accept-data-change: continuing on it at the same data position")
        return
      raise ValueError(
        f"{what}; use the same data, pass --accept-data-change to continue on it, or "
        "--force-new / another run_dir"
      )
    return
  if "hash" in old and os.path.abspath(old["path"]) == ref["path"] and old["hash"] != ref["hash"]:
    raise ValueError(
      f"the dataset {old['path']} changed since the run trained on it (content "
      f"hash {old['hash'][:12]} -> {ref['hash'][:12]})"
    )


def check_window(exp: Experiment, model_config: models.ModelConfig, task) -> None:
  """Refuses windows longer than the model's positions (they would fail in the first step, after
  the run directory is written).

  Raises:
    ValueError: naming ``train.seq_len`` and ``max_len``.
  """
  max_len = getattr(model_config, "max_len", None)
  if task.uses_seq_len and max_len is not None and exp.train.seq_len > max_len:
    raise ValueError(
      f"train.seq_len={exp.train.seq_len} is longer than the model's max_len="
      f"{max_len} positions; give a shorter train.seq_len or a larger "
      "model.max_len"
    )


def check_memory(exp: Experiment, model_config: models.ModelConfig) -> None:
  """Refuses, when the model computes on CPU, a run whose parameters, gradients and AdamW moments
  (16 bytes a parameter) pass the host memory left: it would be killed by the kernel's
  out-of-memory killer, which may take other processes with it. (Not for a dry run, which plans a
  pod's run on a laptop and allocates nothing.)

  Raises:
    ValueError: naming the bytes needed and available.
  """
  if jax.devices()[0].platform != "cpu":
    return
  t = exp.train
  state = models.train_memory_bytes(model_config, t.batch_size, t.seq_len)
  need = state["params"] + state["grads"] + state["optimizer"]
  free = hardware.host_memory_available()
  if free is not None and need > free:
    raise ValueError(
      f"the model's {models.count_params(model_config):,} parameters need "
      f"{need / 2**30:.1f} GiB for parameters, gradients and AdamW moments, more "
      f"than the {free / 2**30:.1f} GiB of memory this machine has free"
    )


def check_compile_options(exp: Experiment) -> None:
  """Refuses the XLA options of ``kernels.step_options`` and ``kernels.decode_options`` that this
  jaxlib's compiler does not take (an unknown name, a value of the wrong kind), before the steps
  compile: each is tried on a one-element program, compiled for this process's default devices.

  Raises:
    ValueError: listing every refused option with XLA's reason.
  """
  options = [(f, n, v) for f in OPTION_FIELDS for n, v in getattr(exp.kernels, f)]
  if not options:
    return
  lowered = jax.jit(lambda: jnp.zeros(())).lower()
  refused = []
  for field, name, value in options:
    try:
      lowered.compile(compiler_options={name: value})
    except jax.errors.JaxRuntimeError as e:
      reason = str(e).split(": ", 1)[-1]  # "INVALID_ARGUMENT: No such compile option: 'x'"
      refused.append(f"kernels.{field}.{name}={value!r} ({reason})")
  if refused:
    raise ValueError(
      f"XLA's compiler on {jax.devices()[0].platform} does not take "
      f"{'; '.join(refused)}; see XLA's DebugOptions for the names it knows"
    )
