"""Where a run's wall time goes: the time fields of ``metrics.jsonl`` and the ``goodput`` of
``final.json``.

The loop measures with ``time.perf_counter`` on the host, between the points where it already
waits: it adds no device sync of its own. Between two writes of training lines (every
``train.log_every`` steps, and before an evaluation or a checkpoint) it counts

- ``data``: the host time inside ``loader.batch_at`` and the token-id check;
- ``checkpoint``: the blocking part of a save (the finiteness check of the parameters, and the
  copy an asynchronous save makes before it returns; the wait for the last save at the end);
- ``eval``: the evaluations (and their lines);
- ``log``: writing the training lines once their metrics are fetched, and starting or stopping a
  profile trace;
- ``step``: the rest of the interval: dispatching the compiled steps and, at the write, fetching
  their metrics, which waits until the device has run them. The device runs steps asynchronously,
  so it may still be computing while the host is in ``batch_at``: ``data`` is the time the host
  spent producing batches, an upper bound on what the device waited for them, and ``step`` a
  lower bound on the device's share.

The last training line of each write carries the interval's ``time_*`` seconds. A line of its own
(``{"step", "time_startup", "time_compile", "time_lost", "steps_lost"}``) opens each attempt:
``startup`` is the time from the start of ``trainer.train`` (after any pretraining run) to the
first batch request (the plan: data loaded, the step compiled (``compile``, a part of it);
the checkpoint restored); ``lost`` is the ``data`` and ``step`` time of the steps an earlier
attempt logged past the checkpoint this one resumes from (their lines are dropped and the steps
run again). A last line (``{"step", "time_*"}``) holds what follows the last write: the final
evaluation and checkpoint. Not counted: interpreter start-up and imports before
``trainer.train``, the time between attempts, and what a killed attempt spent after its last line.

``summary`` adds the fields of every line into the run's totals: goodput is the ``step`` time over
the whole (every attempt's counted time plus the lost time).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

# The parts of an interval between two writes; "step" is what the others leave.
PARTS = ("data", "step", "checkpoint", "eval", "log")
# The parts of the run, in the order a report lists them.
ALL_PARTS = ("startup", *PARTS, "lost")


class Clock:
  """The time since the last write, split into ``PARTS``."""

  def __init__(self):
    self.mark = time.perf_counter()
    self.spent = dict.fromkeys(PARTS[:1] + PARTS[2:], 0.0)

  @contextlib.contextmanager
  def timing(self, part: str):
    """Counts the time of the body as ``part`` (one of ``PARTS`` but ``step``)."""
    if part not in self.spent:
      raise ValueError(f"part={part!r}: expected one of {', '.join(self.spent)}")
    t = time.perf_counter()
    try:
      yield
    finally:
      self.spent[part] += time.perf_counter() - t

  def lap(self) -> dict[str, float]:
    """The ``time_*`` seconds since the last lap (``step``: the time not counted as another
    part), and a new interval begins."""
    now = time.perf_counter()
    step = now - self.mark - sum(self.spent.values())
    out = {f"time_{k}": round(self.spent.get(k, step), 6) for k in PARTS}
    self.mark, self.spent = now, dict.fromkeys(self.spent, 0.0)
    return out


def lost(records: list[dict], resume_step: int) -> tuple[int, float]:
  """``(steps, seconds)`` an attempt that resumes from the checkpoint of ``resume_step`` recomputes
  of what ``records`` (the earlier attempts' ``metrics.jsonl``) logged past it: the training steps
  and the ``data`` and ``step`` time of their lines."""
  past = [r for r in records if r["step"] > resume_step]
  steps = max((r["step"] for r in past if "loss" in r), default=resume_step) - resume_step
  seconds = sum(_number(r.get("time_data", 0)) + _number(r.get("time_step", 0)) for r in past)
  return steps, seconds


def _number(value: Any) -> float:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  return float(value) if ok else 0.0


def summary(records: list[dict]) -> dict[str, Any] | None:
  """The run's totals from its ``metrics.jsonl`` records: ``{"total_seconds", "goodput",
  "seconds": {part: s}, "fractions": {part: share of the total}, "steps_lost",
  "compile_seconds"}``; None when no line carries time fields (a run logged before they
  existed)."""
  seconds = dict.fromkeys(ALL_PARTS, 0.0)
  steps_lost, compile_seconds, seen = 0, 0.0, False
  for r in records:
    compile_seconds += _number(r.get("time_compile", 0))
    for part in ALL_PARTS:
      if f"time_{part}" in r:
        seconds[part] += _number(r[f"time_{part}"])
        seen = True
    steps_lost += int(_number(r.get("steps_lost", 0)))
  if not seen:
    return None
  total = sum(seconds.values())
  fractions = {k: (v / total if total > 0 else 0.0) for k, v in seconds.items()}
  return {
    "total_seconds": round(total, 3),
    "goodput": round(fractions["step"], 4),
    "seconds": {k: round(v, 3) for k, v in seconds.items()},
    "fractions": {k: round(v, 4) for k, v in fractions.items()},
    "steps_lost": steps_lost,
    "compile_seconds": round(compile_seconds, 3),  # a part of startup
  }


def check_summary(value: Any, where: str) -> None:
  """Checks the ``goodput`` of a ``final.json`` (``where`` names the file).

  Raises:
    ValueError: not the object ``summary`` writes, naming the field.
  """
  if not isinstance(value, dict):
    raise ValueError(f"{where}: goodput: expected an object")
  for key in ("seconds", "fractions"):
    part = value.get(key)
    if not isinstance(part, dict) or not all(_number(v) == v for v in part.values()):
      raise ValueError(f"{where}: goodput.{key}: expected an object of finite numbers")
  for key in ("total_seconds", "goodput"):
    if key not in value or _number(value[key]) != value[key]:
      raise ValueError(f"{where}: goodput.{key}: expected a finite number")


def table(value: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
  """The rows a report shows of a ``goodput`` summary: each part's seconds and share."""
  return [
    (part, {"seconds": value["seconds"].get(part), "share": f"{100 * share:.1f}%"})
    for part, share in value["fractions"].items()
  ]
