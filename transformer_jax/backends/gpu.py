"""The GPU backend: cuDNN's fused attention where the table chooses it, XLA:GPU's compile options,
small layer stacks unrolled."""

from __future__ import annotations

import dataclasses

from transformer_jax.backends import compile as compile_lib
from transformer_jax.backends.base import Backend


@dataclasses.dataclass(frozen=True)
class GpuBackend(Backend):
  """NVIDIA (and ROCm) GPUs through XLA:GPU."""

  platform = "gpu"

  def unrolls_layers(self, dtype) -> bool:
    """Small stacks run unrolled: the step skips the scan's stacking of each layer's residuals
    and gradients (experiments/PERFORMANCE.md, "Unrolled layers")."""
    del dtype
    return True

  def step_compiler_options(self) -> dict:
    """``compile.GPU_STEP_OPTIONS``, with the conditionals in the CUDA graphs while the table
    packs segment ids for cuDNN (``cudnn_packed_segments``), the table's ``step_options`` over
    them."""
    options = dict(compile_lib.GPU_STEP_OPTIONS)
    if self.table.cudnn_packed_segments:
      options.setdefault(
        "xla_gpu_enable_command_buffer", compile_lib.GPU_COMMAND_BUFFERS_WITH_CONDITIONALS
      )
    options.update(self.table.step_options)
    return options

  def decode_compiler_options(self) -> dict:
    """``compile.GPU_DECODE_OPTIONS`` with the table's ``decode_options`` over them."""
    return {**compile_lib.GPU_DECODE_OPTIONS, **dict(self.table.decode_options)}
