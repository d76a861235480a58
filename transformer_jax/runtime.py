"""Process-level settings: the persistent compilation cache, and the notice when bfloat16 would be
slower than float32 here.

The compile options of the train and eval steps and of the decoding loop are the backend's
(``backends.current(table).step_compiler_options()``, ``decode_compiler_options()``), and so is what
exists only for XLA:CPU (``backends.cpu``: the mimalloc launcher, the steps' oneDNN options and
``hold``, idle CPUs that poll while decoding, the microbatch rule).

``tjax`` applies them (the trainer gives the notices). A library user calls
``enable_compilation_cache()`` once (the trainer does it too); to run over mimalloc, starts their
program with the environment ``backends.cpu.allocator.allocator_env()`` returns (a running process
cannot change its allocator); and may wrap decoding in ``with backends.cpu.poll.cpu_poll():``.
"""

from __future__ import annotations

import os

import jax

from transformer_jax import backends
from transformer_jax.backends.compile import temp_bytes

__all__ = [
  "CACHE_ENV",
  "bf16_notice",
  "default_cache_dir",
  "enable_compilation_cache",
  "temp_bytes",
]

CACHE_ENV = "TJAX_COMPILATION_CACHE"  # a folder, or "0" to turn the cache off


def default_cache_dir() -> str:
  """``$TJAX_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax/xla``
  (``~/.cache/...``)."""
  env = os.environ.get(CACHE_ENV)
  if env and env != "0":
    return os.path.abspath(os.path.expanduser(env))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "transformer_jax", "xla")


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns on JAX's persistent compilation cache in ``path`` (default ``default_cache_dir()``), so a
  second run of the same program loads its compiled steps instead of compiling them again.

  Returns the folder, or None when ``$TJAX_COMPILATION_CACHE=0``, the user already chose a folder
  (``jax_compilation_cache_dir``), or the folder cannot be created (then nothing changes: a cache
  is an optimisation, never a reason to fail).
  """

  if os.environ.get(CACHE_ENV) == "0":
    return None
  if jax.config.jax_compilation_cache_dir:
    return jax.config.jax_compilation_cache_dir
  path = path or default_cache_dir()
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  # Cache every step that took over a second to compile (JAX's default skips nothing larger).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
  return path


def bf16_notice(dtype: str) -> str | None:
  """When ``dtype`` is bfloat16 and the computation runs on a CPU without bfloat16 matrix units
  (AVX-512 BF16 or AMX), warns once that it will be slower than float32, and why
  (``Backend.bf16_notice``). Returns the text (None when there is nothing to say)."""
  return backends.current().bf16_notice(dtype)
