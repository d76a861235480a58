"""Compile options per backend, and what a compiled program says about its memory.

The option sets are read-only: a run changes them through its kernel table's ``step_options`` and
``decode_options`` (``backends.KernelTable``), which the backend lays over them.
"""

from __future__ import annotations

import types

# XLA:GPU compile options of the train and eval steps (``GpuBackend.step_compiler_options``) and
# of the decoding loop (``decode_compiler_options``): experiments/PERFORMANCE.md, "XLA:GPU
# options".
GPU_STEP_OPTIONS = types.MappingProxyType({"xla_gpu_enable_triton_gemm": False})
GPU_DECODE_OPTIONS = types.MappingProxyType({"xla_gpu_enable_triton_gemm": False})

# With segment ids packed for cuDNN (``KernelTable.cudnn_packed_segments``) each attention picks
# its kernel in a conditional, which XLA:GPU otherwise runs outside its CUDA graphs, the host
# waiting for the predicate. XLA's default command-buffer types (jax 0.10 and 0.11) plus
# CONDITIONAL: compile options take the list itself, not the flag's "+CONDITIONAL".
GPU_COMMAND_BUFFERS_WITH_CONDITIONALS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL"


def temp_bytes(compiled) -> int | None:
  """A compiled program's temporaries in bytes (``memory_analysis()``), or None where XLA does
  not say."""
  analysis = compiled.memory_analysis()
  return None if analysis is None else int(analysis.temp_size_in_bytes)
