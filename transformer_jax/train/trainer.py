"""``tjax train``: a run that logs, checkpoints, survives faults and resumes exactly.

The run directory's format belongs to :mod:`transformer_jax.runs`: ``config.yaml``, ``model.yaml``,
``dataset.json``, ``checkpoints/`` (orbax: last N plus ``best/``), ``metrics.jsonl``, TensorBoard
events in ``tensorboard/``, ``loss.png`` and ``final.json`` (last metrics and learning bars).

Resuming follows MaxText and the HF Trainer: a finished run says so and does nothing; a larger
``train.steps`` continues it; a setting that would change its model or data is
refused by name (start over with ``force_new`` or another ``run_dir``); optimisation, logging and
mesh settings may change. Nothing in the directory is
rewritten before the experiment, the dataset and the checkpoint to resume from have been checked.
SIGINT and SIGTERM save a checkpoint at the end of the current step and return.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import sys
import time
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import data as data_lib
from transformer_jax import lora as lora_lib
from transformer_jax import hardware, models, parallel, runs, runtime
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.config import Experiment, fixed_changes, load_experiment
from transformer_jax.train.optim import learning_rate_schedule, make_optimizer


class TrainingDiverged(RuntimeError):
  """The loss or the parameters became NaN or infinite."""


# -------------------------------------------------------------------------------------------------
# Data.


def ensure_dataset(exp: Experiment, *, prepare: bool = True) -> data_lib.Dataset:
  """Loads ``data.path``, preparing it from ``data.inputs`` first if it does not exist yet (and
  ``prepare``)."""
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


def make_train_loader(exp: Experiment, dataset, task=None):
  return (task or tasks_lib.TASKS[exp.data.task]).loader(dataset, exp)


def eval_batches(exp: Experiment, dataset, task=None):
  return (task or tasks_lib.TASKS[exp.data.task]).eval_batches(dataset, exp)


def _batch_tokens(batch) -> int:
  if "src" in batch:
    return int(batch["src"].size + batch["tgt_in"].size)
  return int(batch["tokens"].size)


def _batch_hash(batch) -> int:
  crc = 0
  for key in sorted(batch):
    crc = zlib.crc32(np.ascontiguousarray(batch[key]).tobytes(), crc)
  return crc
# -------------------------------------------------------------------------------------------------
# Logging.


class MetricsLog:
  """``metrics.jsonl`` plus TensorBoard; process 0 only."""

  def __init__(self, run_dir: str, resume_step: int):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(run_dir, "metrics.jsonl")
    if not self.enabled:
      return
    # Lines past the restored step were written by a run that died before its next checkpoint.
    if os.path.exists(self.path):
      with open(self.path) as f:
        keep = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
      with open(self.path, "w") as f:
        f.writelines(keep)
    from tensorboardX import SummaryWriter
    self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
    self.file = open(self.path, "a")

  def write(self, record: dict[str, Any], prefix: str = "train") -> None:
    if not self.enabled:
      return
    self.file.write(json.dumps(record) + "\n")
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)):
        self.tb.add_scalar(f"{prefix}/{key}", value, record["step"])

  def flush(self) -> None:
    if self.enabled:
      self.file.flush()
      self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self.file.close()
      self.tb.close()


def plot_loss(run_dir: str) -> str | None:
  """Writes ``loss.png`` (training loss, its moving average, validation loss)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train, val = [], []
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    for line in f:
      r = json.loads(line)
      if "val_loss" in r:
        val.append((r["step"], r["val_loss"]))
      elif "loss" in r:
        train.append((r["step"], r["loss"]))
  if not train:
    return None
  fig, ax = plt.subplots(figsize=(7, 4))
  s, l = np.array(train).T
  ax.plot(s, l, alpha=0.3, label="train loss")
  k = max(1, len(l) // 50)
  if len(l) > k:
    ax.plot(s[k - 1:], np.convolve(l, np.ones(k) / k, mode="valid"), label=f"train (mean of {k})")
  if val:
    vs, vl = np.array(val).T
    ax.plot(vs, vl, "o-", label="validation loss")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats)")
  ax.set_title(os.path.basename(os.path.normpath(run_dir)))
  ax.legend()
  ax.grid(alpha=0.3)
  path = os.path.join(run_dir, "loss.png")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


# -------------------------------------------------------------------------------------------------
# The run.


def plan(exp: Experiment, model_config: models.ModelConfig):
  """``(task, mesh, optimizer)`` of ``exp`` for ``model_config``, checked: what a real run and
  ``--dry-run`` both build on."""
  task = tasks_lib.for_experiment(exp, model_config)
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
  """The (unjitted) train step of ``exp``: what a run executes and ``--dry-run`` compiles
  (``microbatches`` overrides ``train.microbatches``)."""
  t = exp.train
  return step_lib.make_train_step(
      graphdef, task, optimizer, seed=t.seed,
      microbatches=fixed_microbatches(t) if microbatches is None else microbatches,
      label_smoothing=t.label_smoothing, z_loss=t.z_loss)


def compiled_step(exp: Experiment, graphdef, task, optimizer, mesh, state, batch):
  """The jitted train step of ``exp`` and its microbatch count, compiled for ``(state, batch)``
  (arrays or shapes): ``(step, compiled, microbatches)``.

  The count is ``step_lib.pick_microbatches``' (``train.microbatches: auto`` on CPU over mimalloc:
  ``step_lib.auto_microbatches``).
  """
  built = {}

  def compile_for(m):
    step = step_lib.jit_train_step(make_step(exp, graphdef, task, optimizer, m), mesh, state)
    built[m] = step, step.lower(state, batch).compile()
    return built[m][1]

  m, _ = step_lib.pick_microbatches(exp.train.microbatches, compile_for, exp.train.batch_size,
                                    mesh.shape["data"] * mesh.shape["fsdp"],
                                    platform=mesh.devices.flat[0].platform)
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
    if exp.train.lora is not None:  # the adapted model's graph (its adapters are parameters too)
      graphdef = nnx.split(lora_lib.abstract(model_config, exp.train.lora, mesh))[0]
    else:
      graphdef = models.graphdef(model_config, mesh)
    return cls(exp, dataset, model_config, task, mesh, graphdef, optimizer)

  def evaluate(self, params, eval_step) -> dict[str, float]:
    sums, counts = None, None
    for batch in eval_batches(self.exp, self.dataset, self.task):
      tasks_lib.check_token_ids(self.task, batch, self.model_config.vocab_size)
      s, c = eval_step(params, step_lib.shard_batch(batch, self.mesh, self.task.keys))
      sums = s if sums is None else jax.tree.map(np.add, sums, s)
      counts = c if counts is None else jax.tree.map(np.add, counts, c)
    if sums is None:
      raise ValueError(f"the validation split of {self.dataset.path} gives no batch of "
                       f"{self.exp.train.batch_size}; lower train.batch_size")
    out = {k: float(v) for k, v in tasks_lib.summarize(self.task, sums, counts).items()}
    result = {"val_loss": out.pop("loss")}
    for term in self.task.loss_terms:
      result[f"val_{term}_loss"] = out[f"{term}_loss"]
      result[f"val_{term}_accuracy"] = out[f"{term}_accuracy"]
    first = self.task.loss_terms[0]
    if self.task.name == "classify":
      report = self.task.report(sums)
      result["val_accuracy"] = report["accuracy"]
      result["val_macro_f1"] = report["macro_f1"]
      self.per_class = report["per_class"]
    else:
      result["val_perplexity"] = math.exp(min(out[f"{first}_loss"], 50.0))
    return result


def _normalised(raw: dict) -> dict:
  """A stored ``config.yaml`` as a full, absolute experiment tree (for comparing with a new one)."""
  return load_experiment(None, raw=raw).absolute().to_dict()


def _resumed_model(exp: Experiment, rd: runs.RunDir, stored: dict | None, force_new: bool):
  """Checks ``exp`` against the run already in ``rd``; returns the model config to use (None: the
  experiment's) and whether there is a run to resume."""
  steps = rd.checkpoint_steps()
  if force_new or not steps:
    return None, False      # nothing to lose: a failed start's snapshot files are replaced
  stored_model = rd.read_model()
  if stored_model is None:
    raise ValueError(f"run_dir {rd.path} has checkpoints but no {runs.MODEL}; use --force-new "
                     "to start over, or another run_dir")
  if stored is None:        # a converted model: its own model.yaml decides the model
    _log0(f"fine-tuning the model in {rd.path} ({runs.MODEL}; the experiment's model section is "
          "not used)")
    return stored_model, True
  changes = fixed_changes(_normalised(stored), exp.to_dict())
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
    ValueError: a bad experiment, dataset, run directory or checkpoint (one line, named).
    TrainingDiverged: the loss or the parameters became non-finite.
    RunLocked: another trainer holds the run directory.
  """
  exp = exp.absolute()
  _pretrain_if_absent(exp, progress)
  rd = runs.RunDir(exp.run_dir)
  rd.check_usable()
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
  _log0(f"{init_from} does not exist: training it first ({exp.pretrain})")
  result = train(pre, progress=progress)
  if result.get("interrupted"):
    raise ValueError(f"the pretraining run {init_from} was interrupted; run the command again "
                     "to resume it")


def _train_locked(exp, rd, progress, force_new, resume_hint):
  t = exp.train
  stored = None if force_new else rd.read_config()
  model_config, resuming = _resumed_model(exp, rd, stored, force_new)
  if resuming:
    final = rd.read_final()
    last = rd.checkpoint_steps()[-1]
    if last >= t.steps and final is not None and final.get("step") == last:
      _log0(f"{rd.path} is finished (step {last} of train.steps={t.steps}); nothing to do. "
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
  if force_new and jax.process_index() == 0:
    rd.clear()
  ckpt = runs.Checkpoints(rd.checkpoint_dir, keep=t.keep_checkpoints,
                          async_save=t.async_checkpoints)
  try:
    return _train_loop(run, rd, ckpt, ref, progress, resume_hint)
  finally:
    ckpt.close()


def _mfu_scale(run: Run) -> float | None:
  """Model FLOPs per token over the devices' matmul rate (``hardware.matmul_peak``: a datasheet
  peak, or a product measured on this CPU): tokens/s times it is the model FLOPs utilisation.
  None for tasks whose tokens are not one sequence's (Seq2Seq)."""
  if not run.task.uses_seq_len or isinstance(run.model_config, models.Seq2SeqConfig):
    return None
  peak, source = hardware.matmul_peak(run.model_config.dtype)
  _log0(f"MFU is counted against {peak / 1e12:.3g} TFLOP/s per device ({source}, "
        f"{run.model_config.dtype}) on {jax.device_count()} device(s)")
  flops = models.train_flops_per_token(run.model_config, run.exp.train.seq_len)
  return flops / (peak * jax.device_count())


def _train_loop(run: Run, rd: runs.RunDir, ckpt, ref, progress, resume_hint):
  exp, t = run.exp, run.exp.train
  loader = make_train_loader(exp, run.dataset, run.task)
  # Restore into shapes carrying this run's shardings: orbax places each array straight onto its
  # shards (the checkpoint may come from another mesh or device count), nothing is initialised.
  frozen = fresh = None
  if t.lora is not None:  # the frozen base is rebuilt (deterministically); adapters restored
    fresh, frozen = _lora_start(run, rd)
    target = _abstract_lora_state(run)
  else:
    target = step_lib.abstract_state(run.model_config, run.optimizer, run.mesh)
  start, params, opt_state, meta, damaged = ckpt.restore_newest_good(target.params,
                                                                     target.opt_state)
  if start is not None:
    if damaged:
      ckpt.set_aside([s for s, _ in damaged])
      runs.warn(f"resuming from step {start}, the newest intact checkpoint; the damaged steps "
                f"are kept as damaged-<step> in {ckpt.directory}")
    if opt_state is None:     # a converted model: parameters only
      _log0(f"fine-tuning the parameters of step {start} with a fresh optimizer state")
      opt_state = run.optimizer.init(params)
    state = step_lib.place_state(
        step_lib.TrainState(step=np.int32(start), params=params, opt_state=opt_state,
                            frozen=frozen), run.mesh)
    if meta.get("loader"):
      loader.set_state(meta["loader"])
    _log0(f"resuming from {ckpt.directory} at step {start}")
  else:
    start = 0
    if t.lora is not None:
      state = step_lib.place_state(step_lib.TrainState(
          step=np.int32(0), params=fresh, opt_state=run.optimizer.init(fresh), frozen=frozen),
          run.mesh)
    else:
      state = step_lib.init_state(run.model_config, run.optimizer, run.mesh,
                                  jax.random.key(t.seed))
      if exp.model.get("init_from"):
        state = _init_from(run, rd, state, exp.model["init_from"])
    loader.set_state({"step": 0})
  # Everything is checked: only now is the directory's snapshot (re)written.
  rd.write_snapshot(exp.to_dict(), run.model_config, ref)
  if start < t.steps:
    first = step_lib.shard_batch(loader.batch_at(start), run.mesh, run.task.keys)
    train_step, compiled, microbatches = compiled_step(exp, run.graphdef, run.task,
                                                       run.optimizer, run.mesh, state, first)
    del first
    notice = _scratch_notice(compiled)
    del compiled
    if t.microbatches == "auto" and microbatches > 1:
      _log0(f"train.microbatches=auto: {microbatches} microbatches, which keep the step's "
            "temporaries within what the allocator reuses between steps")
  else:
    train_step, notice = step_lib.jit_train_step(
        make_step(exp, run.graphdef, run.task, run.optimizer), run.mesh, state), None
  eval_step = step_lib.jit_eval_step(step_lib.make_eval_step(run.graphdef, run.task), run.mesh,
                                     _all_params(state))
  schedule = learning_rate_schedule(t)
  log = MetricsLog(rd.path, start)
  if progress is None:
    progress = sys.stderr.isatty()
  bar = _progress(start, t.steps, progress)

  flops_per_token_and_peak = _mfu_scale(run)
  pending: list[tuple[int, dict, int, int]] = []
  last_flush = time.perf_counter()
  last_eval: dict[str, float] = {}
  last_good = start if ckpt.latest_step() is not None else None
  stop = _StopFlag()

  def flush():
    nonlocal last_flush, pending
    if not pending:
      return
    fetched = jax.device_get([m for _, m, _, _ in pending])
    elapsed = time.perf_counter() - last_flush
    tokens = sum(n for _, _, n, _ in pending)
    for (s, _, _, h), m in zip(pending, fetched):
      loss = float(m["loss"])
      if not math.isfinite(loss):
        raise TrainingDiverged(f"loss became {loss} at step {s}; stopping. " + _good(last_good))
      record = {"step": s, "loss": loss, "tokens_per_sec": tokens / max(elapsed, 1e-9),
                "lr": float(schedule(s - 1)), "grad_norm": float(m["grad_norm"]),
                "batch_hash": h}
      if flops_per_token_and_peak is not None:
        record["mfu"] = record["tokens_per_sec"] * flops_per_token_and_peak
      record.update({k: float(v) for k, v in m.items() if k.endswith(("_loss", "_accuracy"))})
      log.write(record)
    bar.update(len(pending))
    mfu = f"  MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}",
                    **({"mfu": mfu.split()[-1]} if mfu else {}))
    if not progress and record["step"] % t.log_every == 0:
      _log0(f"step {record['step']}/{t.steps}  loss {record['loss']:.4f}  lr {record['lr']:.3e}"
            f"  tokens/s {record['tokens_per_sec']:.0f}{mfu}")
    log.flush()
    pending = []
    last_flush = time.perf_counter()

  def save(done):
    nonlocal last_good
    bad = runs.nonfinite_leaves(state.params)  # the loss was finite before this update
    if bad:
      raise TrainingDiverged(f"parameters became non-finite at step {done} (in "
                             f"{', '.join(bad[:3])}); not saved. " + _good(last_good))
    ckpt.save(done, state.params, state.opt_state, {"step": done, "loader": loader.get_state()})
    if last_eval.get("step") == done:
      ckpt.save_best(done, state.params, last_eval["val_loss"])
    last_good = done

  vocab = run.model_config.vocab_size
  done = start
  try:
    with stop.installed():
      for s in range(start, t.steps):
        host = loader.batch_at(s)
        tasks_lib.check_token_ids(run.task, host, vocab)
        loader.set_state({"step": s + 1})
        batch = step_lib.shard_batch(host, run.mesh, run.task.keys)
        state, metrics = train_step(state, batch)
        if s == start and notice:
          _log0(notice)
        done = s + 1
        pending.append((done, metrics, _batch_tokens(host) * jax.process_count(),
                        _batch_hash(host)))
        is_last = done == t.steps
        eval_due = done % t.eval_every == 0 or is_last
        ckpt_due = done % t.checkpoint_every == 0 or is_last
        if done % t.log_every == 0 or eval_due or ckpt_due or stop.signal:
          flush()  # also checks the loss is finite before anything is saved
        if eval_due:
          last_eval = {"step": done, **run.evaluate(_all_params(state), eval_step)}
          log.write(last_eval, prefix="eval")
          log.flush()
          bar.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in last_eval.items()
                                                 if k != "step"))
        if ckpt_due or stop.signal:
          save(done)
        if stop.signal and not is_last:
          break
  finally:
    bar.close()
    try:
      ckpt.wait()
    finally:
      log.close()

  if stop.signal and done < t.steps:
    hint = resume_hint or "run the same training command again"
    _log0(f"stopped by {stop.signal} at step {done}; checkpoint saved in {ckpt.directory}. "
          f"To resume: {hint}")
    return {"step": done, "interrupted": stop.signal}

  params = state.params
  if not last_eval:  # resumed at the end (the previous run stopped before its final report)
    last_eval = {"step": done, **run.evaluate(_all_params(state), eval_step)}
  if state.frozen is not None:  # samples and bars run the base architecture, adapters merged
    params = lora_lib.merged_params(run.graphdef, state.params, state.frozen)
  final = {"step": t.steps, **{k: v for k, v in last_eval.items() if k != "step"}}
  if state.frozen is not None:
    final["lora"] = lora_lib.count(state.params, state.frozen)
  if run.task.name == "classify":
    final["majority_baseline"] = run.dataset.meta["majority_baseline"]["val_accuracy"]
    final["labels"] = run.dataset.meta["labels"]
    final["per_class"] = getattr(run, "per_class", None)
  if jax.process_count() > 1:  # parameters may span hosts: every process joins the gather
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    plot_loss(rd.path)
    final["bars"] = check_bars(run, params, last_eval)
    if run.task.name == "gpt" and t.samples:
      final["samples"] = print_samples(run, params)
    rd.write_final(final)
  return final


def _init_from(run: Run, rd: runs.RunDir, state, init_from: str):
  """``state`` with the pretrained tensors of ``init_from`` loaded (and a fresh optimizer state);
  the report goes to the log and to ``init_from.json`` in the run directory."""
  from transformer_jax.train import finetune
  params = jax.device_get(state.params)
  params, report = finetune.load_pretrained(params, init_from)
  _log0(finetune.describe(report, init_from))
  if jax.process_index() == 0:
    runs.write_atomic(os.path.join(rd.path, "init_from.json"),
                      json.dumps({"init_from": init_from, **report}, indent=1))
  return step_lib.place_state(step_lib.TrainState(
      step=state.step, params=params, opt_state=run.optimizer.init(params)), run.mesh)


def _all_params(state):
  """Every parameter of the model a state trains (a LoRA run's adapters and frozen base)."""
  return state.params if state.frozen is None else nnx.merge_state(state.params, state.frozen)


def _lora_start(run: Run, rd: runs.RunDir):
  """``(trainable, frozen)`` of a fresh LoRA run: the base initialised from ``train.seed`` (then
  ``model.init_from`` loaded into it), adapters with B = 0, split by ``lora.TRAINABLE``."""
  from transformer_jax.train import finetune
  cfg, lcfg = run.model_config, run.exp.train.lora
  init_from = run.exp.model.get("init_from")
  trainable, frozen, report = finetune.lora_start(cfg, lcfg, run.exp.train.seed, init_from)
  if report is not None:
    _log0(finetune.describe(report, init_from))
    if jax.process_index() == 0:
      runs.write_atomic(os.path.join(rd.path, "init_from.json"),
                        json.dumps({"init_from": init_from, **report}, indent=1))
  n = lora_lib.count(trainable, frozen)
  _log0(f"LoRA rank {lcfg.rank} on {', '.join(lcfg.targets)}: {n['trainable']:,} of "
        f"{n['total']:,} parameters train ({100 * n['fraction']:.2f}%)")
  return trainable, frozen


def _abstract_lora_state(run: Run):
  """A LoRA run's train state as sharded shapes: the restore target."""
  _, trainable, frozen = lora_lib.split(lora_lib.abstract(run.model_config, run.exp.train.lora))
  state = step_lib.TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=trainable,
                              opt_state=jax.eval_shape(run.optimizer.init, trainable),
                              frozen=frozen)
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                      step_lib.state_shardings(state, run.mesh))


def _good(step: int | None) -> str:
  if step is None:
    return "No checkpoint was saved before it."
  return f"The last good checkpoint (step {step}) is intact."


class _StopFlag:
  """SIGINT/SIGTERM set ``signal`` (its name); the loop saves and stops at the end of the step. A
  second signal acts as usual (KeyboardInterrupt or termination)."""

  def __init__(self):
    self.signal: str | None = None

  def _handle(self, signum, frame):
    self.signal = signal.Signals(signum).name
    signal.signal(signum, self._previous[signum])
    _log0(f"\n{self.signal}: saving a checkpoint at the end of this step (again to abort)")

  @contextlib.contextmanager
  def installed(self):
    import threading
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


def _scratch_notice(compiled) -> str | None:
  """The notice the run prints after its first step when the compiled step's temporaries are too
  large for the CPU allocator to reuse (``runtime.scratch_notice``), else None."""
  return runtime.scratch_notice(step_lib.temp_bytes(compiled), platform=jax.default_backend(),
                                malloc=runtime.allocator())


def _log0(msg: str) -> None:
  if jax.process_index() == 0:
    print(msg, flush=True)


class _NoBar:
  def update(self, n): pass
  def set_postfix(self, **kw): pass
  def write(self, msg): _log0(msg)
  def close(self): pass


def _progress(start: int, total: int, enabled: bool):
  if not enabled or jax.process_index() != 0:
    return _NoBar()
  from tqdm import tqdm
  return tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True,
              file=sys.stderr)




# -------------------------------------------------------------------------------------------------
# Learning bars and samples.


def check_bars(run: Run, params, last_eval: dict[str, float]) -> dict[str, Any]:
  """Checks the experiment's ``bars`` and prints one line each; each result records the figure,
  the bar and pass/fail (reported: ``tjax train --check-bars`` makes a failure an error)."""
  bars = run.exp.bars
  results = {}
  if "val_loss_below_unigram" in bars:
    unigram = data_lib.unigram_cross_entropy(run.dataset)
    margin = float(bars["val_loss_below_unigram"])
    results["val_loss_below_unigram"] = {
        "val_loss": last_eval["val_loss"], "unigram_cross_entropy": unigram,
        "required_margin": margin, "margin": unigram - last_eval["val_loss"],
        "passed": unigram - last_eval["val_loss"] >= margin}
  if "mlm_accuracy_over_baseline" in bars:
    baseline = most_frequent_token_accuracy(run)
    acc = last_eval["val_mlm_accuracy"]
    margin = float(bars["mlm_accuracy_over_baseline"])
    results["mlm_accuracy_over_baseline"] = {
        "mlm_accuracy": acc, "most_frequent_token_baseline": baseline, "required_margin": margin,
        "passed": acc - baseline >= margin}
  if "accuracy_over_majority" in bars:
    baseline = run.dataset.meta["majority_baseline"]["val_accuracy"]
    acc = last_eval["val_accuracy"]
    margin = float(bars["accuracy_over_majority"])
    results["accuracy_over_majority"] = {
        "val_accuracy": acc, "majority_baseline": baseline, "required_margin": margin,
        "passed": acc - baseline >= margin}
  if "exact_match" in bars:
    em = seq2seq_exact_match(run, params)
    results["exact_match"] = {"exact_match": em, "required": float(bars["exact_match"]),
                              "passed": em >= float(bars["exact_match"])}
  for name, r in results.items():
    figures = ", ".join(f"{k}={v:.4g}" for k, v in r.items() if k != "passed")
    print(f"learning bar {name}: {'reached' if r['passed'] else 'NOT reached'} ({figures})",
          flush=True)
  return results


def most_frequent_token_accuracy(run: Run) -> float:
  """Masked-token accuracy of always predicting the most frequent masked target (eval batches)."""
  counts = np.zeros(run.dataset.vocab_size, np.int64)
  for batch in eval_batches(run.exp, run.dataset):
    counts += np.bincount(batch["mlm_labels"][batch["mlm_mask"]], minlength=counts.size)
  return float(counts.max() / max(counts.sum(), 1))


def seq2seq_exact_match(run: Run, params, max_examples: int = 512) -> float:
  """Greedy-decoding exact match on held-out (validation) examples (``generate``, cached)."""
  from transformer_jax.generate import generate
  specials = run.dataset.meta["special_tokens"]
  bos, eos = specials["<bos>"], specials["<eos>"]
  right = total = 0
  for batch in data_lib.seq2seq_eval_batches(run.dataset, batch_size=run.exp.train.batch_size):
    rows = np.flatnonzero(batch["src_mask"].any(-1))
    if not rows.size:
      continue
    width = min(batch["tgt_out"].shape[1], run.model_config.max_len)
    pred = np.asarray(generate((run.model_config, params), batch["src"][rows],
                               prompt_lengths=batch["src_mask"][rows].sum(-1),
                               max_new_tokens=width, eos_id=eos, decoder_start_id=bos))
    for j, i in enumerate(rows):
      target = batch["tgt_out"][i][batch["tgt_mask"][i]]       # target + EOS
      right += int(np.array_equal(pred[j, :target.size], target))
      total += 1
    if total >= max_examples:
      break
  return right / max(total, 1)


def print_samples(run: Run, params) -> list[str]:
  """Samples a few continuations (``tjax generate``'s sampler: temperature 0.8, top-k 40; special
  tokens such as [UNK] are never drawn) and writes them to ``samples.txt``."""
  from transformer_jax.generate.commands import stream_generate
  tok = run.dataset.tokenizer
  prompts_text = ["def ", "import ", "class ", "    return "][: run.exp.train.samples]
  prompts = [tok.encode(p) for p in prompts_text]
  room = min(run.model_config.max_len, run.exp.train.seq_len) - max(len(p) for p in prompts)
  suppress = sorted(set(tok.special_ids.values()) - {tok.eot_id})
  rows = [[] for _ in prompts]
  for chunk in stream_generate((run.model_config, params), prompts,
                               max_new_tokens=max(1, min(run.exp.train.sample_tokens, room)),
                               temperature=0.8, top_k=40, eos_id=tok.eot_id,
                               key=jax.random.key(run.exp.train.seed), suppress_ids=suppress):
    for row, new in zip(rows, np.asarray(chunk)):
      row.extend(int(i) for i in new)
  rows = [r[:r.index(tok.eot_id)] if tok.eot_id in r else r for r in rows]
  texts = [p + tok.decode(n) for p, n in zip(prompts_text, rows)]
  print("\nsamples:", flush=True)
  for text in texts:
    print("-" * 60 + "\n" + text, flush=True)
  runs.write_atomic(os.path.join(run.exp.run_dir, "samples.txt"),
                    ("\n" + "-" * 60 + "\n").join(texts))
  return texts


# -------------------------------------------------------------------------------------------------
# tjax eval


# What ``tjax eval`` may set: where the data is, how much of it to read and in what windows, and
# the mesh.
_EVAL_KEYS = ("data.path", "train.eval_batches", "train.batch_size", "train.seq_len", "mesh.data",
              "mesh.fsdp", "mesh.tensor", "mesh.sequence")


def evaluate_run(run_dir: str, overrides: list[str] = (), *, best: bool = False) -> dict[str, float]:
  """``tjax eval RUN_DIR [key=value ...]``: evaluates the latest (or best) intact checkpoint on the
  validation split of the run's dataset. A directory made by ``tjax convert`` has no experiment
  yet: give it data with ``data.path=DIR`` (the task follows the model's family).

  Raises:
    ValueError: not a run directory, an override other than data, batch and mesh settings, a
      missing or changed dataset, a vocabulary that differs from the model's, or no intact
      checkpoint.
  """
  rd = runs.RunDir(run_dir)
  model_config = rd.require_model()
  from transformer_jax.train.config import parse_overrides
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
  if ref is not None:  # the dataset the run trained on, wherever the command runs from
    raw["data"] = {**raw["data"], "path": ref["path"]}
  exp = load_experiment(None, list(overrides), raw=raw).absolute()
  run = Run.build(exp, model_config, prepare=False)
  if ref is not None and os.path.abspath(run.dataset.path) == ref["path"]:
    now = runs.dataset_fingerprint(ref["path"])
    if now != ref["hash"]:
      raise ValueError(f"the dataset {ref['path']} changed since the run trained on it (content "
                       f"hash {ref['hash'][:12]} -> {now[:12]})")
  from transformer_jax.train import finetune
  if finetune.lora_run_config(rd.path) is not None:  # adapters merged: the base architecture
    _, params = finetune.load_lora_merged(rd.path, best=best)
    step = rd.checkpoint_steps(best)[-1]
    run.graphdef = models.graphdef(model_config, run.mesh)
  else:
    params, step = runs.restore_params(rd.checkpoint_dir, model_config, best=best)
  params = jax.device_put(params, parallel.param_shardings(params, run.mesh))
  result = run.evaluate(params, step_lib.jit_eval_step(
      step_lib.make_eval_step(run.graphdef, run.task), run.mesh, params))
  return {"step": step, **result}
