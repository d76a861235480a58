"""The idle-CPU polling request (``backends.cpu.poll``), always against a stand-in for
/dev/cpu_dma_latency."""

import os
import struct

import jax
import pytest

from transformer_jax.backends.cpu import poll


def _fds_on(path) -> int:
  """How many of this process's file descriptors are open on ``path``."""
  n = 0
  for fd in os.listdir("/proc/self/fd"):
    try:
      n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except OSError:
      pass
  return n


def _stand_in(tmp_path, monkeypatch):
  """A file in place of /dev/cpu_dma_latency (tests never write the real one)."""
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  return device


def test_cpu_poll_holds_a_zero_request_only_while_the_block_runs(tmp_path, monkeypatch):
  device = _stand_in(tmp_path, monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with poll.cpu_poll() as req:
    assert req.held and req.requested and req.reason == ""
    # The kernel reads one signed 32-bit latency in microseconds; the request lasts while the
    # file stays open.
    assert device.read_bytes() == struct.pack("i", 0)
    assert _fds_on(device) == 1
  assert _fds_on(device) == 0
  # Released when the block fails too, and the error is the caller's.
  with pytest.raises(KeyError):
    with poll.cpu_poll() as req:
      assert req.held and _fds_on(device) == 1
      raise KeyError("x")
  assert _fds_on(device) == 0


def test_cpu_poll_does_nothing_when_not_requested_or_not_allowed(tmp_path, monkeypatch):
  device = _stand_in(tmp_path, monkeypatch)
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  with poll.cpu_poll_if(False) as req:
    assert (req.held, req.requested) == (False, False) and "--cpu-poll" in req.reason
    assert _fds_on(device) == 0
  assert device.read_bytes() == b""
  for missing in (tmp_path / "absent", tmp_path):  # no such file; a directory (cannot write)
    monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(missing))
    with poll.cpu_poll_if(True) as req:
      assert req.requested and not req.held and str(missing) in req.reason
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  with poll.cpu_poll() as req:
    assert not req.held and "not on CPU" in req.reason and _fds_on(device) == 0


@pytest.mark.parametrize(
  "flag, env, want",
  [
    (None, {}, False),  # off unless asked for
    (None, {"TJAX_CPU_POLL": "1"}, True),
    (None, {"TJAX_CPU_POLL": "yes"}, True),
    (None, {"TJAX_CPU_POLL": "0"}, False),
    (True, {}, True),  # --cpu-poll
    (False, {"TJAX_CPU_POLL": "1"}, False),  # --no-cpu-poll over the environment
  ],
)
def test_cpu_poll_is_requested_by_the_flag_else_the_environment(flag, env, want):
  assert poll.requested(flag, env) is want


def test_cpu_poll_environment_must_say_yes_or_no():
  with pytest.raises(ValueError, match=r"TJAX_CPU_POLL='maybe' must be 1 or 0"):
    poll.requested(None, {"TJAX_CPU_POLL": "maybe"})
