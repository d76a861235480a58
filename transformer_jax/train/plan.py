"""What a run is built from, checked before anything is written: the dataset (prepared on first
use), the model's task, the mesh, the optimizer, and the compiled train step.

A real run and ``tjax train --dry-run`` build on the same functions (:func:`plan`,
:func:`make_step`, :func:`compiled_step`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from flax import nnx

from transformer_jax import data as data_lib
from transformer_jax import lora as lora_lib
from transformer_jax import backends, hardware, models, parallel, runs
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.config import Experiment
from transformer_jax.train.optim import make_optimizer


def ensure_dataset(exp: Experiment, *, prepare: bool = True) -> data_lib.Dataset:
  """Loads ``data.path`` (default ``RUN_DIR/data``), preparing it from ``data.inputs`` first when
  it holds no dataset yet and ``prepare`` is set.

  Raises:
    ValueError: no dataset and nothing to prepare it from (or ``prepare`` off), a damaged
      dataset, or one prepared for another task.
  """
  d = exp.data
  path = d.path or os.path.join(exp.run_dir, "data")
  meta = os.path.join(path, "metadata.json")
  if not os.path.exists(meta):
    if not prepare:
      raise ValueError(f"data.path={path!r} holds no prepared dataset; give one with "
                       "data.path=DIR")
    if not d.inputs:
      raise ValueError(f"data.path={path!r} holds no prepared dataset and data.inputs is empty")
    if jax.process_index() == 0:
      print(f"preparing {', '.join(d.inputs)} -> {path}", flush=True)
      data_lib.prepare(list(d.inputs), path, tokenizer=d.tokenizer, compact_vocab=d.compact_vocab,
                       task=d.task, val_fraction=d.val_fraction, seed=exp.train.seed,
                       vocab_from=d.vocab_from)
  if jax.process_count() > 1:  # the others wait for process 0's preparation
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("tjax dataset")
  dataset = data_lib.load_dataset(path)
  shared_format = {dataset.task, d.task} <= {"gpt", "bert"}  # both read plain text documents
  if dataset.task != d.task and not shared_format:
    raise ValueError(f"dataset {path} was prepared for task {dataset.task!r}, not {d.task!r}")
  return dataset


def preflight(exp: Experiment) -> None:
  """What can be checked before the run directory is touched (the lock creates it): the
  directory can hold this run, the model config builds (with the preset's vocabulary; the
  dataset's is checked against it once the dataset is loaded), its windows fit its positions and
  its training state the host memory.

  Raises:
    ValueError: a path that cannot hold a run, a folder holding files that are not a run's, or a
      model config that does not validate.
  """
  rd = runs.RunDir(exp.run_dir)
  rd.check_usable()
  rd.check_owned()
  config, _ = model_config_before_data(exp)  # the task is checked once the dataset is loaded
  check_window(exp, config, tasks_lib.TASKS[exp.data.task])
  check_memory(exp, config)


def model_config_before_data(exp: Experiment) -> tuple[models.ModelConfig, str]:
  """The experiment's model before its dataset is loaded, and where its vocabulary came from:
  with the vocabulary of the prepared dataset when ``data.path`` holds one, else the preset's.

  Raises:
    ValueError: a model config that does not validate, or a damaged ``metadata.json``.
  """
  path = exp.data.path
  if path is not None and os.path.exists(os.path.join(path, data_lib.METADATA_FILE)):
    vocab = data_lib.read_metadata(path)["vocab_size"]
    return exp.model_config(vocab_size=vocab), f"vocabulary {vocab} from {path}"
  config = exp.model_config()
  return config, f"vocabulary {config.vocab_size} from the model config (no prepared dataset)"


def make_train_loader(exp: Experiment, dataset, task=None):
  """The task's deterministic training loader over ``dataset`` (``batch_at(step)``).

  Raises:
    ValueError: the training split holds fewer distinct examples than one global batch (every
      batch would repeat some: the run would train on duplicates without a word).
  """
  loader = (task or tasks_lib.TASKS[exp.data.task]).loader(dataset, exp)
  count, unit = loader.examples_per_epoch
  if count < exp.train.batch_size:
    raise ValueError(f"the train split of {dataset.path} holds {count} {unit}, fewer than "
                     f"train.batch_size={exp.train.batch_size}: every batch would repeat some; "
                     f"prepare more data or give train.batch_size <= {count}")
  return loader


def eval_batches(exp: Experiment, dataset, task=None):
  """The task's validation batches of ``dataset`` (``train.eval_batches`` of them, or fewer)."""
  return (task or tasks_lib.TASKS[exp.data.task]).eval_batches(dataset, exp)


def check_window(exp: Experiment, model_config: models.ModelConfig, task) -> None:
  """Refuses windows longer than the model's positions (they would fail in the first step, after
  the run directory is written).

  Raises:
    ValueError: naming ``train.seq_len`` and ``max_len``.
  """
  max_len = getattr(model_config, "max_len", None)
  if task.uses_seq_len and max_len is not None and exp.train.seq_len > max_len:
    raise ValueError(f"train.seq_len={exp.train.seq_len} is longer than the model's max_len="
                     f"{max_len} positions; give a shorter train.seq_len or a larger "
                     "model.max_len")


def check_memory(exp: Experiment, model_config: models.ModelConfig) -> None:
  """Refuses, when the model computes on CPU, a run whose parameters, gradients and AdamW moments
  (16 bytes a parameter) pass the host memory left: it would be killed by the kernel's
  out-of-memory killer, which may take other processes with it. (Not for ``--dry-run``, which
  plans a pod's run on a laptop and allocates nothing.)

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
    raise ValueError(f"the model's {models.count_params(model_config):,} parameters need "
                     f"{need / 2**30:.1f} GiB for parameters, gradients and AdamW moments, more "
                     f"than the {free / 2**30:.1f} GiB of memory this machine has free")


def plan(exp: Experiment, model_config: models.ModelConfig):
  """``(task, mesh, optimizer)`` of ``exp`` for ``model_config``, checked against each other."""
  task = tasks_lib.for_experiment(exp, model_config)
  check_window(exp, model_config, task)
  m = exp.mesh
  mesh = parallel.make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor,
                             "sequence": m.sequence})
  parallel.check_config(model_config, mesh, batch_size=exp.train.batch_size,
                        seq_len=exp.train.seq_len if task.uses_seq_len else None,
                        microbatches=fixed_microbatches(exp.train))
  return task, mesh, make_optimizer(exp.train)


def fixed_microbatches(t) -> int:
  """``train.microbatches`` as given, 1 for "auto" (``compiled_step`` picks the count)."""
  return 1 if t.microbatches == "auto" else t.microbatches


def make_step(exp: Experiment, graphdef, task, optimizer, microbatches: int | None = None):
  """The (unjitted) train step of ``exp`` (``microbatches`` overrides ``train.microbatches``)."""
  t = exp.train
  return step_lib.make_train_step(
      graphdef, task, optimizer, seed=t.seed,
      microbatches=fixed_microbatches(t) if microbatches is None else microbatches,
      label_smoothing=t.label_smoothing, z_loss=t.z_loss)


def compiled_step(exp: Experiment, graphdef, task, optimizer, mesh, state, batch,
                  backend: backends.Backend | None = None):
  """The jitted train step of ``exp`` and its microbatch count, compiled for ``(state, batch)``
  (arrays or shapes) with ``backend``'s options (default: the mesh platform's, with the
  experiment's kernel table): ``(step, compiled, microbatches)``.

  The count is ``step_lib.pick_microbatches``' (``train.microbatches: auto`` on CPU over mimalloc:
  ``backends.cpu.microbatches.auto_microbatches``).
  """
  backend = backend or backends.for_platform(mesh.devices.flat[0].platform, exp.kernels)
  built = {}

  def compile_for(m):
    step = step_lib.jit_train_step(make_step(exp, graphdef, task, optimizer, m), mesh, state,
                                   backend=backend)
    built[m] = step, step.lower(state, batch).compile()
    return built[m][1]

  m, _ = step_lib.pick_microbatches(exp.train.microbatches, compile_for, exp.train.batch_size,
                                    mesh.shape["data"] * mesh.shape["fsdp"], backend=backend)
  return (*built[m], m)


@dataclasses.dataclass
class Run:
  """Everything a run needs, built once from the experiment."""

  exp: Experiment
  dataset: Any
  model_config: models.ModelConfig
  task: Any
  mesh: Any
  graphdef: Any
  optimizer: Any
  # The kernels the model and its steps are built with (the experiment's ``kernels:`` table).
  backend: Any = None

  @classmethod
  def build(cls, exp: Experiment, model_config: models.ModelConfig | None = None, *,
            prepare: bool = True) -> "Run":
    """Loads (or prepares) the dataset and checks the model against it.

    Args:
      exp: The experiment.
      model_config: The model (default: the experiment's, with the dataset's vocabulary).
      prepare: Prepare a missing dataset from ``data.inputs`` (else refuse).
    """
    dataset = ensure_dataset(exp, prepare=prepare)
    if model_config is None:
      defaults = {"vocab_size": dataset.vocab_size}
      if dataset.task == "classify":
        defaults["num_labels"] = len(dataset.meta["labels"])
      model_config = exp.model_config(**defaults)
    runs.check_vocab(dataset.vocab_size, model_config, dataset.path)
    task, mesh, optimizer = plan(exp, model_config)
    backend = backends.for_platform(mesh.devices.flat[0].platform, exp.kernels)
    if exp.train.lora is not None:  # the adapted model's graph (its adapters are parameters too)
      graphdef = nnx.split(lora_lib.abstract(model_config, exp.train.lora, mesh, backend))[0]
    else:
      graphdef = models.graphdef(model_config, mesh, backend)
    return cls(exp, dataset, model_config, task, mesh, graphdef, optimizer, backend)
