"""What a run prints: lines from process 0, and the progress bar (tqdm, or a stand-in that prints
nothing but the lines it is given)."""

from __future__ import annotations

import sys

import jax


def log0(msg: str) -> None:
  """Prints ``msg`` on stdout from process 0 only."""
  if jax.process_index() == 0:
    print(msg, flush=True)


class NoBar:
  """The progress bar's interface without a bar: ``write`` prints a line (process 0)."""

  def update(self, n):
    pass

  def set_postfix(self, **kw):
    pass

  def write(self, msg):
    log0(msg)

  def close(self):
    pass


def progress_bar(start: int, total: int, enabled: bool):
  """A tqdm bar on stderr from ``start`` to ``total`` steps (process 0, when ``enabled``), else a
  :class:`NoBar`."""
  if not enabled or jax.process_index() != 0:
    return NoBar()
  from tqdm import tqdm  # noqa: PLC0415 - the bar only

  return tqdm(
    total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr
  )
