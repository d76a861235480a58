"""How orbax's failures reach the user: one reason per damaged step, no echoes of abandoned reads,
and a directory named on the bare ``OSError`` of a full disk."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys

# How orbax and TensorStore word a failed read of a checkpoint's array.
_READ_ERROR = "while reading array index"
_STORE_READ_ERROR = 'Error reading "'


def reason(e: BaseException) -> str:
  """The first line of ``e`` with its type, without TensorStore's details (240 characters)."""
  text = str(e).strip().splitlines()
  first = text[0].split(" See full TensorStore details")[0] if text else ""
  return f"{type(e).__name__}: {first}"[:240]


def _raised_by_a_read(exc: BaseException | None) -> bool:
  """Whether ``exc`` (or an exception it chains) comes from orbax's array reads."""
  seen = 0
  while exc is not None and seen < 8:
    if _READ_ERROR in str(exc) or _STORE_READ_ERROR in str(exc):
      return True
    tb = exc.__traceback__
    while tb is not None:
      if tb.tb_frame.f_code.co_name.startswith("_read_array"):
        return True
      tb = tb.tb_next
    exc, seen = exc.__cause__ or exc.__context__, seen + 1
  return False


def _is_abandoned_read(unraisable) -> bool:
  """An "Exception ignored in coroutine" report of a read orbax abandoned on a damaged step."""
  return getattr(unraisable.object, "__qualname__", "").startswith(
    "_read_array"
  ) or _raised_by_a_read(unraisable.exc_value)


class _DropAbandonedReads(logging.Filter):
  """Drops asyncio's "Task exception was never retrieved" / "Exception in callback" records of
  the reads orbax abandons on a damaged step (they can come after the loop is closed)."""

  def filter(self, record: logging.LogRecord) -> bool:
    text = record.getMessage()
    if "_read_array" in text or _READ_ERROR in text or _STORE_READ_ERROR in text:
      return False
    return not (record.exc_info and _raised_by_a_read(record.exc_info[1]))


@contextlib.contextmanager
def quiet_aborted_reads():
  """Drops the "Exception ignored in coroutine" reports of the reads orbax abandons when a step
  is damaged: the damage is reported once, by name, instead. Those coroutines may be collected
  later, on orbax's event-loop thread or at exit, so the filter stays installed (once) and drops
  nothing else. A read that failed is collected on the way out (a full ``gc.collect``: only then,
  since it costs a large process most of a second)."""
  hook = sys.unraisablehook
  if not getattr(hook, "drops_abandoned_reads", False):

    def drop(unraisable, previous=hook):
      if not _is_abandoned_read(unraisable):
        previous(unraisable)

    drop.drops_abandoned_reads = True
    sys.unraisablehook = drop
  asyncio_log = logging.getLogger("asyncio")
  if not any(isinstance(f, _DropAbandonedReads) for f in asyncio_log.filters):
    asyncio_log.addFilter(_DropAbandonedReads())
  try:
    yield
  except BaseException:
    gc.collect()  # the abandoned reads report now, through the filter, not at a later moment
    raise


@contextlib.contextmanager
def naming(directory: str):
  """Gives an ``OSError`` that names no file (orbax's background metadata writes raise a bare
  ``[Errno 28]`` when the disk fills) the checkpoint directory it was writing to."""
  try:
    yield
  except OSError as e:
    if e.errno is None or e.filename is not None:
      raise
    raise OSError(e.errno, e.strerror or os.strerror(e.errno), directory) from e
