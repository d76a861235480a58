"""The tjax launcher's allocator (``backends.cpu.allocator``): its decision before JAX starts, the
re-executed process over mimalloc, and the notices."""

import os
import subprocess
import sys

import pytest

from transformer_jax import cli
from transformer_jax.backends.cpu import allocator
from transformer_jax.bench import machine

MIMALLOC = "/x/cmeel.prefix/lib/libmimalloc.so"


def _plugins(*names):
  """A ``find_spec`` stand-in under which only ``names`` can be imported."""
  return lambda name: object() if name in names else None


NO_PLUGIN = _plugins()


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_allocator_env_preloads_mimalloc_once(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  env = allocator.allocator_env({"PATH": "/bin"}, find_spec=NO_PLUGIN)
  assert env["LD_PRELOAD"] == MIMALLOC and env["MIMALLOC_PURGE_DELAY"] == "-1"
  # Already preloaded (the re-executed process), or turned off: nothing to do.
  assert allocator.allocator_env(env, find_spec=NO_PLUGIN) is None
  for off in ("0", "system", "glibc"):
    assert allocator.allocator_env({"TJAX_MALLOC": off}, find_spec=NO_PLUGIN) is None
  # A user's own preload is kept after ours.
  env = allocator.allocator_env({"LD_PRELOAD": "/x/libfoo.so"}, find_spec=NO_PLUGIN)
  assert env["LD_PRELOAD"] == f"{MIMALLOC} /x/libfoo.so"
  # Not installed: nothing to preload.
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: None)
  assert allocator.allocator_env({}, find_spec=NO_PLUGIN) is None


@pytest.mark.parametrize(
  "environ, plugins, on_cpu",
  [
    ({}, (), True),  # nothing but jaxlib: CPU
    ({}, ("jax_cuda12_plugin",), False),
    ({}, ("jax_cuda13_plugin",), False),
    ({}, ("libtpu",), False),
    ({}, ("jax_plugins",), False),  # any PJRT plugin
    ({"JAX_PLATFORMS": "cpu"}, ("jax_cuda12_plugin",), True),  # JAX_PLATFORMS decides
    ({"JAX_PLATFORMS": " CPU "}, ("libtpu",), True),
    ({"JAX_PLATFORMS": "cuda"}, (), False),
    ({"JAX_PLATFORMS": "cuda,cpu"}, (), False),  # the first listed computes
    ({"JAX_PLATFORMS": "tpu"}, (), False),
    ({"JAX_PLATFORMS": ""}, ("jax_cuda12_plugin",), False),  # empty: as unset
  ],
)
def test_launcher_decides_cpu_from_jax_platforms_then_plugins(environ, plugins, on_cpu):
  assert allocator.computes_on_cpu(environ, find_spec=_plugins(*plugins)) is on_cpu


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_allocator_env_only_for_processes_that_compute_on_cpu(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  gpu = _plugins("jax_cuda12_plugin")
  assert allocator.allocator_env({}, find_spec=gpu) is None
  assert allocator.allocator_env({"JAX_PLATFORMS": "tpu"}, find_spec=NO_PLUGIN) is None
  assert allocator.allocator_env({"JAX_PLATFORMS": "cpu"}, find_spec=gpu)["LD_PRELOAD"] == MIMALLOC
  # TJAX_MALLOC=mimalloc asks for it wherever the process computes.
  assert allocator.allocator_env({"TJAX_MALLOC": "mimalloc"}, find_spec=gpu) is not None


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_system_allocator_notice_only_when_mimalloc_would_run_but_is_missing(monkeypatch):
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: None)
  text = allocator.system_allocator_notice({}, find_spec=NO_PLUGIN)
  assert "system allocator" in text and "transformer-jax[cpu]" in text and "\n" not in text
  assert allocator.system_allocator_notice({"TJAX_MALLOC": "system"}, find_spec=NO_PLUGIN) is None
  assert allocator.system_allocator_notice({}, find_spec=_plugins("libtpu")) is None
  assert (
    allocator.system_allocator_notice({"LD_PRELOAD": "/x/libjemalloc.so"}, find_spec=NO_PLUGIN)
    is None
  )
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  assert allocator.system_allocator_notice({}, find_spec=NO_PLUGIN) is None


def _launch(monkeypatch, capsys):
  """Runs ``cli.launch`` with ``main`` and ``os.execve`` stubbed: ``(exec calls, stderr)``."""
  calls = []
  monkeypatch.setattr(cli, "main", lambda: 0)
  monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
  with pytest.raises(SystemExit) as done:
    cli.launch()
  assert done.value.code == 0
  return calls, capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_launcher_runs_itself_over_mimalloc_only_on_cpu(monkeypatch, capsys):
  for name in ("LD_PRELOAD", "TJAX_MALLOC"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: MIMALLOC)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  calls, err = _launch(monkeypatch, capsys)
  assert len(calls) == 1 and calls[0][2]["LD_PRELOAD"] == MIMALLOC and err == ""
  assert calls[0][1][1:3] == ["-m", "transformer_jax.cli"]
  monkeypatch.setenv("JAX_PLATFORMS", "cuda")
  calls, err = _launch(monkeypatch, capsys)
  assert calls == [] and err == ""


@pytest.mark.skipif(sys.platform != "linux", reason="LD_PRELOAD is the Linux launcher's")
def test_launcher_without_mimalloc_says_so_once_and_runs(monkeypatch, capsys):
  for name in ("LD_PRELOAD", "TJAX_MALLOC"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setattr(allocator, "mimalloc_path", lambda: None)
  calls, err = _launch(monkeypatch, capsys)
  assert calls == [] and err.count("\n") == 1 and "system allocator" in err


def test_the_launchers_decision_loads_no_jax():
  """The first process of ``tjax train`` only decides how to start the second: in a fresh
  interpreter, the allocator's decision and its environment leave JAX, Flax and the backends'
  kernels unloaded (loading them there would cost every command a second start-up of JAX)."""
  script = (
    "import sys\n"
    "from transformer_jax.backends.cpu import allocator\n"
    "allocator.computes_on_cpu(); allocator.allocator_env()\n"
    "heavy = ('jax', 'flax', 'transformer_jax.backends.cpu.backend', 'transformer_jax.ops')\n"
    "print([m for m in heavy if m in sys.modules])\n"
  )
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_scratch_notice_only_for_cpu_steps_past_mimallocs_reuse_limit(monkeypatch):
  limit = allocator.MIMALLOC_REUSE_LIMIT
  assert allocator.scratch_notice(limit, platform="cpu", malloc="mimalloc") is None
  assert allocator.scratch_notice(None, platform="cpu", malloc="mimalloc") is None
  assert allocator.scratch_notice(3 << 30, platform="gpu", malloc="mimalloc") is None
  assert allocator.scratch_notice(3 << 30, platform="cpu", malloc="glibc") is None
  msg = allocator.scratch_notice(3 << 30, platform="cpu", malloc="mimalloc")
  assert "3.00 GiB" in msg and "microbatches" in msg
  # The module's limit is the one its notice uses (the trainer's tests lower it there).
  monkeypatch.setattr(allocator, "MIMALLOC_REUSE_LIMIT", 0)
  assert allocator.scratch_notice(1, platform="cpu", malloc="mimalloc") is not None


def test_allocator_names_the_preloaded_malloc(monkeypatch):
  monkeypatch.setenv("LD_PRELOAD", "/x/libmimalloc.so")
  assert allocator.allocator() == "mimalloc" and machine.describe()["allocator"] == "mimalloc"
  monkeypatch.delenv("LD_PRELOAD")
  assert allocator.allocator() == "glibc"


@pytest.mark.parametrize("value", ["maybe", "1", "yes", "jemalloc"])
def test_an_unknown_tjax_malloc_is_one_line_naming_it(monkeypatch, capsys, value):
  monkeypatch.setenv("TJAX_MALLOC", value)
  with pytest.raises(ValueError, match=rf"TJAX_MALLOC={value!r} must be one of"):
    allocator.allocator_env()
  calls = []
  monkeypatch.setattr(os, "execve", lambda *args: calls.append(args))
  monkeypatch.setattr(cli, "main", lambda: calls.append("main") or 0)
  with pytest.raises(SystemExit) as done:
    cli.launch()
  err = capsys.readouterr().err
  assert done.value.code == 2 and calls == [] and err.count("\n") == 1
  assert f"TJAX_MALLOC={value!r} must be one of '0', 'system', 'glibc', 'mimalloc'" in err
  for valid in ("0", "System", "mimalloc", ""):  # any case; empty is unset
    monkeypatch.setenv("TJAX_MALLOC", valid)
    allocator.allocator_env()
