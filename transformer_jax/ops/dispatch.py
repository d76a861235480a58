"""The rules of the attention kernel table: which implementation fits these inputs on a platform.

``choose_implementation`` is a pure function of shapes, dtypes, the mask's parts and the platform:
it reads no hardware and runs nothing, so it can be asked what a planned run would use on any
backend (``tjax train --dry-run``). The kernels themselves, and the facts only a platform knows
(whether this CPU's row-major core takes bfloat16), are the backend's: ``transformer_jax.backends``
chooses with these rules and calls the kernel in one place (``Backend.attention``). One row per
backend, read top to bottom (the first rule that applies wins):

  ========  =====================================================================================
  backend   kernel
  ========  =====================================================================================
  any       ``"ring"`` when the sequence is sharded over a mesh axis (self-attention without a
            bias, window, soft-cap or dropout); ``"xla"`` when the weights are asked for; with
            a logits soft-cap (Gemma 2) on GPU, ``"xla"`` or ``"chunked"`` as by
            ``DENSE_MAX_BYTES`` (cuDNN's fused kernel has no soft-cap; splash takes one, as
            ``attn_logits_soft_cap``)
  gpu       ``"cudnn"`` for bfloat16/float16 with head dim <= 128 (a multiple of 8): causal or
            bidirectional, MHA/MQA/GQA, padding, segment ids, a causal sliding window; past that
            (float32, dropout, a position bias, decoding with T != S, a two-sided window):
            ``"xla"`` while the float32 scores fit ``DENSE_MAX_BYTES``, else ``"chunked"``
  tpu       ``"splash"`` (Pallas splash attention) for causal or bidirectional, a sliding window
            and segment ids, MHA/MQA/GQA, where ``T`` and ``S`` are multiples of ``LANES`` and
            ``T * S >= SPLASH_MIN_TS``; short sequences and decoding: ``"xla"``; the rest as on
            GPUs
  cpu       ``"chunked"`` from ``AUTO_CHUNKED_MIN_TS`` query-key pairs up, else ``"xla"``;
            bfloat16 that the row-major core takes (``rowmajor_core``) stays ``"xla"`` while its
            weights fit ``AUTO_DENSE_BF16_MAX_BYTES``
  ========  =====================================================================================

``q``, ``k`` and ``v`` may be arrays or ``jax.ShapeDtypeStruct``s: only shapes and dtypes are read.
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
import numpy as np

Implementation = Literal["xla", "chunked", "cudnn", "splash"]
Choice = Literal["xla", "chunked", "cudnn", "splash", "ring"]
PLATFORMS = ("cpu", "gpu", "tpu")

# CPU: "chunked" from this many query-key pairs (T * S) up, "xla" below (experiments/
# PERFORMANCE.md, "Chunked attention on CPU").
AUTO_CHUNKED_MIN_TS = 768 * 768

# CPU, where the row-major core takes bfloat16 attention without dropout: "xla" past
# AUTO_CHUNKED_MIN_TS while its bfloat16 weights, B * N * T * S * 2 bytes, fit here
# (PERFORMANCE.md, "Row-major core").
AUTO_DENSE_BF16_MAX_BYTES = 64 << 20

# GPUs and TPUs, where the fused kernel does not apply, and ``ops.dot_product_attention``'s own
# choice: "xla" while one call's float32 scores, B * N * T * S * 4 bytes, fit here; "chunked"
# (O(T + S) memory) past it.
DENSE_MAX_BYTES = 1 << 30

# cuDNN's fused attention: the head dims it takes on every supported GPU.
CUDNN_MAX_HEAD_DIM = 128

# TPU: below this many query-key pairs the dense kernel is as fast as splash and has no block
# constraint.
SPLASH_MIN_TS = 512 * 512

# Splash attention's lane width (``NUM_LANES`` in splash_attention_kernel.py): its key/value
# blocks, and its query blocks where segment ids are transposed into lanes, are multiples of it.
LANES = 128
_SPLASH_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def dense_or_chunked(q, k, *, max_bytes: int | None = None) -> Literal["xla", "chunked"]:
  """``"xla"`` while the call's float32 ``[B, N, T, S]`` scores fit ``max_bytes`` (default
  ``DENSE_MAX_BYTES``), else ``"chunked"``."""
  max_bytes = DENSE_MAX_BYTES if max_bytes is None else max_bytes
  b, t, n, _ = q.shape
  return "xla" if b * n * t * k.shape[1] * 4 <= max_bytes else "chunked"


def empty_rows(t: int, s: int, causal: bool, window: int | None) -> bool:
  """Whether causal / window leave some query (at ``S - T + i``) without any key."""
  if causal:
    return t > s
  return window is not None and t - s >= window


def splash_supports(
  t: int, s: int, h: int, dtype, *, causal: bool = False, window: int | None = None
) -> bool:
  """Whether splash attention takes these sizes with its default block sizes.

  Args:
    t: query length T.
    s: key/value length S.
    h: head dim H.
    dtype: dtype of q, k and v.
    causal: the causal mask is one of the parts.
    window: the sliding window's width, if any.

  Returns:
    True when T and S are positive multiples of ``LANES`` (every block is), H is positive (the
    kernel pads a head dim that is not a multiple of 128 to one), the dtype is float32 or
    bfloat16, and causal / window leave every query at least one key (they do when ``T <= S``;
    splash gives no defined output for a query without keys).
  """
  if t <= 0 or s <= 0 or t % LANES or s % LANES or h <= 0:
    return False
  try:
    if np.dtype(dtype) not in _SPLASH_DTYPES:
      return False
  except TypeError:
    return False
  return not empty_rows(t, s, causal, window)


def _cudnn_takes(q, k, *, causal, window, bias, dropout, mask, q_positions) -> bool:
  """The parts cuDNN's fused kernel takes through ``jax.nn.dot_product_attention``."""
  t, s, h = q.shape[1], k.shape[1], q.shape[3]
  if q.dtype not in (jnp.bfloat16, jnp.float16) or h > CUDNN_MAX_HEAD_DIM or h % 8:
    return False
  if dropout or bias or mask:
    return False
  if causal and (t != s or q_positions):  # cuDNN aligns its causal mask to the first key
    return False
  return window is None or causal  # its window looks back only


def _splash_takes(q, k, *, causal, window, bias, dropout, mask, kv_valid, q_positions) -> bool:
  t, s, h = q.shape[1], k.shape[1], q.shape[3]
  if dropout or bias or mask or kv_valid or q_positions or t * s < SPLASH_MIN_TS:
    return False
  if causal and t != s:
    return False
  return splash_supports(t, s, h, q.dtype, causal=causal, window=window)


def choose_implementation(
  q,
  k,
  v,
  *,
  platform: str,
  causal: bool = False,
  window: int | None = None,
  segment_ids: bool = False,
  bias: bool = False,
  dropout: bool = False,
  return_weights: bool = False,
  mask: bool = False,
  kv_valid: bool = False,
  q_positions: bool = False,
  sequence_shards: int = 1,
  rowmajor_core: bool = False,
  softcap: bool = False,
) -> Choice:
  """The attention kernel for these inputs on ``platform`` (see the module's table).

  Args:
    q: ``[B, T, N, H]`` queries (an array or a ``jax.ShapeDtypeStruct``).
    k: ``[B, S, K, H]`` keys.
    v: ``[B, S, K, H]`` values.
    platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
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
    rowmajor_core: on CPU, the row-major dense core takes these inputs (bfloat16 on a CPU with
      bf16 units: ``backends.cpu.attention.rowmajor_core_takes``, which the CPU backend asks).
    softcap: the attention logits are soft-capped ("xla", "chunked" and "splash" take one).

  Returns:
    ``"xla"``, ``"chunked"``, ``"cudnn"``, ``"splash"`` or ``"ring"`` (``parallel.ring``).

  Raises:
    ValueError: for an unknown platform.
  """
  if platform not in PLATFORMS:
    raise ValueError(f"platform={platform!r} must be one of {', '.join(map(repr, PLATFORMS))}")
  if return_weights:
    return "xla"
  if (
    sequence_shards > 1
    and q.shape[1] == k.shape[1]
    and not (bias or mask or dropout)
    and window is None
    and not q_positions
    and not softcap
  ):
    return "ring"
  parts = dict(
    causal=causal, window=window, bias=bias, dropout=dropout, mask=mask, q_positions=q_positions
  )
  if softcap and platform == "gpu":
    return dense_or_chunked(q, k)
  match platform:
    case "gpu":
      if _cudnn_takes(q, k, **parts):
        return "cudnn"
      return dense_or_chunked(q, k)
    case "tpu":
      if _splash_takes(q, k, kv_valid=kv_valid, **parts):
        return "splash"
      return dense_or_chunked(q, k)
    case _:
      b, t, n, _ = q.shape
      s = k.shape[1]
      if t * s < AUTO_CHUNKED_MIN_TS:
        return "xla"
      if not dropout and b * n * t * s * 2 <= AUTO_DENSE_BF16_MAX_BYTES and rowmajor_core:
        return "xla"
      return "chunked"
