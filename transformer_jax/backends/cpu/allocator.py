"""The ``tjax`` launcher's allocator: mimalloc preloaded into a process that computes on CPU.

Why: XLA:CPU allocates every step's temporaries afresh, and glibc hands such large blocks back to
the kernel at once, so every step maps and zeroes the same pages again; mimalloc told to keep freed
memory (``MIMALLOC_PURGE_DELAY=-1``) reuses them. A running process cannot change its allocator,
so the launcher runs itself again with mimalloc preloaded (``allocator_env``).

mimalloc comes with the ``cpu`` extra (``pip install 'transformer-jax[cpu]'``, the
``cmeel-mimalloc`` wheel, Linux only). Without it everything works on the system allocator, and
the launcher says so once (``system_allocator_notice``).

The decision is taken before JAX starts, from what is known then (``computes_on_cpu``): a process
that will compute on a GPU or TPU keeps the system allocator.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable, Mapping

MALLOC_ENV = "TJAX_MALLOC"  # "0"/"system"/"glibc": keep the C library's malloc; "mimalloc": always
_OFF = ("0", "system", "glibc")
_FORCED = ("mimalloc",)

# The Python modules of JAX's accelerator plugins: when one can be imported, JAX computes on that
# accelerator unless JAX_PLATFORMS says otherwise. ``jax_plugins`` is the namespace package every
# PJRT plugin (CUDA, ROCm, Metal, ...) installs itself under.
ACCELERATOR_PLUGINS = (
  "jax_cuda12_plugin",
  "jax_cuda13_plugin",
  "jax_rocm60_plugin",
  "jax_rocm7_plugin",
  "libtpu",
  "jax_plugins",
)

# mimalloc keeps freed blocks for reuse up to about this size; XLA:CPU takes a step's temporaries
# as one block, so a step whose temporaries pass it maps fresh memory at every call.
MIMALLOC_REUSE_LIMIT = 2000 << 20

EXTRA_HINT = "pip install 'transformer-jax[cpu]'"


def computes_on_cpu(
  environ: Mapping[str, str] | None = None,
  *,
  find_spec: Callable[[str], object] = importlib.util.find_spec,
) -> bool:
  """Whether a process started with ``environ`` will compute on CPU, decided before JAX starts.

  ``JAX_PLATFORMS``, when set, decides: its first platform is the one JAX computes on. Otherwise
  the process computes on CPU unless one of ``ACCELERATOR_PLUGINS`` can be imported (a machine
  with a plugin but no device falls back to CPU in JAX; the launcher then keeps the system
  allocator, and ``TJAX_MALLOC=mimalloc`` asks for mimalloc anyway).

  Args:
    environ: the environment (default ``os.environ``).
    find_spec: ``importlib.util.find_spec`` or a stand-in: returns None for a module that cannot be
      imported.
  """
  env = os.environ if environ is None else environ
  platforms = [p.strip().lower() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:
    return platforms[0] == "cpu"
  for name in ACCELERATOR_PLUGINS:
    try:
      if find_spec(name) is not None:
        return False
    except (ImportError, ValueError):
      continue
  return True


def mimalloc_path() -> str | None:
  """The ``libmimalloc.so`` of the ``cmeel-mimalloc`` wheel (the ``cpu`` extra), if installed."""
  for entry in sys.path:
    lib = os.path.join(entry, "cmeel.prefix", "lib", "libmimalloc.so")
    if os.path.exists(lib):
      return lib
  return None


def malloc_setting(environ: Mapping[str, str] | None = None) -> str:
  """``TJAX_MALLOC`` lower-cased ("" when unset or empty).

  Raises:
    ValueError: a value other than "0", "system", "glibc" or "mimalloc" (any case), naming it.
  """
  env = os.environ if environ is None else environ
  raw = env.get(MALLOC_ENV, "")
  setting = raw.strip().lower()
  if setting and setting not in _OFF + _FORCED:
    raise ValueError(
      f"{MALLOC_ENV}={raw!r} must be one of {', '.join(map(repr, _OFF + _FORCED))}"
      " (or unset: mimalloc when the process computes on CPU)"
    )
  return setting


def _wants_mimalloc(env: Mapping[str, str], find_spec) -> bool:
  """Whether a process with ``env`` should run over mimalloc: on Linux, no malloc preloaded yet,
  not turned off, and computing on CPU (or asked for with ``TJAX_MALLOC=mimalloc``)."""
  setting = malloc_setting(env)
  if setting in _OFF or sys.platform != "linux" or "malloc" in env.get("LD_PRELOAD", ""):
    return False
  return setting in _FORCED or computes_on_cpu(env, find_spec=find_spec)


def allocator_env(
  environ: Mapping[str, str] | None = None,
  *,
  find_spec: Callable[[str], object] = importlib.util.find_spec,
) -> dict[str, str] | None:
  """The environment that runs this program again over mimalloc.

  Args:
    environ: the environment (default ``os.environ``).
    find_spec: as for ``computes_on_cpu``.

  Returns:
    ``environ`` with mimalloc first in ``LD_PRELOAD`` (a user's own preload is kept after it),
    ``MIMALLOC_PURGE_DELAY=-1`` unless set, and ``TJAX_MALLOC=mimalloc``; or None when it already
    runs over a preloaded malloc, ``TJAX_MALLOC`` is "0", "system" or "glibc", this is not Linux,
    the process will not compute on CPU (``computes_on_cpu``; ``TJAX_MALLOC=mimalloc`` overrides),
    or mimalloc is not installed.

  Raises:
    ValueError: an unknown ``TJAX_MALLOC`` value (``malloc_setting``).
  """
  env = dict(os.environ if environ is None else environ)
  if not _wants_mimalloc(env, find_spec):
    return None
  lib = mimalloc_path()
  if lib is None:
    return None
  env["LD_PRELOAD"] = f"{lib} {env['LD_PRELOAD']}".strip() if env.get("LD_PRELOAD") else lib
  env.setdefault("MIMALLOC_PURGE_DELAY", "-1")
  env[MALLOC_ENV] = "mimalloc"
  return env


def system_allocator_notice(
  environ: Mapping[str, str] | None = None,
  *,
  find_spec: Callable[[str], object] = importlib.util.find_spec,
) -> str | None:
  """The launcher's one line when a process that would run over mimalloc (``allocator_env``)
  cannot, because mimalloc is not installed; None otherwise."""
  env = os.environ if environ is None else environ
  if not _wants_mimalloc(env, find_spec) or mimalloc_path() is not None:
    return None
  return (
    f"tjax: running on the system allocator; mimalloc makes CPU training steps faster "
    f"({EXTRA_HINT}; {MALLOC_ENV}=system silences this)"
  )


def allocator() -> str:
  """The malloc preloaded into this process (``LD_PRELOAD``), or ``"glibc"``."""
  pre = os.environ.get("LD_PRELOAD", "")
  for name in ("jemalloc", "tcmalloc", "mimalloc"):
    if name in pre:
      return name
  return "glibc"


def scratch_notice(
  temp_bytes: int | None, *, platform: str, malloc: str, limit: int | None = None
) -> str | None:
  """A one-line notice when one compiled step's temporaries are larger than what mimalloc keeps
  for reuse on CPU.

  Args:
    temp_bytes: the step's temporaries (``memory_analysis().temp_size_in_bytes``), or None.
    platform: the step's device platform; off "cpu" there is never a notice.
    malloc: this process's allocator (``allocator()``); only "mimalloc" has the limit.
    limit: the reuse limit in bytes (default ``MIMALLOC_REUSE_LIMIT``).

  Returns:
    The notice, or None when the temporaries fit, are unknown, or the limit does not apply.
  """
  limit = MIMALLOC_REUSE_LIMIT if limit is None else limit
  if temp_bytes is None or platform != "cpu" or malloc != "mimalloc":
    return None
  if temp_bytes <= limit:
    return None
  return (
    f"notice: one training step needs {temp_bytes / 2**30:.2f} GiB of temporaries, more "
    f"than the {limit / 2**30:.2f} GiB that mimalloc reuses between steps on "
    "CPU, so every step maps fresh memory (it can double the step's time); "
    "train.microbatches or a smaller train.batch_size brings it under"
  )
