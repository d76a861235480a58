"""What a run records while it trains: ``metrics.jsonl`` and TensorBoard (process 0), the progress
bar or one plain line per ``train.log_every`` steps, and ``loss.png`` at the end.

A training line holds ``step``, ``loss``, ``tokens_per_sec``, ``lr``, ``grad_norm``,
``batch_hash`` (CRC-32 of the host batch: resumed runs read the same data), ``mfu`` (where the
model's FLOPs per token are known), the task's ``*_loss`` / ``*_accuracy`` terms, with
``data.mixture`` ``tokens/NAME`` (the tokens each source gave up to that step), and on the last
line of each write the ``time_*`` seconds since the previous write (``goodput``); an eval line
holds ``step`` and ``val_*``; a line of ``time_*`` fields opens and one closes each attempt.
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

from transformer_jax import hardware, models, runs
from transformer_jax.train import goodput
from transformer_jax.train.console import log0, progress_bar
from transformer_jax.train.optim import learning_rate_schedule


class MetricsLog:
  """``metrics.jsonl`` plus TensorBoard; process 0 only.

  Opening it drops the lines past ``resume_step``: a run that died before its next checkpoint
  wrote them, and the resumed run writes them again.
  """

  def __init__(self, run_dir: str, resume_step: int):
    self.enabled = jax.process_index() == 0
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self.lost = (0, 0.0)  # goodput.lost: the steps past resume_step logged, run again
    if not self.enabled:
      return
    if os.path.exists(self.path):  # rewritten whole or not at all; damaged lines dropped
      records = runs.RunDir(run_dir).read_metrics()
      self.lost = goodput.lost(records, resume_step)
      keep = [r for r in records if r["step"] <= resume_step]
      runs.write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in keep))
    self.tb = summary_writer(os.path.join(run_dir, "tensorboard"))
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


def summary_writer(logdir: str):
  """tensorboardX's ``SummaryWriter`` for ``logdir``.

  tensorboardX imports PyTorch whenever it is installed, only so as to accept torch tensors, which
  a run's scalars never are: over two seconds of every run's start. Unless PyTorch is loaded
  already, tensorboardX is imported with ``torch`` unimportable for that moment (it then takes
  NumPy arrays and Python numbers); PyTorch stays importable afterwards.
  """
  if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
    sys.modules["torch"] = None  # `import torch` raises ImportError while tensorboardX loads
    try:
      import tensorboardX  # noqa: F401, PLC0415 - optional, heavy
    finally:
      if sys.modules.get("torch", 0) is None:
        del sys.modules["torch"]
  from tensorboardX import SummaryWriter  # noqa: PLC0415 - optional, heavy

  return SummaryWriter(logdir)


def plot_loss(run_dir: str) -> str | None:
  """Writes ``loss.png`` (training loss, its moving average, validation loss); returns its path,
  or None when ``metrics.jsonl`` has no training line."""
  import matplotlib  # noqa: PLC0415 - heavy, pictures only

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - heavy, pictures only

  train, val = [], []
  for r in runs.RunDir(run_dir).read_metrics():
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
    ax.plot(s[k - 1 :], np.convolve(l, np.ones(k) / k, mode="valid"), label=f"train (mean of {k})")
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


def batch_tokens(host_batch: dict[str, np.ndarray]) -> int:
  """The tokens of a host batch that ``tokens_per_sec`` counts (Seq2Seq: source and decoder
  input)."""
  if "src" in host_batch:
    return int(host_batch["src"].size + host_batch["tgt_in"].size)
  return int(host_batch["tokens"].size)


@dataclasses.dataclass
class StepMetrics:
  """A dispatched step whose metrics are still on the device."""

  step: int  # steps taken after it (1-based)
  metrics: dict  # the train step's metrics (device arrays)
  tokens: int  # tokens of its global batch
  batch_hash: int  # batch_hash of the host batch

  @classmethod
  def of(cls, step: int, metrics: dict, host_batch: dict[str, np.ndarray]) -> "StepMetrics":
    """The record of ``step`` for ``host_batch`` (this process's rows of a global batch)."""
    tokens = batch_tokens(host_batch)
    crc = 0
    for key in sorted(host_batch):
      crc = zlib.crc32(np.ascontiguousarray(host_batch[key]).tobytes(), crc)
    return cls(step, metrics, tokens * jax.process_count(), crc)


class MFU:
  """Model FLOPs utilisation: model FLOP/s over the devices' matmul rate
  (``hardware.matmul_peak``: a datasheet peak, or this machine's measured limit).

  A measured limit is a floor of what the machine can do: when a run's model FLOP/s pass it, the
  limit is raised to that rate (and the machine's cache with it), so the MFU is 100% at most and
  never inflated by a limit measured on a busy machine.
  """

  def __init__(self, flops_per_token: float, peak: float, source: str, devices: int, dtype: str):
    self.flops_per_token, self.peak, self.source = flops_per_token, peak, source
    self.devices, self.dtype = devices, dtype

  @classmethod
  def of(cls, run) -> "MFU | None":
    """The run's MFU; None for tasks whose tokens are not one sequence's (Seq2Seq)."""
    if not run.task.uses_seq_len or isinstance(run.model_config, models.Seq2SeqConfig):
      return None
    dtype = str(run.model_config.dtype)
    peak, source = hardware.matmul_peak(dtype)
    log0(
      f"MFU is counted against {peak / 1e12:.3g} TFLOP/s per device ({source}, {dtype}) on "
      f"{jax.device_count()} device(s)"
    )
    flops = models.train_flops_per_token(run.model_config, run.exp.train.seq_len)
    return cls(flops, peak, source, jax.device_count(), dtype)

  def __call__(self, tokens_per_sec: float) -> float:
    """The MFU at ``tokens_per_sec`` (global)."""
    per_device = tokens_per_sec * self.flops_per_token / self.devices
    if per_device > self.peak and self.source != "datasheet":
      hardware.store_limit(self.dtype, per_device)
      log0(
        f"notice: the step ran at {per_device / 1e12:.3g} TFLOP/s per device, above the "
        f"measured matmul limit ({self.peak / 1e12:.3g}); the limit is raised to it"
      )
      self.peak, self.source = per_device, "raised"
    return per_device / self.peak


class TrainLog:
  """A run's training and eval lines: the log files, the bar or plain lines, tokens/s between
  writes."""

  def __init__(self, run, run_dir: str, start: int, progress: bool):
    t = run.exp.train
    self.steps, self.log_every, self.plain = t.steps, t.log_every, not progress
    self.schedule = learning_rate_schedule(t)
    self.log = MetricsLog(run_dir, start)
    self.bar = progress_bar(start, t.steps, progress)
    self.mfu = MFU.of(run)
    # A mixture's tokens per source up to a step (closed form: exact on resume).
    self.source_tokens = getattr(run.loader, "tokens_consumed", None)
    self.since = time.perf_counter()

  def write_steps(
    self, pending: list[StepMetrics], clock: goodput.Clock
  ) -> tuple[int, float] | None:
    """Fetches the metrics of ``pending`` and writes their lines in order, up to the first whose
    loss is not finite. The last line carries ``clock``'s interval, closed once the metrics are
    fetched; the writing counts as the next interval's ``log``.

    Returns:
      ``(step, loss)`` of that first non-finite loss (its line and the later ones unwritten), or
      None when every loss is finite.
    """
    if not pending:
      return None
    fetched = jax.device_get([p.metrics for p in pending])
    times = clock.lap()
    with clock.timing("log"):
      return self._write_fetched(pending, fetched, times)

  def _write_fetched(self, pending, fetched, times: dict[str, float]) -> tuple[int, float] | None:
    elapsed = time.perf_counter() - self.since
    tokens = sum(p.tokens for p in pending)
    for p, m in zip(pending, fetched):
      loss = float(m["loss"])
      if not math.isfinite(loss):
        return p.step, loss
      record = {
        "step": p.step,
        "loss": loss,
        "tokens_per_sec": tokens / max(elapsed, 1e-9),
        "lr": float(self.schedule(p.step - 1)),
        "grad_norm": float(m["grad_norm"]),
        "batch_hash": p.batch_hash,
      }
      if self.mfu is not None:
        record["mfu"] = self.mfu(record["tokens_per_sec"])
      record.update({k: float(v) for k, v in m.items() if k.endswith(("_loss", "_accuracy"))})
      if self.source_tokens is not None:
        record.update({f"tokens/{k}": v for k, v in self.source_tokens(p.step).items()})
      # A mixture of experts' counts: tokens per expert [L, E] as lists, the dropped fraction.
      record.update({k: np.asarray(v).tolist() for k, v in m.items() if k.startswith("moe_")})
      if p is pending[-1]:
        record.update(times)
      self.log.write(record)
    self.bar.update(len(pending))
    mfu = f"  MFU {100 * record['mfu']:.1f}%" if "mfu" in record else ""
    self.bar.set_postfix(
      loss=f"{record['loss']:.3f}",
      tok_s=f"{record['tokens_per_sec']:.0f}",
      **({"mfu": mfu.split()[-1]} if mfu else {}),
    )
    if self.plain and record["step"] % self.log_every == 0:
      log0(
        f"step {record['step']}/{self.steps}  loss {record['loss']:.4f}  lr {record['lr']:.3e}"
        f"  tokens/s {record['tokens_per_sec']:.0f}{mfu}"
      )
    self.log.flush()
    self.since = time.perf_counter()
    return None

  def write_eval(self, record: dict[str, float]) -> None:
    """Writes an eval line (``step`` and ``val_*``) and prints it."""
    self.log.write(record, prefix="eval")
    self.log.flush()
    self.bar.write(
      f"step {record['step']}: "
      + ", ".join(f"{k}={v:.4f}" for k, v in record.items() if k != "step")
    )

  def write_times(self, record: dict[str, Any]) -> None:
    """Writes a line of ``goodput`` time fields (``step`` and ``time_*``)."""
    self.log.write(record, prefix="time")
    self.log.flush()

  def close_bar(self) -> None:
    self.bar.close()

  def close(self) -> None:
    self.log.close()
