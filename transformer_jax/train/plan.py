"""The plan of a run: everything a training run, its dry run, its export and ``tjax eval`` are
built from, checked and resolved by one function, :func:`make_plan`, before anything is written.

``make_plan`` reads what the run directory holds (once), builds the model, the task, the mesh, the
optimizer and the method (full or LoRA), loads (or prepares) the dataset, and compiles the train
step with ``train.microbatches`` resolved; the plan it returns is frozen, and ``config.yaml``
records its experiment (the resolved microbatch count included). The checks across the
experiment's parts are all made here, by ``make_plan`` and the helpers of
:mod:`transformer_jax.train.checks` it calls (the experiment's own fields are checked when it is
parsed, :mod:`transformer_jax.train.config`); which purpose makes which:

=========================================================  =====  =======  ======  ====
check                                                      train  dry_run  export  eval
=========================================================  =====  =======  ======  ====
the run directory can hold this run and holds only a run's   x
a resumed run's model and data unchanged (data: unless       x       x        x
accepted), its batch size changed by an integer ratio only
``train.steps`` not below the run's last checkpoint          x
the task fits the model; its learning bars                   x       x        x      x
the window fits the model's positions                        x       x        x      x
the kernel table's XLA options are ones the compiler takes   x       x               x
the training state fits the host memory (on CPU)             x
the model and the batch fit the mesh                         x       x        x      x
the dataset: prepared for the task, its vocabulary the       x                       x
model's, its content the one a resumed run trained on
the training split holds one batch                           x
=========================================================  =====  =======  ======  ====

The only thing a plan may write is the dataset it prepares on first use (``data.path``, from
``data.inputs``), once every check that does not need the data has passed.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Literal

import jax

from transformer_jax import data as data_lib
from transformer_jax import backends, models, parallel, runs
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.checks import (
  check_compile_options,
  check_dataset_unchanged,
  check_memory,
  check_window,
  ensure_dataset,
  model_changes,
)
from transformer_jax.train.config import Experiment, fixed_changes, load_experiment, parse_overrides
from transformer_jax.train.console import log0
from transformer_jax.train.method import Method, method_of, stored_method
from transformer_jax.train.optim import make_optimizer

Purpose = Literal["train", "dry_run", "export", "eval"]
PURPOSES = ("train", "dry_run", "export", "eval")

# What ``tjax eval`` may set: where the data is, how much of it to read and in what windows, and
# the mesh.
EVAL_KEYS = (
  "data.path",
  "train.eval_batches",
  "train.batch_size",
  "train.seq_len",
  "mesh.data",
  "mesh.fsdp",
  "mesh.tensor",
  "mesh.sequence",
  "mesh.expert",
)
# What ``accept_data_change`` lets a resumed run change besides the dataset's content: where it
# is and what it is prepared from.
DATA_CHANGES = ("data.path", "data.inputs")


@dataclasses.dataclass(frozen=True)
class Resume:
  """What a run directory holds of an earlier run, read once (empty: a fresh start).

  Read only where there are checkpoints to resume (and not with ``force_new``): the files a start
  that failed before its first checkpoint left are replaced, never read.
  """

  steps: tuple[int, ...] = ()  # committed checkpoint steps, ascending
  stored: Experiment | None = None  # config.yaml, parsed (None: a converted model)
  model: models.ModelConfig | None = None  # model.yaml
  dataset_ref: dict | None = None  # dataset.json
  final: dict | None = None  # final.json

  @property
  def last(self) -> int | None:
    return self.steps[-1] if self.steps else None


@dataclasses.dataclass(frozen=True)
class Plan:
  """Everything a run is built from, checked against each other (see the module's table).

  Attributes:
    purpose: what it was made for (``train``, ``dry_run``, ``export``, ``eval``).
    exp: the experiment, absolute; ``train.microbatches`` resolved where a step was compiled.
    run_dir: its run directory.
    resume: what the directory holds of an earlier run.
    force_new: the run starts over (the directory's earlier run is removed when it starts).
    accept_data_change: a resumed run may continue on another dataset (``--accept-data-change``).
    finished: the run in the directory is done (``train`` only: nothing else is built).
    model_config: the model (a resumed run's own ``model.yaml``).
    vocab_note: where the model's vocabulary came from.
    dataset: the loaded dataset (None for ``dry_run`` and ``export``).
    dataset_ref: what ``dataset.json`` records of it (content hash included).
    task, mesh, optimizer, method: the task, mesh, optimizer and method (full or LoRA).
    backend: the kernels the model and its steps are built with: the mesh platform's backend
      with the experiment's ``kernels:`` table.
    graphdef: the graph of the model the step trains (``eval``: the base architecture's).
    loader: the training loader (``train``).
    step: the jitted train step, compiled for the first batch (``train``, ``dry_run``).
    compiled: its executable (memory analysis).
    compile_seconds: how long choosing the microbatches and compiling took.
  """

  purpose: str
  exp: Experiment
  run_dir: runs.RunDir
  resume: Resume
  force_new: bool = False
  accept_data_change: bool = False
  finished: bool = False
  model_config: models.ModelConfig | None = None
  vocab_note: str = ""
  dataset: Any = None
  dataset_ref: dict | None = None
  task: Any = None
  mesh: Any = None
  optimizer: Any = None
  method: Method | None = None
  backend: backends.Backend | None = None
  graphdef: Any = None
  loader: Any = None
  step: Any = None
  compiled: Any = None
  compile_seconds: float | None = None

  def train_step(self, microbatches: int | None = None):
    """The (unjitted) train step of the plan (``microbatches`` overrides the experiment's)."""
    t = self.exp.train
    return step_lib.make_train_step(
      self.graphdef,
      self.task,
      self.optimizer,
      seed=t.seed,
      microbatches=fixed_microbatches(t) if microbatches is None else microbatches,
      label_smoothing=t.label_smoothing,
      z_loss=t.z_loss,
    )

  def eval_batches(self):
    """The task's validation batches (``train.eval_batches`` of them, or fewer)."""
    return self.task.eval_batches(self.dataset, self.exp)


def make_plan(
  exp: Experiment,
  *,
  purpose: Purpose = "train",
  force_new: bool = False,
  mesh=None,
  accept_data_change: bool = False,
) -> Plan:
  """The plan of ``exp`` for ``purpose``, every check of the module's table made.

  Args:
    exp: The experiment (made absolute here).
    purpose: ``train`` (a real run: the dataset loaded or prepared, the step compiled for its
      first batch), ``dry_run`` (no data: the step compiled against batch shapes on the devices
      there are), ``export`` (no data, nothing compiled: the step is lowered by the caller) or
      ``eval`` (the experiment :func:`eval_experiment` read from a run directory; no step).
    force_new: Start over: the directory's earlier run is neither read nor checked against.
    mesh: The mesh to plan for (``export``: possibly a ``jax.sharding.AbstractMesh``); default
      the experiment's on this process's devices.
    accept_data_change: A resumed run continues on a dataset whose content (or ``data.path``,
      ``data.inputs``) differs from the one it trained on, at the same data position.

  Raises:
    ValueError: any check of the table, one line naming the file, field and value.
  """
  if purpose not in PURPOSES:
    raise ValueError(f"purpose={purpose!r}: expected one of {', '.join(PURPOSES)}")
  exp = exp.absolute()
  rd = runs.RunDir(exp.run_dir)
  if purpose == "train":
    rd.check_usable()  # before a pretraining run or a dataset preparation that may take hours
    rd.check_owned()
  resume = Resume() if purpose == "eval" else read_resume(rd, force_new)
  plan = Plan(purpose, exp, rd, resume, force_new, accept_data_change)
  if purpose != "eval":
    check_resume(plan)
  if purpose == "train" and _finished(exp, resume):
    return dataclasses.replace(plan, finished=True)

  # What can be checked before the data: a preparation may take hours.
  model_config, note = _model_before_data(exp, resume, rd, purpose)
  check_window(exp, model_config, tasks_lib.TASKS[exp.data.task])
  if purpose != "export":  # an export lowers for its own, maybe absent, devices
    check_compile_options(exp)
  if purpose == "train":
    check_memory(exp, model_config)
  dataset = ref = None
  if purpose in ("train", "eval"):
    dataset = ensure_dataset(exp, prepare=purpose == "train")
    if resume.model is None and purpose == "train":  # the dataset decides its vocabulary
      model_config = exp.model_config(**tasks_lib.TASKS[exp.data.task].model_defaults(dataset))
    runs.check_vocab(dataset.vocab_size, model_config, dataset.path)
    ref = runs.dataset_ref(dataset)
    if exp.data.mixture:  # every source's content, checked on resume
      ref["mixture"] = {m.name: runs.dataset_fingerprint(m.path) for m in exp.data.mixture}
    if purpose == "train":
      check_dataset_unchanged(ref, resume.dataset_ref, resuming=True, accept=accept_data_change)
      check_mixture_unchanged(ref, resume.dataset_ref, accept=accept_data_change)
    else:
      check_dataset_unchanged(ref, rd.read_dataset_ref(), resuming=False)
  task = tasks_lib.for_experiment(exp, model_config)
  mesh = (
    mesh
    if mesh is not None
    else parallel.make_mesh({a: getattr(exp.mesh, a) for a in parallel.AXES})
  )
  backend = backends.for_platform(_platform(mesh, purpose), exp.kernels)
  if purpose == "train":
    backend.bf16_notice(model_config.dtype)
  parallel.check_config(
    model_config,
    mesh,
    batch_size=exp.train.batch_size,
    seq_len=exp.train.seq_len if task.uses_seq_len else None,
    microbatches=fixed_microbatches(exp.train),
  )
  method = method_of(exp, model_config) if purpose != "eval" else stored_method(rd, model_config)
  # eval runs the base architecture (a LoRA run's adapters merged into it)
  graphdef = (
    models.graphdef(model_config, mesh, backend)
    if purpose == "eval"
    else method.graphdef(mesh, backend)
  )
  plan = dataclasses.replace(
    plan,
    model_config=model_config,
    vocab_note=note,
    dataset=dataset,
    dataset_ref=ref,
    task=task,
    mesh=mesh,
    optimizer=make_optimizer(exp.train),
    method=method,
    backend=backend,
    graphdef=graphdef,
  )
  if purpose == "train":
    plan = dataclasses.replace(plan, loader=make_train_loader(plan))
    stored = resume.stored.train.batch_size if resume.stored is not None else None
    offsets = getattr(plan.loader, "sequence_offsets", False)
    if stored not in (None, exp.train.batch_size) and not offsets:
      raise ValueError(
        f"train.batch_size: {stored} -> {exp.train.batch_size}: "
        f"{'a mixture' if exp.data.mixture else f'the {exp.data.task} task'}'s "
        "loader draws its batches per step, so it cannot continue at the first sequence not "
        f"consumed; resume with train.batch_size={stored}"
      )
  if purpose in ("train", "dry_run"):
    plan = _with_step(plan)
  return plan


def read_resume(rd: runs.RunDir, force_new: bool = False) -> Resume:
  """What ``rd`` holds of an earlier run (nothing without checkpoints, or with ``force_new``).

  Raises:
    ValueError: checkpoints without a model config, or a damaged snapshot file (named).
  """
  steps = () if force_new else tuple(rd.checkpoint_steps())
  if not steps:
    return Resume()
  model = rd.read_model()
  if model is None:
    raise ValueError(
      f"run_dir {rd.path} has checkpoints but no {runs.MODEL}; use --force-new "
      "to start over, or another run_dir"
    )
  raw = rd.read_config()
  stored = (
    None if raw is None else load_experiment(None, raw=raw, source=rd.file(runs.CONFIG)).absolute()
  )
  return Resume(steps, stored, model, rd.read_dataset_ref(), rd.read_final())


def check_resume(plan: Plan) -> None:
  """Refuses to resume (or to plan over) a run with another model or data (``data.path`` and
  ``data.inputs`` may change with ``accept_data_change``), a batch size that is not an integer
  multiple or divisor of the run's, or a ``train.steps`` below its last checkpoint (``train``
  only). A model converted into the directory (no ``config.yaml``) is fine-tuned as its own
  ``model.yaml`` says.

  Raises:
    ValueError: each changed key named with its old and new value.
  """
  resume, exp, rd = plan.resume, plan.exp, plan.run_dir
  accept_data_change = plan.accept_data_change
  if not resume.steps:
    return
  if resume.stored is None:
    if plan.purpose == "train":
      log0(
        f"fine-tuning the model in {rd.path} ({runs.MODEL}; the experiment's model section "
        "is not used)"
      )
    return
  changes = [
    c
    for c in fixed_changes(resume.stored.to_dict(), exp.to_dict())
    if c[0] != "model"
    and not c[0].startswith("model.")
    and c[0] != "train.batch_size"
    and not (accept_data_change and c[0] in DATA_CHANGES)
  ]
  check_batch_change(resume.stored.train.batch_size, exp.train.batch_size)
  changes = model_changes(resume.model, exp) + changes
  if changes:
    listed = ", ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
    advice = (
      "resume it without these changes, or start over with --force-new or another run_dir"
      if plan.purpose == "train"
      else "a run would refuse it: plan it with another run_dir"
    )
    raise ValueError(
      f"run_dir {rd.path} holds a run with another model or data ({listed}); {advice}"
    )
  if plan.purpose == "train" and resume.last > exp.train.steps:
    raise ValueError(
      f"train.steps={exp.train.steps} is below the run's last checkpoint (step "
      f"{resume.last}); give train.steps >= {resume.last}"
    )


def check_batch_change(before: int, after: int) -> None:
  """Refuses a resumed run's ``train.batch_size`` unless it is the run's times or divided by an
  integer (the data position is kept in sequences, the schedule in steps).

  Raises:
    ValueError: naming both sizes.
  """
  if before != after and max(before, after) % min(before, after):
    raise ValueError(
      f"train.batch_size: {before} -> {after} is not an integer change (resume with a multiple "
      f"or a divisor of {before})"
    )


def _finished(exp: Experiment, resume: Resume) -> bool:
  """The run in the directory reached ``train.steps`` and wrote its final report."""
  return (
    resume.last is not None
    and resume.last >= exp.train.steps
    and resume.final is not None
    and resume.final.get("step") == resume.last
  )


def _model_before_data(
  exp: Experiment, resume: Resume, rd: runs.RunDir, purpose: str
) -> tuple[models.ModelConfig, str]:
  """The model and where its vocabulary came from: a resumed (or evaluated) run's own
  ``model.yaml``; else the experiment's, with the vocabulary of the prepared dataset in
  ``data.path`` when there is one (a real run then takes the dataset's once it is loaded), else
  the preset's.

  Raises:
    ValueError: a model config that does not validate, a damaged ``metadata.json``, or (eval) a
      directory without a model.
  """
  stored = rd.require_model() if purpose == "eval" else resume.model
  if stored is not None:
    return stored, f"vocabulary {stored.vocab_size} from {rd.file(runs.MODEL)}"
  path = exp.data.dataset_path
  if path is not None and os.path.exists(os.path.join(path, data_lib.METADATA_FILE)):
    vocab = data_lib.read_metadata(path)["vocab_size"]
    return exp.model_config(vocab_size=vocab), f"vocabulary {vocab} from {path}"
  config = exp.model_config()
  return config, f"vocabulary {config.vocab_size} from the model config (no prepared dataset)"


def make_train_loader(plan: Plan):
  """The task's deterministic training loader over the plan's dataset (``batch_at(step)``).

  Raises:
    ValueError: the training split holds fewer distinct examples than one global batch (every
      batch would repeat some: the run would train on duplicates without a word).
  """
  exp, dataset = plan.exp, plan.dataset
  loader = plan.task.loader(dataset, exp)
  count, unit = loader.examples_per_epoch
  if exp.data.mixture:  # refused before the run starts: another vocabulary, data.max_epochs
    loader.check_vocabulary(dataset, f"data.path={dataset.path!r}")
    loader.check_steps(exp.train.steps)
  if count < exp.train.batch_size:
    raise ValueError(
      f"the train split of {dataset.path} holds {count} {unit}, fewer than "
      f"train.batch_size={exp.train.batch_size}: every batch would repeat some; "
      f"prepare more data or give train.batch_size <= {count}"
    )
  return loader


def check_mixture_unchanged(ref: dict, old: dict | None, *, accept: bool = False) -> None:
  """Refuses to resume a mixture run whose sources' contents changed (named, with both hashes);
  ``accept`` (``--accept-data-change``): a notice instead."""
  if old is None or "mixture" not in ref:
    return
  for name, fingerprint in ref["mixture"].items():
    before = (old.get("mixture") or {}).get(name)
    if before is not None and before != fingerprint:
      what = (
        f"mixture source {name!r} changed since this run started (content hash {before[:12]} "
        f"-> {fingerprint[:12]})"
      )
      if accept:
        log0(f"notice: {what}; --accept-data-change: continuing on it at the same data position")
        continue
      raise ValueError(
        f"{what}; use the same data, pass --accept-data-change to continue on it, or "
        "--force-new / another run_dir"
      )


def _platform(mesh, purpose: str) -> str:
  """The platform the plan's kernels are chosen for: the one ``mesh``'s devices are on; an export's
  is its target (what ``export.target`` makes JAX answer), whatever devices lower it."""
  if purpose == "export":
    return backends.platform()
  return mesh.devices.flat[0].platform


def fixed_microbatches(t) -> int:
  """``train.microbatches`` as given, 1 for "auto" (the plan compiles the step to choose)."""
  return 1 if t.microbatches == "auto" else t.microbatches


def _with_step(plan: Plan) -> Plan:
  """``plan`` with its train step compiled and ``train.microbatches`` resolved (the count
  ``step.pick_microbatches`` takes: "auto" on CPU over mimalloc is the fewest microbatches that
  keep the step's temporaries within what the allocator reuses, else 1).

  A real run compiles for the batch it starts at (placed on the mesh), so the loop's first call
  finds the step compiled; a dry run for the task's batch shapes, with nothing allocated.
  """
  exp, mesh = plan.exp, plan.mesh
  t = exp.train
  state = plan.method.abstract_state(plan.optimizer, mesh)
  if plan.loader is not None:
    start = min(plan.resume.last or 0, t.steps - 1)
    host = plan.loader.batch_at(start)
    tasks_lib.check_token_ids(plan.task, host, plan.model_config.vocab_size)
    batch = step_lib.shard_batch(host, mesh, plan.task.keys)
  else:
    sharding = parallel.batch_sharding(mesh)
    batch = {
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
      for k, v in plan.task.batch_shapes(t.batch_size, t.seq_len).items()
    }
  built = {}

  def compile_for(m):
    step = step_lib.jit_train_step(plan.train_step(m), mesh, state, backend=plan.backend)
    built[m] = step, step.lower(state, batch).compile()
    return built[m][1]

  began = time.perf_counter()
  m, _ = step_lib.pick_microbatches(
    t.microbatches,
    compile_for,
    t.batch_size,
    parallel.batch_shards(mesh.shape),
    backend=plan.backend,
  )
  seconds = time.perf_counter() - began
  if t.microbatches == "auto" and m > 1 and plan.purpose == "train":
    log0(
      f"train.microbatches=auto: {m} microbatches, which keep the step's temporaries within "
      "what the allocator reuses between steps"
    )
  resolved = dataclasses.replace(exp, train=dataclasses.replace(t, microbatches=m))
  step, compiled = built[m]
  return dataclasses.replace(
    plan, exp=resolved, step=step, compiled=compiled, compile_seconds=seconds
  )


def eval_experiment(run_dir: str, overrides: list[str] = ()) -> Experiment:
  """The experiment ``tjax eval RUN_DIR [key=value ...]`` evaluates: the run's own, on the
  dataset it trained on (wherever the command runs from), with the data, batch and mesh
  settings of ``overrides``. A directory made by ``tjax convert`` has no experiment yet: give it
  data with ``data.path=DIR`` (the task follows the model's family).

  Raises:
    ValueError: not a run directory, or an override other than data, batch and mesh settings.
  """
  rd = runs.RunDir(run_dir)
  model_config = rd.require_model()
  for key, _ in parse_overrides(list(overrides)):
    if key not in EVAL_KEYS:
      raise ValueError(
        f"{key}: tjax eval takes only {', '.join(EVAL_KEYS)} (the model and the "
        "rest of the run are its own)"
      )
  raw = rd.read_config()
  if raw is None:
    family = tasks_lib.family_task(model_config)
    raw = {"model": runs.model_spec(model_config), "data": {"task": family}}
  raw = {**raw, "run_dir": rd.path}
  ref = rd.read_dataset_ref()
  if ref is not None and isinstance(raw.get("data") or {}, dict):
    raw["data"] = {**(raw.get("data") or {}), "path": ref["path"]}
  return load_experiment(None, list(overrides), raw=raw, source=rd.file(runs.CONFIG))
