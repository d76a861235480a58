"""``tjax train``: a run that logs, checkpoints, survives being killed and resumes exactly.

The run directory holds ``config.yaml`` (the experiment, as run), ``model.yaml`` (the model config),
``checkpoints/`` (orbax: last N plus ``best/``), ``metrics.jsonl`` (training lines: ``step``,
``loss``, ``tokens_per_sec``, ``lr``...; eval lines: ``step``, ``val_loss``...), TensorBoard events in
``tensorboard/``, ``loss.png`` and ``final.json`` (last metrics and learning bars).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import zlib
from typing import Any

import jax
import numpy as np
import yaml

from transformer_jax import data as data_lib
from transformer_jax import models, parallel
from transformer_jax.train import sampling
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.checkpoint import Checkpoints, model_spec
from transformer_jax.train.config import Experiment
from transformer_jax.train.optim import learning_rate_schedule, make_optimizer

_FAMILY_TASK = {models.GPTConfig: "gpt", models.BERTConfig: "bert", models.Seq2SeqConfig: "seq2seq"}


class TrainingDiverged(RuntimeError):
  """The loss became NaN or infinite."""


# -------------------------------------------------------------------------------------------------
# Data.


def ensure_dataset(exp: Experiment) -> data_lib.Dataset:
  """Loads ``data.path``, preparing it from ``data.inputs`` first if it does not exist yet."""
  d = exp.data
  path = d.path or os.path.join(exp.run_dir, "data")
  meta = os.path.join(path, "metadata.json")
  if not os.path.exists(meta):
    if not d.inputs:
      raise ValueError(f"data.path={path!r} holds no prepared dataset and data.inputs is empty")
    if jax.process_index() == 0:
      print(f"preparing {', '.join(d.inputs)} -> {path}", flush=True)
      data_lib.prepare(list(d.inputs), path, tokenizer=d.tokenizer, compact_vocab=d.compact_vocab,
                       task=d.task, val_fraction=d.val_fraction, seed=exp.train.seed)
  if jax.process_count() > 1:  # the others wait for process 0's preparation
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("tjax dataset")
  dataset = data_lib.load_dataset(path)
  shared_format = {dataset.task, d.task} <= {"gpt", "bert"}  # both read plain text documents
  if dataset.task != d.task and not shared_format:
    raise ValueError(f"dataset {path} was prepared for task {dataset.task!r}, not {d.task!r}")
  return dataset


def make_train_loader(exp: Experiment, dataset):
  t = exp.train
  match exp.data.task:
    case "gpt":
      return data_lib.GPTLoader(dataset, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed)
    case "bert":
      return data_lib.BertLoader(dataset, batch_size=t.batch_size, seq_len=t.seq_len, seed=t.seed,
                                 mask_prob=exp.data.mask_prob)
    case "seq2seq":
      return data_lib.Seq2SeqLoader(dataset, batch_size=t.batch_size, seed=t.seed)


def eval_batches(exp: Experiment, dataset):
  t = exp.train
  match exp.data.task:
    case "gpt":
      return data_lib.gpt_eval_batches(dataset, batch_size=t.batch_size, seq_len=t.seq_len,
                                       max_batches=t.eval_batches)
    case "bert":
      return data_lib.bert_eval_batches(dataset, batch_size=t.batch_size, seq_len=t.seq_len,
                                        num_batches=t.eval_batches)
    case "seq2seq":
      batches = data_lib.seq2seq_eval_batches(dataset, batch_size=t.batch_size)
      return (b for i, b in zip(range(t.eval_batches), batches))


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
  def build(cls, exp: Experiment) -> "Run":
    dataset = ensure_dataset(exp)
    model_config = _model_config(exp, dataset)
    expected = _FAMILY_TASK[type(model_config)]
    if exp.data.task != expected:
      raise ValueError(f"data.task={exp.data.task!r} does not fit a {type(model_config).__name__}"
                       f" (use data.task={expected!r})")
    m = exp.mesh
    mesh = parallel.make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor,
                               "sequence": m.sequence})
    seq_len = exp.train.seq_len if exp.data.task != "seq2seq" else None
    parallel.check_config(model_config, mesh, batch_size=exp.train.batch_size, seq_len=seq_len,
                          microbatches=exp.train.microbatches)
    options = {}
    if exp.data.task == "bert":
      # The loader masks max(1, round(mask_prob * n)) of n <= seq_len tokens per row.
      options["max_predictions"] = int(math.ceil(exp.data.mask_prob * exp.train.seq_len)) + 1
    return cls(exp, dataset, model_config, tasks_lib.get_task(exp.data.task, **options), mesh,
               models.graphdef(model_config), make_optimizer(exp.train))

  def evaluate(self, params, eval_step) -> dict[str, float]:
    sums, counts = None, None
    for batch in eval_batches(self.exp, self.dataset):
      s, c = eval_step(params, step_lib.shard_batch(batch, self.mesh, self.task.keys))
      sums = s if sums is None else jax.tree.map(np.add, sums, s)
      counts = c if counts is None else jax.tree.map(np.add, counts, c)
    out = {k: float(v) for k, v in tasks_lib.summarize(self.task, sums, counts).items()}
    result = {"val_loss": out.pop("loss")}
    for term in self.task.loss_terms:
      result[f"val_{term}_loss"] = out[f"{term}_loss"]
      result[f"val_{term}_accuracy"] = out[f"{term}_accuracy"]
    first = self.task.loss_terms[0]
    result["val_perplexity"] = math.exp(min(out[f"{first}_loss"], 50.0))
    return result


def _model_config(exp: Experiment, dataset) -> models.ModelConfig:
  spec_path = os.path.join(exp.run_dir, "model.yaml")
  if os.path.exists(spec_path):  # an existing run (or a converted checkpoint) owns its model
    with open(spec_path) as f:
      return models.config_from_dict(yaml.safe_load(f))
  return exp.model_config(vocab_size=dataset.vocab_size)


def _write_snapshot(run: Run) -> None:
  if jax.process_index() != 0:
    return
  os.makedirs(run.exp.run_dir, exist_ok=True)
  with open(os.path.join(run.exp.run_dir, "config.yaml"), "w") as f:
    yaml.safe_dump(run.exp.to_dict(), f, sort_keys=False)
  with open(os.path.join(run.exp.run_dir, "model.yaml"), "w") as f:
    yaml.safe_dump(model_spec(run.model_config), f, sort_keys=False)


def train(exp: Experiment, *, progress: bool = True) -> dict[str, Any]:
  """Runs (or resumes) the experiment; returns the final metrics and learning-bar results."""
  run = Run.build(exp)
  t = exp.train
  _write_snapshot(run)
  ckpt = Checkpoints(os.path.join(exp.run_dir, "checkpoints"), keep=t.keep_checkpoints,
                     async_save=t.async_checkpoints)
  loader = make_train_loader(exp, run.dataset)
  start = ckpt.latest_step() or 0
  if ckpt.latest_step() is not None:
    # Restore into shapes carrying this run's shardings: orbax places each array straight onto its
    # shards (the checkpoint may come from another mesh or device count), nothing is initialised.
    target = step_lib.abstract_state(run.model_config, run.optimizer, run.mesh)
    params, opt_state, meta = _restore(ckpt, start, target.params, target.opt_state,
                                       run.optimizer)
    state = step_lib.place_state(
        step_lib.TrainState(step=np.int32(start), params=params, opt_state=opt_state), run.mesh)
    if meta.get("loader"):
      loader.set_state(meta["loader"])
    _log0(f"resuming from {ckpt.directory} at step {start}")
  else:
    state = step_lib.init_state(run.model_config, run.optimizer, run.mesh,
                                jax.random.key(t.seed))
    loader.set_state({"step": 0})
  train_step = step_lib.jit_train_step(
      step_lib.make_train_step(run.graphdef, run.task, run.optimizer, seed=t.seed,
                               microbatches=t.microbatches, label_smoothing=t.label_smoothing,
                               z_loss=t.z_loss), run.mesh, state)
  eval_step = step_lib.jit_eval_step(step_lib.make_eval_step(run.graphdef, run.task), run.mesh,
                                     state.params)
  schedule = learning_rate_schedule(t)
  log = MetricsLog(exp.run_dir, start)
  bar = _progress(start, t.steps, progress)

  pending: list[tuple[int, dict, int, int]] = []
  last_flush = time.perf_counter()
  last_eval: dict[str, float] = {}
  last_good = start

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
        raise TrainingDiverged(
            f"loss became {loss} at step {s}; stopping. The last good checkpoint (step "
            f"{last_good}) in {ckpt.directory} is intact.")
      record = {"step": s, "loss": loss, "tokens_per_sec": tokens / max(elapsed, 1e-9),
                "lr": float(schedule(s - 1)), "grad_norm": float(m["grad_norm"]),
                "batch_hash": h}
      record.update({k: float(v) for k, v in m.items() if k.endswith(("_loss", "_accuracy"))})
      log.write(record)
    bar.update(len(pending))
    bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}")
    log.flush()
    pending = []
    last_flush = time.perf_counter()

  try:
    for s in range(start, t.steps):
      host = loader.batch_at(s)
      loader.set_state({"step": s + 1})
      state, metrics = train_step(state, step_lib.shard_batch(host, run.mesh, run.task.keys))
      done = s + 1
      pending.append((done, metrics, _batch_tokens(host) * jax.process_count(),
                      _batch_hash(host)))
      is_last = done == t.steps
      eval_due = done % t.eval_every == 0 or is_last
      ckpt_due = done % t.checkpoint_every == 0 or is_last
      if done % t.log_every == 0 or eval_due or ckpt_due:
        flush()  # also checks the loss is finite before anything is saved
      if eval_due:
        last_eval = run.evaluate(state.params, eval_step)
        log.write({"step": done, **last_eval}, prefix="eval")
        log.flush()
        bar.write(f"step {done}: " + ", ".join(f"{k}={v:.4f}" for k, v in last_eval.items()))
      if ckpt_due:
        ckpt.save(done, state.params, state.opt_state, {"step": done, "loader": loader.get_state()})
        if eval_due:
          ckpt.save_best(done, state.params, last_eval["val_loss"])
        last_good = done
  finally:
    bar.close()
    ckpt.wait()
    ckpt.close()
    log.close()

  final = {"step": t.steps, **last_eval}
  params = state.params
  if jax.process_count() > 1:  # parameters may span hosts: every process joins the gather
    from jax.experimental import multihost_utils
    params = multihost_utils.process_allgather(params, tiled=True)
  if jax.process_index() == 0:
    plot_loss(exp.run_dir)
    final["bars"] = check_bars(run, params, last_eval)
    if run.exp.data.task == "gpt" and t.samples:
      final["samples"] = print_samples(run, params)
    with open(os.path.join(exp.run_dir, "final.json"), "w") as f:
      json.dump(final, f, indent=2)
  return final


def _restore(ckpt, step, params, opt_state, optimizer):
  """Restores a training checkpoint into the given (sharded) targets; a converted model (params
  only) gets a fresh optimizer state."""
  params, restored, meta = ckpt.restore(step, params, opt_state)
  return params, (optimizer.init(params) if restored is None else restored), meta


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
  """Checks the experiment's ``bars``; each result records the figure, the bar and pass/fail."""
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
  if "exact_match" in bars:
    em = seq2seq_exact_match(run, params)
    results["exact_match"] = {"exact_match": em, "required": float(bars["exact_match"]),
                              "passed": em >= float(bars["exact_match"])}
  for name, r in results.items():
    print(f"learning bar {name}: {'PASS' if r['passed'] else 'FAIL'} {r}", flush=True)
  return results


def most_frequent_token_accuracy(run: Run) -> float:
  """Masked-token accuracy of always predicting the most frequent masked target (eval batches)."""
  counts = np.zeros(run.dataset.vocab_size, np.int64)
  for batch in eval_batches(run.exp, run.dataset):
    counts += np.bincount(batch["mlm_labels"][batch["mlm_mask"]], minlength=counts.size)
  return float(counts.max() / max(counts.sum(), 1))


def seq2seq_exact_match(run: Run, params, max_examples: int = 512) -> float:
  """Greedy-decoding exact match on held-out (validation) examples."""
  specials = run.dataset.meta["special_tokens"]
  bos, eos = specials["<bos>"], specials["<eos>"]
  right = total = 0
  for batch in data_lib.seq2seq_eval_batches(run.dataset, batch_size=run.exp.train.batch_size):
    valid = batch["src_mask"].any(-1)
    width = batch["tgt_out"].shape[1]
    pred = sampling.greedy_seq2seq(run.graphdef, params, batch["src"], batch["src_mask"],
                                   bos_id=bos, eos_id=eos, max_len=width)
    for i in np.flatnonzero(valid):
      target = batch["tgt_out"][i][batch["tgt_mask"][i]]       # target + EOS
      right += int(np.array_equal(pred[i, :target.size], target))
      total += 1
    if total >= max_examples:
      break
  return right / max(total, 1)


def print_samples(run: Run, params) -> list[str]:
  tok = run.dataset.tokenizer
  prompts_text = ["def ", "import ", "class ", "    return "][: run.exp.train.samples]
  prompts = [tok.encode(p) for p in prompts_text]
  new = sampling.sample_gpt(run.graphdef, params, prompts, max_new_tokens=run.exp.train.sample_tokens,
                            max_len=min(run.model_config.max_len, run.exp.train.seq_len),
                            stop_id=tok.eot_id,
                            banned_ids=run.dataset.meta["special_tokens"].values())
  texts = [p + tok.decode(n) for p, n in zip(prompts_text, new)]
  print("\nsamples:", flush=True)
  for text in texts:
    print("-" * 60 + "\n" + text, flush=True)
  with open(os.path.join(run.exp.run_dir, "samples.txt"), "w") as f:
    f.write(("\n" + "-" * 60 + "\n").join(texts))
  return texts


def evaluate_run(run_dir: str, overrides: list[str] = (), *, best: bool = False) -> dict[str, float]:
  """``tjax eval RUN_DIR [key=value ...]``: evaluates the latest (or best) checkpoint on the
  validation split. A directory made by ``tjax convert`` has no experiment yet: give it data with
  ``data.path=DIR`` (the task follows the model's family)."""
  from transformer_jax.train.checkpoint import restore_params
  from transformer_jax.train.config import load_experiment
  path = os.path.join(run_dir, "config.yaml")
  if os.path.exists(path):
    with open(path) as f:
      raw = yaml.safe_load(f)
  else:
    spec_path = os.path.join(run_dir, "model.yaml")
    if not os.path.exists(spec_path):
      raise ValueError(f"{run_dir} is not a run directory (no config.yaml or model.yaml)")
    with open(spec_path) as f:
      spec = yaml.safe_load(f)
    raw = {"model": spec, "data": {"task": spec.get("family")}}  # family names are task names
  raw["run_dir"] = run_dir
  exp = load_experiment(None, list(overrides), raw=raw)
  run = Run.build(exp)
  params, step = restore_params(os.path.join(run_dir, "checkpoints"), run.model_config, best=best)
  params = jax.device_put(params, parallel.param_shardings(params, run.mesh))
  result = run.evaluate(params, step_lib.jit_eval_step(
      step_lib.make_eval_step(run.graphdef, run.task), run.mesh, params))
  return {"step": step, **result}
