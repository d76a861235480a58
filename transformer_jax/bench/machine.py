"""The machine a benchmark ran on, and its limits measured in the same run.

A benchmark's absolute time says little across machines (these CPUs differ by 2-5x and by whether
they have bfloat16 hardware); a fraction of a limit measured in the same process does. Two limits:

* ``matmul_limit``: the best FLOP/s of the work's own matmul shapes (forward ``x @ W``, the
  backward's ``dy @ W^T`` and ``x^T @ dy``), best of several calls: no training step can use
  the matrix units faster, so ``model FLOP/s / limit`` is a utilisation (MFU) against this machine.
* ``weight_bandwidth``: the rate of a matrix-vector product over a large weight matrix, the
  operation batch-1 decoding repeats for every weight: ``weight bytes / bandwidth`` is the floor on
  the time of one decoded token.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
import time
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import backends, hardware
from transformer_jax.backends.cpu import allocator

# The CPU's facts live in transformer_jax.hardware; the bench's result files name them.
BF16_FLAGS = hardware.BF16_FLAGS
cpu_family = hardware.cpu_family
cpu_name = hardware.cpu_name
cpu_flags = hardware.cpu_flags
has_bf16_hardware = hardware.has_bf16_units


def cpu_idle() -> dict:
  """How this Linux machine's idle CPUs wait (``/sys``): the cpuidle driver and governor, and for a
  virtual machine's ``haltpoll`` driver how long an idle CPU polls before halting
  (``guest_halt_poll_ns``; 0: it halts at once, and waking a thread goes through the hypervisor).
  Empty where ``/sys`` does not say."""
  out = {}
  for key, path in (
    ("driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
    ("governor", "/sys/devices/system/cpu/cpuidle/current_governor_ro"),
    ("governor", "/sys/devices/system/cpu/cpuidle/current_governor"),
    ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
  ):
    if key in out:  # the governor: current_governor_ro where the kernel has it, else the other
      continue
    try:
      with open(path) as f:
        value = f.read().strip()
    except OSError:
      continue
    out[key] = int(value) if value.isdigit() else value
  return out


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def source_revision() -> dict | None:
  """The git commit of this package's checkout and whether tracked files differ from it
  (``{"commit": ..., "modified": bool}``), or None outside a git checkout (an installed wheel)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  def git(*args: str) -> str:
    return subprocess.run(
      ["git", "-C", root, *args], capture_output=True, text=True, check=True, timeout=10
    ).stdout.strip()

  try:
    if os.path.realpath(git("rev-parse", "--show-toplevel")) != os.path.realpath(root):
      return None  # installed inside some other repository's tree (a venv in a checkout)
    commit = git("rev-parse", "HEAD")
    modified = bool(git("status", "--porcelain", "--untracked-files=no"))
  except (OSError, subprocess.SubprocessError):
    return None
  return {"commit": commit, "modified": modified}


def describe(extra_versions: Iterable[str] = ()) -> dict:
  """CPU, flags, cores, how idle CPUs wait, devices, allocator, the train step's compile options,
  load average, package versions and the git commit of this checkout, for a result file."""
  versions = {d: _version(d) for d in ("jax", "jaxlib", "flax", "optax", *extra_versions)}
  versions["python"] = platform.python_version()
  return {
    "cpu": cpu_name(),
    "cpu_flags": cpu_flags(),
    "bf16_hardware": has_bf16_hardware(),
    "cpu_count": os.cpu_count(),
    "cpu_idle": cpu_idle(),
    "platform": backends.platform(),
    "devices": [d.device_kind for d in jax.devices()],
    "allocator": allocator.allocator(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "step_compiler_options": backends.current().step_compiler_options(),
    "load_average": list(os.getloadavg()),
    "versions": versions,
    "source": source_revision(),
  }


def torch_device() -> tuple[str | None, str]:
  """Where a benchmark's PyTorch rival runs: ``("cpu", "")`` on CPU, ``("cuda", "")`` when JAX is
  on a GPU and torch has CUDA, else ``(None, why not)``."""
  platform = backends.platform()
  if platform == "cpu":
    return "cpu", ""
  if platform != "gpu":
    return None, f"no PyTorch rival on {platform} (JAX runs on {hardware.device_kind()})"
  import torch  # noqa: PLC0415 - torch is optional (the hf extra)

  if not torch.cuda.is_available():
    return None, f"JAX runs on a GPU but torch {torch.__version__} has no CUDA device"
  return "cuda", ""


def _call_times(fn, *args, reps: int) -> list[float]:
  """Seconds of each of ``reps`` calls of ``fn(*args)``, after one untimed (compiling) call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return times


def _best_time(fn, *args, reps: int) -> float:
  return min(_call_times(fn, *args, reps=reps))


def matmul_limit(
  shapes: Sequence[tuple[int, int, int]],
  dtype: str = "float32",
  reps: int = 3,
  precision: str | None = None,
) -> dict:
  """Best FLOP/s of ``[m, k] @ [k, n]`` over ``shapes`` (each ``(m, k, n)``), each in the three
  layouts a training step uses: ``x @ W``, ``dy @ W^T`` and ``x^T @ dy``, and on CPU with each
  library that XLA can give the products to: its default (YNNPACK or Eigen) and oneDNN, which the
  train step uses (``Backend.step_compiler_options``). The limit is the best of them all.

  Inputs are ``dtype``; bfloat16 accumulates in float32 (``preferred_element_type``), as the
  models do. ``precision`` (a ``jax.lax.Precision`` name, e.g. "highest") is the products'
  precision; None leaves JAX's default. Returns ``{"flops_per_sec": best, "per_shape": {"MxKxN":
  {layout: rate}}, "per_library": {"onednn": {"MxKxN": {layout: rate}}}}`` (``per_shape`` is
  XLA's default).
  """
  dt = jnp.dtype(dtype)
  rng = np.random.default_rng(0)
  backend = backends.current()
  on_device = backend.platform != "cpu"
  keys = iter(jax.random.split(jax.random.key(0), 3 * len(shapes)))

  def normal(shape):
    # On an accelerator drawn there: a step's [tokens, vocab] operand is GBs, slow to draw on the
    # host and to copy over.
    if on_device:
      return jax.random.normal(next(keys), shape, jnp.float32).astype(dt)
    return jnp.asarray(rng.standard_normal(shape, np.float32), dt)

  libraries = {"default": None}
  if not on_device and (options := backend.step_compiler_options()):
    libraries["onednn"] = options
  rates_by_library: dict[str, dict] = {name: {} for name in libraries}
  best = 0.0
  for m, k, n in shapes:
    a, w, dy = normal((m, k)), normal((k, n)), normal((m, n))
    dot = functools.partial(
      jnp.matmul,
      preferred_element_type=jnp.float32,
      **({"precision": precision} if precision is not None else {}),
    )
    layouts = {
      "x@W": (dot, (a, w)),
      "dy@W^T": (lambda dy, w: dot(dy, w.T), (dy, w)),
      "x^T@dy": (lambda a, dy: dot(a.T, dy), (a, dy)),
    }
    for library, options in libraries.items():
      rates = {}
      for name, (fn, args) in layouts.items():
        compiled = backend.hold(jax.jit(fn).lower(*args).compile(compiler_options=options), options)
        rates[name] = 2.0 * m * k * n / _best_time(compiled, *args, reps=reps)
      rates_by_library[library][f"{m}x{k}x{n}"] = rates
      best = max(best, *rates.values())
  return {
    "dtype": dtype,
    "flops_per_sec": best,
    "per_shape": rates_by_library.pop("default"),
    "per_library": rates_by_library,
  }


# The side of the square product an accelerator's limit also includes: large enough that the
# matrix units, not the call's dispatch, set its time.
SQUARE_MATMUL = 8192


def run_matmul_limit(shapes: Sequence[tuple[int, int, int]], dtype: str = "float32") -> dict:
  """The matmul limit of a benchmark's products on this run's backend.

  On CPU, ``matmul_limit(shapes, dtype)``. On an accelerator, also a ``SQUARE_MATMUL`` cube (its
  small products time the call's dispatch more than its matrix units), best of 10 calls, and
  float32 products at full float32 precision (``"highest"``: as the models' default
  ``matmul_precision`` and PyTorch compute them, not TensorFloat-32 or one bfloat16 pass).
  """
  if backends.platform() == "cpu":
    return matmul_limit(shapes, dtype=dtype)
  square = (SQUARE_MATMUL,) * 3
  return matmul_limit(
    [*shapes, square], dtype=dtype, reps=10, precision="highest" if dtype == "float32" else None
  )


def weight_bandwidth(nbytes: int = 512 << 20, dtype: str = "float32", reps: int = 7) -> dict:
  """Bytes per second of a jitted matrix-vector product ``W @ x`` over an ``nbytes`` matrix: the
  rate at which a decoding step can stream its weights.

  ``bytes_per_sec`` is the best of ``reps`` calls (the limit); ``sustained_bytes_per_sec`` is their
  mean rate (all bytes over all the calls' time), which is what a run of many such products, as a
  decoding loop is, can expect on a machine whose memory bus other machines share: on a 2-core
  cloud VM the same product's calls spread by 10-30% (experiments/PERFORMANCE.md, "How much the
  floor itself moves").
  """
  dt = jnp.dtype(dtype)
  cols = 4096
  rows = max(nbytes // (cols * dt.itemsize), 1)
  w = jnp.ones((rows, cols), dt)
  x = jnp.ones((cols,), dt)
  gemv = jax.jit(lambda w, x: w @ x)
  times = _call_times(gemv, w, x, reps=reps)
  return {
    "dtype": dtype,
    "bytes": int(w.nbytes),
    "bytes_per_sec": w.nbytes / min(times),
    "sustained_bytes_per_sec": w.nbytes * reps / sum(times),
  }


def write_json(path: str, result: dict) -> None:
  """Writes an experiment's ``result`` to ``path`` as indented JSON, creating its folder."""
  import json  # noqa: PLC0415 - only the experiments write results

  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=2)
