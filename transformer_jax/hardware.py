"""Hardware facts, in one place: the CPU's model and instruction-set flags (``/proc/cpuinfo``),
accelerators' datasheet peak matmul rates, and which device this process computes on.

``PEAK_FLOPS`` holds dense (no structured sparsity) peak FLOP/s of matrix products per device kind,
as ``jax.devices()[0].device_kind`` names it, and per input dtype. For NVIDIA GPUs "float32" is the
full-precision FP32 rate (not TensorFloat-32), which is what a float32 product computed at
``jax.lax.Precision.HIGHEST`` can reach; TPUs list bfloat16 only (their float32 products are passes
of bfloat16 ones). A measured limit (``bench.machine.matmul_limit``) is the figure a benchmark's
utilisation is set against; the peak is the vendor's ceiling beside it.

Where no datasheet figure is known (CPUs), a training run's MFU is counted against a measured
matmul limit kept per machine in the user's cache folder (``matmul_peak``): measured once, and
raised whenever a run goes faster, so the MFU never passes 100%.
"""

from __future__ import annotations

import functools
import json
import os
import platform as _platform
import re
import time

import jax
import jax.numpy as jnp

# cpuinfo flags that decide which kernels are fast: vector width, FMA, bfloat16 and AMX units.
_FLAGS_OF_INTEREST = (
  "avx",
  "avx2",
  "fma",
  "avx512f",
  "avx512_bf16",
  "avx512_vnni",
  "amx_bf16",
  "amx_tile",
  "amx_int8",
  "asimd",
  "sve",
  "bf16",
)
# The flags of CPUs with bfloat16 matrix instructions (AVX-512 BF16, AMX).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str], tuple[tuple[str, str], ...]]:
  name, flags, ids = _platform.processor() or _platform.machine(), set(), {}
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name in ("", _platform.processor(), _platform.machine()):
          name = value.strip()
        elif key in ("flags", "Features"):
          flags.update(value.split())
        elif key in ("cpu family", "model"):
          ids.setdefault(key, value.strip())
  except OSError:
    pass
  return name, frozenset(flags), tuple(ids.items())


def cpu_family() -> str:
  """``"cpu family 25, model 17"`` from ``/proc/cpuinfo`` (empty where it says neither): what tells
  two CPUs of one model name apart (an "AMD EPYC" may be a Zen 4 or a Zen 5)."""
  return ", ".join(f"{key} {value}" for key, value in _cpuinfo()[2])


def cpu_name() -> str:
  """The CPU's model name (``/proc/cpuinfo``), or what ``platform`` knows."""
  return _cpuinfo()[0]


def cpu_flags() -> list[str]:
  """The instruction-set flags that matter for these kernels, among those the CPU reports."""
  return [f for f in _FLAGS_OF_INTEREST if f in _cpuinfo()[1]]


def has_bf16_units() -> bool:
  """Whether the CPU has bfloat16 matrix instructions (AVX-512 BF16 or AMX). Without them XLA
  emulates bfloat16 products through float32 conversions."""
  return any(f in _cpuinfo()[1] for f in BF16_FLAGS)


# (normalized device-kind substring, {dtype: dense peak FLOP/s}), matched in this order: a more
# specific kind comes before the kinds whose names it contains ("h100 pcie" before "h100",
# "tpu v5 lite" before "tpu v5"). An empty table marks a kind known to have no figure here.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
  ("h100 pcie", {"bfloat16": 756e12, "float32": 51.2e12}),
  ("h100 nvl", {"bfloat16": 835.5e12, "float32": 60e12}),
  ("h100", {"bfloat16": 989.4e12, "float32": 66.9e12}),
  ("h200 nvl", {"bfloat16": 835.5e12, "float32": 60e12}),
  ("h200", {"bfloat16": 989.4e12, "float32": 66.9e12}),
  ("a100", {"bfloat16": 312e12, "float32": 19.5e12}),
  ("tpu v4 lite", {}),
  ("tpu v4", {"bfloat16": 275e12}),
  ("tpu v5 lite", {"bfloat16": 197e12}),
  ("tpu v5e", {"bfloat16": 197e12}),
  ("tpu v5p", {"bfloat16": 459e12}),
  ("tpu v5", {"bfloat16": 459e12}),
  ("tpu v6 lite", {"bfloat16": 918e12}),
  ("tpu v6e", {"bfloat16": 918e12}),
)


def normalize_kind(kind: str) -> str:
  """``kind`` lower-cased, with runs of spaces, ``-`` and ``_`` made one space: the form
  ``PEAK_FLOPS``' keys are written in ("NVIDIA A100-SXM4-80GB" -> "nvidia a100 sxm4 80gb")."""
  return re.sub(r"[\s_-]+", " ", kind.lower()).strip()


def peak_flops(device_kind: str, dtype: str) -> float | None:
  """The datasheet's dense peak matmul FLOP/s of ``device_kind`` for ``dtype`` inputs.

  Args:
    device_kind: a device's ``device_kind`` (``jax.devices()[0].device_kind``), any case.
    dtype: the products' input dtype name, "bfloat16" or "float32".

  Returns:
    FLOP/s, or None when the kind (a CPU, an unlisted accelerator) or its dtype is not in
    ``PEAK_FLOPS``.
  """
  kind = normalize_kind(device_kind)
  for key, rates in PEAK_FLOPS:
    if key in kind:
      return rates.get(str(dtype))
  return None


def device_kind() -> str:
  """The ``device_kind`` of the default backend's first device (e.g. "NVIDIA H100 80GB HBM3";
  "cpu" on CPU)."""

  return jax.devices()[0].device_kind


def share_gpu_memory() -> bool:
  """Lets another framework in this process (PyTorch) allocate GPU memory beside JAX.

  Unless ``XLA_PYTHON_CLIENT_PREALLOCATE`` is already set, sets it to "false", so that JAX's GPU
  client takes memory as it needs it instead of three quarters of the device at start. No effect
  on CPU and TPU.

  Returns:
    Whether JAX's backends start after this call and so follow the variable as it now is (False
    when they had already started: the setting they started with stays).
  """
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  try:
    from jax._src import xla_bridge  # noqa: PLC0415 - private jax module: may move or go

    return not xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):
    return False


# The side of the square product ``matmul_peak`` times where no datasheet figure is known.
PEAK_PROBE = 1024
# The file of measured matmul limits: "0" turns it off (each process measures for itself), a
# folder puts it there; default $XDG_CACHE_HOME/transformer_jax (~/.cache/transformer_jax).
LIMIT_CACHE_ENV = "TJAX_MATMUL_LIMIT_CACHE"
LIMIT_CACHE_FILE = "matmul_limits.json"


def limit_cache_path() -> str | None:
  """Where measured matmul limits are kept (``LIMIT_CACHE_ENV``), or None when turned off."""
  env = os.environ.get(LIMIT_CACHE_ENV)
  if env == "0":
    return None
  if env:
    return os.path.join(os.path.abspath(os.path.expanduser(env)), LIMIT_CACHE_FILE)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "transformer_jax", LIMIT_CACHE_FILE)


def limit_key(dtype: str) -> str:
  """What a measured limit holds for: this CPU (model, family, the flags that pick kernels), the
  CPUs this process may use, the JAX version and the products' dtype."""

  cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return (
    f"{cpu_name()} ({cpu_family()}); flags {' '.join(cpu_flags()) or '-'}; {cpus} CPUs; "
    f"jax {jax.__version__}; {dtype}"
  )


def _read_limits(path: str) -> dict:

  try:
    with open(path, "rb") as f:
      limits = json.loads(f.read())
  except (OSError, ValueError):  # absent or damaged: a cache, measured again
    return {}
  return limits if isinstance(limits, dict) else {}


def cached_limit(dtype: str) -> float | None:
  """This machine's cached matmul limit for ``dtype`` (FLOP/s), or None."""
  path = limit_cache_path()
  value = None if path is None else _read_limits(path).get(limit_key(dtype))
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
  return float(value) if ok and value != float("inf") else None


def store_limit(dtype: str, flops: float) -> bool:
  """Records ``flops`` as this machine's matmul limit for ``dtype`` where it is higher than the
  cached one (a limit only rises: a busy machine measures low, never high). Written atomically;
  a cache that cannot be written is left alone.

  Returns:
    Whether the file now holds ``flops``.
  """

  path = limit_cache_path()
  if path is None:
    return False
  limits = _read_limits(path)
  key = limit_key(dtype)
  old = limits.get(key)
  if isinstance(old, (int, float)) and not isinstance(old, bool) and old >= flops:
    return False
  limits[key] = float(flops)
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "w") as f:
      json.dump(limits, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError:
    if os.path.exists(tmp):
      os.remove(tmp)
    return False
  return True


def measure_matmul(dtype: str) -> float:
  """The best of five ``PEAK_PROBE``-square products in ``dtype`` (float32 accumulation) on the
  default device, in FLOP/s."""

  n = PEAK_PROBE
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
  product = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type=jnp.float32))
  product(a).block_until_ready()
  best = float("inf")
  for _ in range(5):
    start = time.perf_counter()
    product(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n**3 / best


def matmul_peak(dtype: str) -> tuple[float, str]:
  """The matmul rate of one of this process's devices that a training log's MFU is counted
  against: the datasheet peak (``peak_flops``) of a listed accelerator; else this machine's
  measured limit, measured once and cached per machine (``limit_cache_path``, keyed by
  ``limit_key``), so that a run started on a busy machine does not measure a low limit and report
  an MFU above 100%.

  Returns:
    ``(FLOP/s, source)``, source "datasheet", "measured" (now) or "cached" (measured before on
    this machine).
  """
  peak = peak_flops(device_kind(), str(dtype))
  if peak is not None:
    return peak, "datasheet"
  cached = cached_limit(str(dtype))
  if cached is not None:
    return cached, "cached"
  rate = measure_matmul(str(dtype))
  store_limit(str(dtype), rate)
  return rate, "measured"


def host_memory_available() -> int | None:
  """Bytes of host memory this process can still take: ``MemAvailable`` of ``/proc/meminfo``,
  lowered to the room left under a cgroup (v2) memory limit; None where neither is known."""
  out = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          out = int(line.split()[1]) * 1024
          break
  except (OSError, ValueError, IndexError):
    pass
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      used = int(f.read().strip())
    if limit != "max":
      room = max(0, int(limit) - used)
      out = room if out is None else min(out, room)
  except (OSError, ValueError):
    pass
  return out
