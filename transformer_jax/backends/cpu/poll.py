"""Idle CPUs that poll instead of halting while decoding runs on CPU: an opt-in request to Linux.

Why: XLA:CPU cuts a decoding step's products into blocks for its thread pool; between two products
the pool's other thread sleeps, and on a virtual machine whose idle CPUs halt at once its wake-up
goes through the hypervisor. A PM QoS request of 0 µs (``/dev/cpu_dma_latency``) keeps idle CPUs
polling, so a woken thread runs at once (PyTorch's OpenMP threads and llama.cpp's ``--poll``
busy-wait for the same reason).

The request covers every CPU of the machine while it is held (idle CPUs burn power instead of
sleeping), so nothing asks for it unless told to: ``tjax generate --cpu-poll``, ``tjax bench
generate --cpu-poll`` or ``TJAX_CPU_POLL=1`` (``requested``), or a library user's own ``with
cpu_poll():`` around decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import struct
import sys
from typing import Mapping

import jax

POLL_ENV = "TJAX_CPU_POLL"  # "1": tjax generate and tjax bench generate hold the request
CPU_DMA_LATENCY = "/dev/cpu_dma_latency"
_ON = ("1", "on", "true", "yes")
_OFF = ("", "0", "off", "false", "no")


@dataclasses.dataclass
class PollRequest:
  """What a request for polling CPUs got.

  Attributes:
    held: True while this process asks the kernel to keep idle CPUs polling.
    reason: why not, when ``held`` is False.
    requested: whether the request was asked for at all (``requested``).
  """

  held: bool
  reason: str = ""
  requested: bool = True


def requested(flag: bool | None, environ: Mapping[str, str] | None = None) -> bool:
  """Whether a command should hold the request: ``flag`` (``--cpu-poll`` True, ``--no-cpu-poll``
  False) when given, else ``$TJAX_CPU_POLL`` ("1", "on", "true", "yes"; unset or "0": no).

  Raises:
    ValueError: ``$TJAX_CPU_POLL`` is none of those values.
  """
  if flag is not None:
    return bool(flag)
  setting = (os.environ if environ is None else environ).get(POLL_ENV, "")
  if setting.lower() in _ON:
    return True
  if setting.lower() in _OFF:
    return False
  raise ValueError(f"{POLL_ENV}={setting!r} must be 1 or 0 (on/off, true/false, yes/no)")


@contextlib.contextmanager
def cpu_poll():
  """While the block runs on CPU, asks Linux to keep idle CPUs polling instead of halting (a PM
  QoS request of 0 µs through ``CPU_DMA_LATENCY``, released when the block ends, also when it
  fails).

  Yields:
    A ``PollRequest``. It never fails: without the right to write the file (it is root's), on
    another OS or off CPU nothing changes and ``reason`` says why.
  """
  if sys.platform != "linux":
    yield PollRequest(False, f"a Linux request ({CPU_DMA_LATENCY}); this is {sys.platform}")
    return

  if jax.default_backend() != "cpu":
    yield PollRequest(False, f"not on CPU (backend {jax.default_backend()})")
    return
  try:
    fd = os.open(CPU_DMA_LATENCY, os.O_WRONLY)
  except OSError as e:
    why = (
      "only root may write it" if isinstance(e, PermissionError) else e.strerror or type(e).__name__
    )
    yield PollRequest(False, f"cannot open {CPU_DMA_LATENCY}: {why}")
    return
  try:
    os.write(fd, struct.pack("i", 0))  # one signed 32-bit latency in microseconds
  except OSError as e:
    os.close(fd)
    yield PollRequest(False, f"cannot write {CPU_DMA_LATENCY}: {e.strerror or type(e).__name__}")
    return
  try:
    yield PollRequest(True)
  finally:
    os.close(fd)


def cpu_poll_if(wanted: bool):
  """``cpu_poll()`` when ``wanted`` (from ``requested``), else a block that asks nothing and yields
  ``PollRequest(False, ..., requested=False)``."""
  if wanted:
    return cpu_poll()
  return contextlib.nullcontext(
    PollRequest(False, f"not requested (--cpu-poll or {POLL_ENV}=1 asks for it)", requested=False)
  )
