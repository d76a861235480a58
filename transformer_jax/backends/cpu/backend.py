"""The CPU backend: the kernels and compile options that exist for XLA:CPU (this package's modules),
as the methods of one ``Backend``.

  ============================  ==============================================================
  method                        on CPU
  ============================  ==============================================================
  ``attention``                 the table's kernel; the dense one's core row-major
                                (``attention.rowmajor_attention``) where it takes the inputs,
                                the chunked one in blocks of ``CPU_BLOCK``
  ``project``                   the decoding layout's weight-first product (``decode``); with
                                bf16 units, bfloat16 through ``matmul.matmul``; else an einsum
  ``vocab_head``                up to ``decode.SKINNY_ROWS`` rows weight-first; bfloat16 on
                                bf16 units through ``matmul.matmul``, float32 logits
  ``linear_cross_entropy``      x^T copied row-major (``matmul.transposed``)
  ``activate``                  bfloat16 on bf16 units: the inputs saved as bits
                                (``ops.packed_activation``)
  ``grouped_matmul``            blocks of one expert's rows (``grouped``), not ``ragged_dot``'s
                                masked product over every expert
  ``decode_layout``             ``decode.out_in_kernel``
  ``step_compiler_options``     each matrix product to oneDNN (``onednn.step_options``), held
                                (``onednn.hold``)
  ``microbatches``              "auto": ``microbatches.resolve_auto`` over mimalloc
  ============================  ==============================================================
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax.numpy as jnp

from transformer_jax import hardware, ops
from transformer_jax.backends.base import Backend, padded_attend, value
from transformer_jax.backends.cpu import (
  allocator,
  attention,
  decode,
  grouped,
  matmul,
  microbatches,
  onednn,
)

# The chunked attention kernel's blocks on XLA:CPU: a [B, N, 128, 128] float32 block of scores
# stays in the cores' own caches, and causal attention skips more of the pairs
# (experiments/PERFORMANCE.md, "Chunked attention on CPU").
CPU_BLOCK = 128

_warned_bf16 = False


@dataclasses.dataclass(frozen=True)
class CpuBackend(Backend):
  """XLA:CPU.

  Attributes:
    bf16_units: the CPU has bfloat16 matrix units (AVX-512 BF16 or AMX:
      ``hardware.has_bf16_units``): bfloat16 products then run natively, in the layouts
      ``matmul`` keeps.
    grouped_block: the most rows per block of the grouped product (``grouped``); None: the
      base backend's ``jax.lax.ragged_dot``.
  """

  bf16_units: bool = False
  grouped_block: int | None = grouped.BLOCK

  platform = "cpu"
  chunk_block = CPU_BLOCK

  def native(self, dtype) -> bool:
    """Whether products in ``dtype`` run on this CPU's bfloat16 units."""
    return jnp.dtype(dtype) == jnp.bfloat16 and self.bf16_units

  def dense_core(self, q, k, v):
    if attention.rowmajor_core_takes(q, k, v, bf16_units=self.bf16_units):
      return attention.rowmajor_attention
    return None

  def project(self, x, kernel, bias, *, einsum, n_in, dtype, merged=False):
    if isinstance(kernel, decode.OutInKernel):
      y = decode.project(kernel, x, n_in, dtype)
      if bias is not None:
        y = y + value(bias).astype(dtype)
      return y
    if self.native(dtype):
      # One [rows, in] @ [in, out] product, bias included (added in float32); the reshapes are
      # free: the contracted dims close x and lead the kernel.
      w = value(kernel)
      lead, k_in, out = x.shape[: x.ndim - n_in], math.prod(w.shape[:n_in]), w.shape[n_in:]
      b = None if bias is None else value(bias).reshape(-1)
      return matmul.matmul(
        x.reshape(*lead, k_in), w.reshape(k_in, -1), dtype=dtype, bias=b
      ).reshape(*lead, *out)
    return super().project(x, kernel, bias, einsum=einsum, n_in=n_in, dtype=dtype, merged=merged)

  def vocab_head(self, x_BTD, table, dtype):
    x_BTD = x_BTD.astype(dtype)
    table_VD = value(table).astype(dtype)
    b, t, d = x_BTD.shape
    multiple = self.table.pad_cols
    if multiple and table_VD.shape[0] % multiple:
      return padded_attend(x_BTD, table_VD, multiple)
    if b * t <= decode.SKINNY_ROWS:
      return decode.weight_first(table_VD, x_BTD.reshape(b * t, d)).reshape(b, t, -1)
    if self.native(dtype):
      # The logits kept in float32.
      return matmul.matmul(
        x_BTD, value(table), dtype=dtype, out_dtype=jnp.float32, transpose_w=True
      )
    return jnp.einsum("BTD,VD->BTV", x_BTD, table_VD)

  def linear_cross_entropy(self, x_ND, w, labels_N, weights_N=None, **kwargs):
    # A row-major copy of the small x chunk keeps a bfloat16 product in XLA:CPU's bf16 kernel.
    return ops.linear_cross_entropy(
      x_ND, w, labels_N, weights_N, x_transposed=matmul.transposed, **kwargs
    )

  def activate(self, activation, x, up=None, *, dtype):
    if self.native(dtype):
      # The projections are matmul.matmul (reverse mode only): the activation saves its input
      # as bits.
      return ops.packed_activation(activation, x, up)
    return super().activate(activation, x, up, dtype=dtype)

  def grouped_matmul(self, x_MK, w_EKN, group_sizes_E, *, dtype):
    """Blocks of up to ``grouped_block`` rows, each times its one expert's weight
    (``grouped.blocked_grouped_matmul``): the chosen experts' work, where XLA:CPU's
    ``ragged_dot`` multiplies every row by every expert (experiments/results/
    grouped_matmul_xeon.json)."""
    if self.grouped_block is None:
      return super().grouped_matmul(x_MK, w_EKN, group_sizes_E, dtype=dtype)
    return grouped.blocked_grouped_matmul(
      x_MK, value(w_EKN), group_sizes_E, dtype=dtype, max_block=self.grouped_block
    )

  def decode_layout(self, kernel, *, n_in, dtype, threads=None):
    """The kernel's read-only decoding-layout copy (``decode.out_in_kernel``: ``[out..., in...]``,
    multiplied weight-first, cut into pieces that share evenly over XLA's ``threads``); a kernel
    already in it as it is."""
    if isinstance(kernel, decode.OutInKernel):
      return kernel
    return decode.out_in_kernel(value(kernel), n_in, dtype, threads)

  def in_decode_layout(self, kernel) -> bool:
    return isinstance(kernel, decode.OutInKernel)

  def unrolls_layers(self, dtype) -> bool:
    """Small stacks run unrolled where the products go through ``matmul.matmul`` (bfloat16 on
    bf16 units): experiments/PERFORMANCE.md, "Unrolled layers"."""
    return self.native(dtype)

  def step_compiler_options(self) -> dict:
    """``onednn.step_options("cpu")`` (each matrix product to oneDNN; none with
    ``$TJAX_ONEDNN=0`` or a jaxlib that lacks the options), the table's ``step_options`` over
    them."""
    return {**onednn.step_options("cpu"), **dict(self.table.step_options)}

  def compiling(self):
    return onednn.quiet_uncacheable()

  def hold(self, compiled, options):
    return onednn.hold(compiled, options)

  def microbatches(self, setting, compile_step, batch_size, n_batch=1):
    """A number as given; "auto": the fewest microbatches that keep the step's temporaries
    within ``allocator.MIMALLOC_REUSE_LIMIT`` over mimalloc (``microbatches.resolve_auto``), 1
    on another allocator. The compilations run inside ``onednn.quiet_uncacheable``."""
    with self.compiling():
      if setting != "auto":
        return setting, compile_step(setting)
      return microbatches.resolve_auto(
        compile_step, batch_size, n_batch, platform="cpu", malloc=allocator.allocator()
      )

  def scratch_notice(self, temp_bytes):
    return allocator.scratch_notice(temp_bytes, platform="cpu", malloc=allocator.allocator())

  def bf16_notice(self, dtype):
    """When ``dtype`` is bfloat16 on a CPU without bfloat16 matrix units, warns once that it will
    be slower than float32, and why. Returns the text (None when there is nothing to say)."""
    global _warned_bf16
    if str(jnp.dtype(dtype)) != "bfloat16" or self.bf16_units:
      return None
    text = (
      f"dtype=bfloat16 on {hardware.cpu_name() or 'this CPU'}, which has no bfloat16 "
      "matrix instructions (avx512_bf16/amx_bf16): XLA converts every bfloat16 dot to "
      "float32 and back, so this runs slower than dtype=float32 (about 0.6x the matmul "
      "rate here); use float32 on this machine, bfloat16 on CPUs with AVX-512 BF16 or AMX, "
      "or on accelerators."
    )
    if not _warned_bf16:
      _warned_bf16 = True
      warnings.warn(text, stacklevel=3)
    return text
