"""The kernel table: which implementation of ``ops.dot_product_attention``, which dense core and
which form of a projection's product run where.

``choose_implementation`` is the only place an attention kernel is chosen. ``implementation=None``
in ``ops.dot_product_attention``, the attention layers and ring attention all ask it. One row per
backend, read top to bottom (the first rule that applies wins):

  ========  =====================================================================================
  backend   kernel
  ========  =====================================================================================
  any       ``"ring"`` when the sequence is sharded over a mesh axis (self-attention without a
            bias, window or dropout); ``"xla"`` when the weights are asked for
  gpu       ``"cudnn"`` for bfloat16/float16 with head dim <= 128 (a multiple of 8): causal or
            bidirectional, MHA/MQA/GQA, padding, segment ids (as a mask; as packed sequences
            with ``CUDNN_PACKED_SEGMENTS``, see ``cudnn_packed_segments``), a causal sliding
            window; past that (float32, dropout, a position bias, decoding with T != S, a
            two-sided window): ``"xla"`` while the float32 scores fit ``DENSE_MAX_BYTES``, else
            ``"chunked"``
  tpu       ``"splash"`` (Pallas splash attention) for causal or bidirectional, a sliding window
            and segment ids, MHA/MQA/GQA, where ``T`` and ``S`` are multiples of its blocks and
            ``T * S >= SPLASH_MIN_TS``; short sequences and decoding: ``"xla"``; the rest as on
            GPUs
  cpu       ``"chunked"`` from ``AUTO_CHUNKED_MIN_TS`` query-key pairs up, else ``"xla"``;
            bfloat16 that the row-major core takes stays ``"xla"`` while its weights fit
            ``AUTO_DENSE_BF16_MAX_BYTES``
  ========  =====================================================================================

The CPU profile's pieces (``transformer_jax.cpu``) are reached from here only, on CPU only:

  ========================  =========================================================  =========
  question                  cpu                                                        gpu, tpu
  ========================  =========================================================  =========
  ``choose_dense_core``     ``"rowmajor"`` (``cpu.attention``) where                   ``"heads_
                            ``cpu.attention.rowmajor_core_takes`` q, k and v           major"``
  ``choose_product``        ``"weight_first"`` (``cpu.decode``) for at most            ``"padded"``
                            ``cpu.decode.SKINNY_ROWS`` rows of a weight stored         where
                            ``[out, in]``; ``"cpu_bf16"`` (``cpu.matmul``) where       ``PAD_COLS``
                            ``cpu.matmul.bf16_products_native``; else ``"einsum"``     asks, else
                                                                                       ``"einsum"``
  ========================  =========================================================  =========

``q``, ``k`` and ``v`` may be arrays or ``jax.ShapeDtypeStruct``s: only shapes and dtypes are read,
so the table can be asked what a planned run would use (``tjax train --dry-run``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

Implementation = Literal["xla", "chunked", "cudnn", "splash"]
Choice = Literal["xla", "chunked", "cudnn", "splash", "ring"]
DenseCore = Literal["heads_major", "rowmajor"]
Product = Literal["einsum", "cpu_bf16", "weight_first", "padded"]
PLATFORMS = ("cpu", "gpu", "tpu")

# Per platform: the output width of a product whose weight is stored [out, in] (a tied vocabulary
# table) is padded with zero rows to a multiple of this, and the padding sliced off the result, so
# that the GEMM and its transpose see aligned widths (XLA:GPU otherwise pads the [B*T, V] logits'
# gradient in a pass of its own). None here yet: experiments/gpu_levers.py's "vocab_pad_128"
# measures it on a GPU (experiments/PERFORMANCE.md, "Padded vocabulary product").
PAD_COLS: dict[str, int] = {}

# CPU: "chunked" from this many query-key pairs (T * S) up, "xla" below (experiments/
# PERFORMANCE.md, "Chunked attention on CPU").
AUTO_CHUNKED_MIN_TS = 768 * 768

# CPU, where the row-major core takes bfloat16 attention without dropout: "xla" past
# AUTO_CHUNKED_MIN_TS while its bfloat16 weights, B * N * T * S * 2 bytes, fit here
# (PERFORMANCE.md, "Row-major core").
AUTO_DENSE_BF16_MAX_BYTES = 64 << 20

# GPUs and TPUs, where the fused kernel does not apply: "xla" while one call's float32 scores,
# B * N * T * S * 4 bytes, fit here; "chunked" (O(T + S) memory) past it.
DENSE_MAX_BYTES = 1 << 30

# cuDNN's fused attention: the head dims it takes on every supported GPU.
CUDNN_MAX_HEAD_DIM = 128

# cuDNN's fused attention with segment ids: with M >= 2 here, self-attention whose rows hold at
# most M segments goes in as M packed sequences per row (cuDNN's ragged layout: no [B, 1, T, T]
# mask, whose bias cuDNN reads forward and backward), and rows with more take the mask, chosen on
# the device per call (a conditional that runtime.step_compiler_options keeps in XLA:GPU's CUDA
# graphs). 0: always the mask. Off until measured: experiments/gpu_levers.py's
# "packed_segments_16" measures it (experiments/PERFORMANCE.md, "Packed segments on cuDNN").
CUDNN_PACKED_SEGMENTS = 0

# TPU: below this many query-key pairs the dense kernel is as fast as splash and has no block
# constraint.
SPLASH_MIN_TS = 512 * 512


def _dense_or_chunked(q, k, *, max_bytes: int) -> str:
  b, t, n, _ = q.shape
  return "xla" if b * n * t * k.shape[1] * 4 <= max_bytes else "chunked"


def _cudnn_takes(q, k, *, causal, window, bias, dropout, mask, q_positions) -> bool:
  """The parts cuDNN's fused kernel takes through ``jax.nn.dot_product_attention``."""
  t, s, h = q.shape[1], k.shape[1], q.shape[3]
  if q.dtype not in (jnp.bfloat16, jnp.float16) or h > CUDNN_MAX_HEAD_DIM or h % 8:
    return False
  if dropout or bias or mask:
    return False
  if causal and (t != s or q_positions):   # cuDNN aligns its causal mask to the first key
    return False
  return window is None or causal          # its window looks back only


def cudnn_packed_segments(q, k, *, window: int | None, bias: bool, mask: bool, kv_valid: bool,
                          q_positions: bool, kv_segment_ids: bool) -> int:
  """How many packed sequences per row cuDNN takes segment ids as (0: as a dense mask).

  Packed needs self-attention (``T == S``, one set of segment ids) with as many key/value heads
  as query heads (jax's packed layout strides the keys by the query heads), causal or
  bidirectional, with segment ids as the only other mask part. ``ops.dot_product_attention``
  packs only on Hopper and later GPUs, which have cuDNN's ragged layout.
  """
  m = CUDNN_PACKED_SEGMENTS
  if m < 2 or kv_segment_ids or bias or mask or kv_valid or q_positions or window is not None:
    return 0
  if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
    return 0
  return m


def _splash_takes(q, k, *, causal, window, bias, dropout, mask, kv_valid, q_positions) -> bool:
  from transformer_jax.ops import splash   # noqa: PLC0415 - Pallas is imported only when asked

  t, s, h = q.shape[1], k.shape[1], q.shape[3]
  if dropout or bias or mask or kv_valid or q_positions or t * s < SPLASH_MIN_TS:
    return False
  if causal and t != s:
    return False
  return splash.splash_supports(t, s, h, q.dtype, causal=causal, window=window)


def choose_implementation(q, k, v, *, platform: str, causal: bool = False,
                          window: int | None = None, segment_ids: bool = False,
                          bias: bool = False, dropout: bool = False,
                          return_weights: bool = False, mask: bool = False,
                          kv_valid: bool = False, q_positions: bool = False,
                          sequence_shards: int = 1) -> Choice:
  """The attention kernel for these inputs on ``platform`` (see the module's table).

  Args:
    q: ``[B, T, N, H]`` queries (an array or a ``jax.ShapeDtypeStruct``).
    k: ``[B, S, K, H]`` keys.
    v: ``[B, S, K, H]`` values.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (``jax.default_backend()`` where it runs).
    causal: the causal mask is one of the parts.
    window: the sliding window's width, if any.
    segment_ids: segment ids (packed sequences) are given.
    bias: an additive bias (dense, or a position-bias function) is given.
    dropout: attention dropout is on.
    return_weights: the attention weights are asked for.
    mask: a dense boolean mask is given.
    kv_valid: a ``[B, S]`` key padding mask is given.
    q_positions: the queries' positions are given (decoding against a cache).
    sequence_shards: how many devices the sequence is split over (a mesh's ``sequence`` axis).

  Returns:
    ``"xla"``, ``"chunked"``, ``"cudnn"``, ``"splash"`` or ``"ring"`` (``parallel.ring``).

  Raises:
    ValueError: for an unknown platform.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r} must be one of {', '.join(map(repr, PLATFORMS))}")
  if return_weights:
    return "xla"
  if (sequence_shards > 1 and q.shape[1] == k.shape[1] and not (bias or mask or dropout)
      and window is None and not q_positions):
    return "ring"
  parts = dict(causal=causal, window=window, bias=bias, dropout=dropout, mask=mask,
               q_positions=q_positions)
  match platform:
    case "gpu":
      if _cudnn_takes(q, k, **parts):
        return "cudnn"
      return _dense_or_chunked(q, k, max_bytes=DENSE_MAX_BYTES)
    case "tpu":
      if _splash_takes(q, k, kv_valid=kv_valid, **parts):
        return "splash"
      return _dense_or_chunked(q, k, max_bytes=DENSE_MAX_BYTES)
    case _:
      b, t, n, _ = q.shape
      s = k.shape[1]
      if t * s < AUTO_CHUNKED_MIN_TS:
        return "xla"
      if (not dropout and b * n * t * s * 2 <= AUTO_DENSE_BF16_MAX_BYTES
          and choose_dense_core(q, k, v, platform=platform) == "rowmajor"):
        return "xla"
      return "chunked"


def choose_dense_core(q, k, v, *, platform: str) -> DenseCore:
  """The core of the dense (``"xla"``) kernel for these inputs on ``platform``: ``"rowmajor"``
  (``cpu.attention``, every product on XLA:CPU's bfloat16 kernel) where
  ``cpu.attention.rowmajor_core_takes`` them, else ``"heads_major"`` (``ops.attention``).

  Args:
    q: ``[B, T, N, H]`` queries (an array or a ``jax.ShapeDtypeStruct``).
    k: ``[B, S, K, H]`` keys.
    v: ``[B, S, K, H]`` values.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
  """
  if platform == "cpu":
    from transformer_jax.cpu import attention as cpu_attention  # noqa: PLC0415 - CPU only

    if cpu_attention.rowmajor_core_takes(q, k, v):
      return "rowmajor"
  return "heads_major"


def choose_product(dtype, *, rows: int | None = None, cols: int | None = None,
                   platform: str | None = None) -> Product:
  """How a projection computes its matrix product in ``dtype`` on ``platform``.

  Args:
    dtype: the product's compute dtype.
    rows: the product's rows, given where the weight is stored ``[out, in]`` (a tied embedding
      table): on CPU a few such rows multiply weight-first.
    cols: the product's output width, given with ``rows``: padded where ``PAD_COLS[platform]``
      is set and does not divide it.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``; default ``jax.default_backend()``.

  Returns:
    ``"weight_first"`` (``cpu.decode.weight_first``), ``"cpu_bf16"`` (``cpu.matmul.matmul``),
    ``"padded"`` (``layers.dense.padded_attend``) or ``"einsum"`` (see the module's table).
  """
  platform = jax.default_backend() if platform is None else platform
  multiple = PAD_COLS.get(platform)
  if multiple and rows is not None and cols is not None and cols % multiple:
    return "padded"
  if platform == "cpu":
    from transformer_jax.cpu import decode, matmul  # noqa: PLC0415 - CPU only

    if rows is not None and rows <= decode.SKINNY_ROWS:
      return "weight_first"
    if matmul.bf16_products_native(dtype):
      return "cpu_bf16"
  return "einsum"
