"""Process-level settings every backend has: the persistent compilation cache, the compile options
of the train and eval steps and of the decoding loop (one table per backend), and the notice when
bfloat16 would be slower than float32 on this CPU.

What exists only for XLA:CPU lives in ``transformer_jax.cpu``: the mimalloc launcher
(``cpu.allocator``), the steps' oneDNN options and ``hold`` (``cpu.onednn``), idle CPUs that poll
while decoding (``cpu.poll``) and the microbatch rule (``cpu.microbatches``).

``tjax`` applies them (the trainer gives the notices). A library user calls
``enable_compilation_cache()`` once (the trainer does it too); to run over mimalloc, starts their
program with the environment ``cpu.allocator.allocator_env()`` returns (a running process cannot
change its allocator); and may wrap decoding in ``with cpu.poll.cpu_poll():``.
"""

from __future__ import annotations

import os
import warnings

from transformer_jax.cpu import onednn as _onednn
from transformer_jax.ops import dispatch as _dispatch

CACHE_ENV = "TJAX_COMPILATION_CACHE"   # a folder, or "0" to turn the cache off


def default_cache_dir() -> str:
  """``$TJAX_COMPILATION_CACHE``, else ``$XDG_CACHE_HOME/transformer_jax/xla`` (``~/.cache/...``)."""
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
  import jax

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


# XLA:GPU compile options of the train and eval steps (``step_compiler_options("gpu")``) and of the
# decoding loop (``decode_compiler_options``): experiments/PERFORMANCE.md, "XLA:GPU options".
GPU_STEP_OPTIONS: dict = {"xla_gpu_enable_triton_gemm": False}
GPU_DECODE_OPTIONS: dict = {"xla_gpu_enable_triton_gemm": False}

# With segment ids packed for cuDNN (``ops.dispatch.CUDNN_PACKED_SEGMENTS``) each attention picks
# its kernel in a conditional, which XLA:GPU otherwise runs outside its CUDA graphs, the host
# waiting for the predicate. XLA's default command-buffer types (jax 0.10 and 0.11) plus
# CONDITIONAL: compile options take the list itself, not the flag's "+CONDITIONAL".
GPU_COMMAND_BUFFERS_WITH_CONDITIONALS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL"


def step_compiler_options(platform: str) -> dict:
  """Compile options for the train and eval steps on ``platform`` (a device's ``.platform``).

  Returns:
    A new dict: ``GPU_STEP_OPTIONS`` on "gpu" (with ``GPU_COMMAND_BUFFERS_WITH_CONDITIONALS``
    while ``ops.dispatch.CUDNN_PACKED_SEGMENTS`` is on); on "cpu" ``cpu.onednn.step_options``
    (each matrix product to oneDNN; none with ``$TJAX_ONEDNN=0`` or a jaxlib that lacks the
    options); none elsewhere. Pass them as ``jax.jit(..., compiler_options=...)`` (they are part
    of the persistent cache's key) and pass what you compile with them to ``cpu.onednn.hold``.
    Asking for them changes nothing in the process.
  """
  if platform == "gpu":
    options = dict(GPU_STEP_OPTIONS)
    if _dispatch.CUDNN_PACKED_SEGMENTS:
      options.setdefault("xla_gpu_enable_command_buffer", GPU_COMMAND_BUFFERS_WITH_CONDITIONALS)
    return options
  return _onednn.step_options(platform)


def decode_compiler_options(platform: str) -> dict:
  """Compile options for ``generate``'s decoding loop on ``platform``: ``GPU_DECODE_OPTIONS`` on
  GPUs, none elsewhere."""
  return dict(GPU_DECODE_OPTIONS) if platform == "gpu" else {}


def temp_bytes(compiled) -> int | None:
  """A compiled program's temporaries in bytes (``memory_analysis()``), or None where XLA does
  not say."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)


_warned_bf16 = False


def bf16_notice(dtype: str) -> str | None:
  """When ``dtype`` is bfloat16 and the computation runs on a CPU without bfloat16 matrix units
  (AVX-512 BF16 or AMX), warns once that it will be slower than float32, and why. Returns the text
  (None when there is nothing to say)."""
  global _warned_bf16
  import jax

  from transformer_jax import hardware

  if str(dtype) != "bfloat16" or jax.default_backend() != "cpu" or hardware.has_bf16_units():
    return None
  text = (f"dtype=bfloat16 on {hardware.cpu_name() or 'this CPU'}, which has no bfloat16 matrix "
          "instructions (avx512_bf16/amx_bf16): XLA converts every bfloat16 dot to float32 and "
          "back, so this runs slower than dtype=float32 (about 0.6x the matmul rate here); use "
          "float32 on this machine, bfloat16 on CPUs with AVX-512 BF16 or AMX, or on "
          "accelerators.")
  if not _warned_bf16:
    _warned_bf16 = True
    warnings.warn(text, stacklevel=2)
  return text
