"""The timing of ``tjax bench train``'s sides: each side's first step, ``--warmup`` untimed steps
and the timed steps, one side after another in the same loop so that all see the same machine,
with the page faults and kernel time of each timed step; and ``--profile``'s traced steps.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys

from transformer_jax.bench import profile
from transformer_jax.bench.train_sides import Library, Ours


def summary(times: list[float]) -> dict:
  """Step times as the JSON holds them: ``{"median", "min", "all"}``."""
  return {"median": statistics.median(times), "min": min(times), "all": times}


def progress(text: str) -> None:
  """One line on stderr as the run goes (a run stopped by a time limit leaves its trace)."""
  print(f"# {text}", file=sys.stderr, flush=True)


def interleave(sides: dict, warmup: int, steps: int) -> tuple[dict, dict, dict]:
  """Steps every side in turn (ours, theirs, ours, ...): one first step each, ``warmup`` untimed
  rounds, then ``steps`` timed rounds.

  Args:
    sides: name to a side whose ``step()`` runs one step and returns its wall time in seconds.
    warmup: untimed rounds after the first steps.
    steps: timed rounds.

  Returns:
    ``(first, times, per_step)``: each side's first step time, its timed step times, and the
    minor page faults and kernel time of its timed steps (``minor_faults_per_step`` and
    ``sys_s_per_step``, medians; ``minor_faults_all`` and ``sys_s_all``).
  """
  first = {name: side.step() for name, side in sides.items()}
  progress("first steps: " + ", ".join(f"{name} {t:.2f} s" for name, t in first.items()))
  for _ in range(warmup):
    for side in sides.values():
      side.step()
  times = {name: [] for name in sides}
  kernel = {name: {"minor_faults": [], "sys_s": []} for name in sides}
  for _ in range(steps):
    for name, side in sides.items():
      before = resource.getrusage(resource.RUSAGE_SELF)
      times[name].append(side.step())
      after = resource.getrusage(resource.RUSAGE_SELF)
      # Fresh pages the step faulted in (and the kernel time they cost): memory the allocator
      # gave back to the kernel and took again.
      kernel[name]["minor_faults"].append(after.ru_minflt - before.ru_minflt)
      kernel[name]["sys_s"].append(after.ru_stime - before.ru_stime)
  per_step = {
    name: {
      **{f"{k}_per_step": statistics.median(v) for k, v in kernel[name].items()},
      **{f"{k}_all": v for k, v in kernel[name].items()},
    }
    for name in sides
  }
  return first, times, per_step


def profiles(sides: dict, steps: int, keep_dir: str | None = None) -> dict:
  """Each side's device kernels over ``steps`` more steps (``bench.profile``), with the same
  steps' median wall time; each trace kept in ``keep_dir`` when given."""

  if keep_dir:
    os.makedirs(keep_dir, exist_ok=True)
  out = {}
  for name, side in sides.items():
    walls: list[float] = []
    record = lambda side=side, walls=walls: walls.append(side.step())  # noqa: E731
    keep = os.path.join(keep_dir, f"{name}.trace.json.gz") if keep_dir else None
    out[name] = (
      profile.jax_kernels(record, steps, keep)
      if isinstance(side, (Ours, Library))
      else profile.torch_kernels(record, steps, keep)
    )
    out[name]["wall_ms_per_step"] = 1e3 * statistics.median(walls)
    progress(
      f"{name} profiled: {out[name].get('device_ms_per_step', 0):.1f} ms of kernels "
      f"in a {out[name]['wall_ms_per_step']:.1f} ms step"
    )
  return out
