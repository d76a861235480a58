"""Backends: per platform, a frozen object whose methods are the kernels.

``current(table)`` is the backend of the platform JAX computes on, built from a kernel table
(``KernelTable``, the levers an experiment's ``kernels:`` section sets); ``for_platform(name,
table)`` builds any platform's (to ask what it would choose). Models are given one when they are
built (``models.create(config, backend=...)``; by default ``current()``) and hand it to their
layers, which call its methods:

  ===========================  =================================================================
  method                       what it is
  ===========================  =================================================================
  ``attention``                chooses the kernel (``ops.choose_implementation``'s rules with the
                               platform's facts) and calls it: ``"xla"`` / ``"chunked"``
                               (``ops``), ``"cudnn"`` (``cudnn``), ``"splash"`` (``splash``, per
                               device under a mesh), ``"ring"`` (``parallel.ring``)
  ``project``                  a projection's product (the decoding layout's, bfloat16's on CPU)
  ``vocab_head``               the tied vocabulary head, ``x @ E^T``
  ``linear_cross_entropy``     the fused vocabulary head and loss
  ``activate``                 the feed-forward activation between two products
  ``decode_layout``            a projection kernel in the platform's decoding layout
  ``unrolls_layers``           whether a small stack of layers runs unrolled
  ``step_compiler_options``    the train and eval steps' compile options (``jit_step``, ``hold``,
  ``decode_compiler_options``  ``microbatches``); the decoding loop's
  ===========================  =================================================================

The platforms: ``CpuBackend`` (``backends.cpu``: everything that exists only for XLA:CPU),
``GpuBackend``, ``TpuBackend``. ``jax.default_backend()`` is read here only (``platform``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from transformer_jax.backends.base import Backend, einsum_dims, padded_attend
  from transformer_jax.backends.compile import temp_bytes
  from transformer_jax.backends.cpu.backend import CpuBackend
  from transformer_jax.backends.gpu import GpuBackend
  from transformer_jax.backends.table import KernelTable
  from transformer_jax.backends.tpu import TpuBackend
  from transformer_jax.ops.dispatch import PLATFORMS

__all__ = [
  "PLATFORMS",
  "Backend",
  "CpuBackend",
  "GpuBackend",
  "KernelTable",
  "TpuBackend",
  "current",
  "einsum_dims",
  "for_platform",
  "padded_attend",
  "platform",
  "temp_bytes",
]

# Where each exported name lives. They are imported on first use, so that a process that only
# reads a module of one backend without computing (the ``tjax`` launcher's ``cpu.allocator``,
# which decides how to start the process before JAX is loaded) does not load JAX.
_EXPORTS = {
  "Backend": "transformer_jax.backends.base",
  "einsum_dims": "transformer_jax.backends.base",
  "padded_attend": "transformer_jax.backends.base",
  "temp_bytes": "transformer_jax.backends.compile",
  "CpuBackend": "transformer_jax.backends.cpu.backend",
  "GpuBackend": "transformer_jax.backends.gpu",
  "KernelTable": "transformer_jax.backends.table",
  "TpuBackend": "transformer_jax.backends.tpu",
  "PLATFORMS": "transformer_jax.ops.dispatch",
}


def __getattr__(name: str):
  """The names of ``_EXPORTS``, imported on first use."""
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
  return sorted({*globals(), *_EXPORTS})


def platform() -> str:
  """The platform JAX computes on: "cpu", "gpu" (CUDA or ROCm) or "tpu"."""
  import jax  # noqa: PLC0415 - see _EXPORTS

  backend = jax.default_backend()
  return "gpu" if backend in ("cuda", "rocm") else backend


def for_platform(name: str, table: KernelTable | None = None) -> Backend:
  """The backend of platform ``name`` ("cpu", "gpu" or "tpu") with kernel table ``table``
  (default: the library's defaults). A CPU backend reads this machine's CPU
  (``hardware.has_bf16_units``).

  Raises:
    ValueError: for an unknown platform.
  """
  # Imported here, not at the top: see _EXPORTS.
  from transformer_jax import hardware  # noqa: PLC0415
  from transformer_jax.backends.cpu.backend import CpuBackend  # noqa: PLC0415
  from transformer_jax.backends.gpu import GpuBackend  # noqa: PLC0415
  from transformer_jax.backends.table import KernelTable  # noqa: PLC0415
  from transformer_jax.backends.tpu import TpuBackend  # noqa: PLC0415
  from transformer_jax.ops.dispatch import PLATFORMS  # noqa: PLC0415

  table = KernelTable() if table is None else table
  match name:
    case "cpu":
      return CpuBackend(table, bf16_units=hardware.has_bf16_units())
    case "gpu":
      return GpuBackend(table)
    case "tpu":
      return TpuBackend(table)
    case _:
      raise ValueError(f"platform={name!r} must be one of {', '.join(map(repr, PLATFORMS))}")


def current(table: KernelTable | None = None) -> Backend:
  """The backend of the platform JAX computes on (``platform()``), with kernel table ``table``."""
  return for_platform(platform(), table)
