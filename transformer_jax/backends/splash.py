"""Splash attention: JAX's Pallas TPU kernel (``jax.experimental.pallas.ops.tpu.splash_attention``)
behind the project's ``[B, T, N, H]`` layout.

``attention`` is the backends' entry (the mask parts of ``ops.dot_product_attention``, refusing the
ones splash does not take); ``backends.per_device`` gives each device its rows and heads.
``ops.dispatch.splash_supports`` says which sizes it takes.

Shape letters as in ``ops.attention``: B batch, T query length, S key/value length, N query heads,
K key/value heads, G = N // K query heads per key/value head, H head dim.

The kernel takes one sequence at a time with heads leading (q ``[N, T, H]``, k/v ``[K, S, H]``,
query head ``n`` reading key/value head ``n // G``), so grouped-query and multi-query attention need
no copies of k and v; ``splash_attention`` moves the heads in front and maps the kernel over the
batch. Its mask is static and per head: ``causal`` and ``window`` become one of splash's computable
masks (evaluated inside the kernel from positions, with fully masked blocks skipped), and segment
ids, the only per-example part, go in as splash's ``SegmentIds``. Keys sit at positions
``0 .. S-1`` and queries at ``S - T .. S - 1`` (aligned to the end of the keys, as in
``ops.masks``).

On TPUs the kernel is compiled by Mosaic; elsewhere (``interpret=True``, the default off TPU) Pallas
runs the same kernel body through XLA, which is slow and meant for tests. The Pallas modules are
imported when the function is first called, so this module imports wherever JAX does.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.ops import attention as attention_ops
from transformer_jax.ops.attention import check_qkv
from transformer_jax.ops.dispatch import LANES, empty_rows, splash_supports

# Largest block (query rows or keys) that the default block sizes use.
DEFAULT_BLOCK = 512

_KERNEL_MODULE = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"
_MASK_MODULE = "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask"
_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def _splash_modules() -> tuple[Any, Any]:
  """``(splash_attention_kernel, splash_attention_mask)``, imported on first use."""
  try:
    return importlib.import_module(_KERNEL_MODULE), importlib.import_module(_MASK_MODULE)
  except Exception as e:  # ImportError, or a Pallas TPU piece failing at import time
    raise ImportError(
      f"splash attention needs {_KERNEL_MODULE} and {_MASK_MODULE}, which failed to import with "
      f"jax {jax.__version__} ({type(e).__name__}: {e}); use implementation='chunked' or 'xla'"
    ) from e


def _default_block(length: int, name: str) -> int:
  """The largest multiple of ``LANES`` up to ``DEFAULT_BLOCK`` that divides ``length``."""
  if length % LANES:
    raise ValueError(
      f"splash attention needs {name} to be a multiple of {LANES}; got {name}={length}"
    )
  return max(b for b in range(LANES, min(DEFAULT_BLOCK, length) + 1, LANES) if length % b == 0)


def _check_block(value: int | None, field: str, length: int, name: str) -> None:
  if value is None:
    return
  if not isinstance(value, (int, np.integer)) or value <= 0 or value % LANES or length % value:
    raise ValueError(
      f"block size {field}={value} must be a positive multiple of {LANES} that divides "
      f"{name}={length}"
    )


def _block_sizes(splash_kernel: Any, block_sizes: Any, t: int, s: int) -> Any:
  """Splash ``BlockSizes`` for forward and backward, checked against T and S."""
  if block_sizes is None:
    block_q, block_kv = _default_block(t, "T"), _default_block(s, "S")
  elif isinstance(block_sizes, splash_kernel.BlockSizes):
    block_q, block_kv = block_sizes.block_q, block_sizes.block_kv
  elif isinstance(block_sizes, (int, np.integer)):
    block_q = block_kv = block_sizes
  elif isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
    block_q, block_kv = block_sizes
  else:
    raise ValueError(
      "block_sizes must be None, an int, a (block_q, block_kv) pair or a splash BlockSizes; got "
      f"{block_sizes!r}"
    )
  if isinstance(block_sizes, splash_kernel.BlockSizes):
    sizes = block_sizes
    if not sizes.has_backward_blocks:  # fill the backward blocks from the forward ones
      fill = dict(block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv)
      if not sizes.use_fused_bwd_kernel:
        fill.update(block_q_dq=block_q, block_kv_dq=block_kv)
      sizes = dataclasses.replace(
        sizes,
        **{f: getattr(sizes, f) if getattr(sizes, f) is not None else b for f, b in fill.items()},
      )
  else:
    sizes = splash_kernel.BlockSizes(
      block_q=block_q,
      block_kv=block_kv,
      block_kv_compute=block_kv,
      block_q_dkv=block_q,
      block_kv_dkv=block_kv,
      block_kv_dkv_compute=block_kv,
      block_q_dq=block_q,
      block_kv_dq=block_kv,
    )
  for field, length, name in (
    ("block_q", t, "T"),
    ("block_q_dkv", t, "T"),
    ("block_q_dq", t, "T"),
    ("block_kv", s, "S"),
    ("block_kv_compute", s, "S"),
    ("block_kv_dkv", s, "S"),
    ("block_kv_dkv_compute", s, "S"),
    ("block_kv_dq", s, "S"),
  ):
    _check_block(getattr(sizes, field), field, length, name)
  for compute, memory in (
    ("block_kv_compute", "block_kv"),
    ("block_kv_dkv_compute", "block_kv_dkv"),
  ):
    if getattr(sizes, memory) % getattr(sizes, compute):
      raise ValueError(
        f"block size {compute}={getattr(sizes, compute)} must divide "
        f"{memory}={getattr(sizes, memory)}"
      )
  return sizes


def _mask(splash_mask: Any, t: int, s: int, n: int, causal: bool, window: int | None) -> Any:
  """Splash's multi-head mask (the same for every query head) of causal / window."""
  shape, offset = (t, s), s - t  # query i sits at key position i + offset
  if window is not None:
    # LocalMask keeps q + offset - left <= k <= q + offset + right; |q_pos - k_pos| < window is
    # left = right = window - 1, and causal cuts the right side to 0.
    head = splash_mask.LocalMask(
      shape, window_size=(window - 1, 0 if causal else window - 1), offset=offset
    )
  elif causal:
    head = splash_mask.CausalMask(shape, offset=offset)
  else:
    head = splash_mask.FullMask(shape)
  return splash_mask.MultiHeadMask([head] * n)


def _check_segment_ids(ids: Any, name: str, shape: tuple[int, int]) -> jax.Array:
  ids = jnp.asarray(ids)
  if ids.shape != shape:
    raise ValueError(f"{name} must be {list(shape)}; got shape {ids.shape}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer; got dtype {ids.dtype}")
  return ids.astype(jnp.int32)


def splash_attention(
  q,
  k,
  v,
  *,
  causal: bool = False,
  window: int | None = None,
  q_segment_ids=None,
  kv_segment_ids=None,
  scale: float | None = None,
  block_sizes=None,
  interpret: bool | None = None,
  softcap: float | None = None,
) -> jax.Array:
  """``softmax(cap(scale * q k^T), masked) v`` by the Pallas splash-attention kernel (``cap``:
  the identity, or with ``softcap`` c, ``c * tanh(x / c)``: splash's ``attn_logits_soft_cap``).

  The mask is given by parts, ANDed; a pair (query, key) is attended (True) when every part allows
  it. Key ``j`` sits at position ``j`` and query ``i`` at ``S - T + i``.

  Args:
    q: queries ``[B, T, N, H]``, float32 or bfloat16.
    k: keys ``[B, S, K, H]`` with ``N % K == 0`` (K == N: MHA, K == 1: MQA, else GQA), q's dtype.
    v: values ``[B, S, K, H]``, q's dtype.
    causal: query at position ``p`` sees keys at positions ``<= p``.
    window: sliding window, ``>= 1``: only keys with ``|q_pos - k_pos| < window``; with ``causal``
      query ``p`` sees keys ``p - window + 1 .. p``.
    q_segment_ids: ``[B, T]`` int; queries see only keys of the same segment (packed sequences).
    kv_segment_ids: ``[B, S]`` int (default ``q_segment_ids``, which needs ``T == S``).
    scale: logits scale; default ``H ** -0.5``. It is applied to q (in float32, then cast back to
      q's dtype) before the kernel, which does not scale.
    block_sizes: None (the default: blocks of the largest multiple of 128 up to 512 that divides T,
      and likewise S, in the forward and both backward kernels), an int (block_q = block_kv), a
      ``(block_q, block_kv)`` pair, or splash's own ``BlockSizes`` (its backward blocks, where
      unset, are its forward ones). Every block must be a multiple of 128 and divide T (query
      blocks) or S (key/value blocks).
    interpret: run the kernel in Pallas interpret mode; default: off TPU.

  Returns:
    ``[B, T, N, H]`` in q's dtype. A query that sees no key at all (possible only through segment
    ids, e.g. ``kv_segment_ids`` without the query's segment in its reach) gets no defined
    output and no defined gradients: splash divides by a zero denominator there, unlike
    ``ops.dot_product_attention``, which gives zeros. With ``kv_segment_ids`` left to its default
    every query sees at least itself.

  Raises:
    ValueError: on inconsistent shapes, an unsupported dtype, a bad window, segment ids or block
      size, causal / window leaving a query without keys (``T > S``), or ``interpret=False`` off
      TPU.
    ImportError: when the Pallas splash-attention modules do not import.
  """
  check_qkv(q, k, v)
  (b, t, n, h), s = q.shape, k.shape[1]
  if np.dtype(q.dtype) not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
    raise ValueError(
      "q, k and v must share one dtype, float32 or bfloat16; got "
      f"q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}"
    )
  if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
    raise ValueError(f"window={window!r} must be an int >= 1")
  if empty_rows(t, s, causal, window):
    raise ValueError(
      f"causal={causal}, window={window} with T={t} > S={s} leave queries without keys, which "
      "splash attention cannot give defined values for; use implementation='chunked' or 'xla'"
    )
  if q_segment_ids is None:
    if kv_segment_ids is not None:
      raise ValueError("kv_segment_ids needs q_segment_ids")
  else:
    q_segment_ids = _check_segment_ids(q_segment_ids, "q_segment_ids", (b, t))
    if kv_segment_ids is None:
      if t != s:
        raise ValueError(f"kv_segment_ids [B, S] is needed when T={t} != S={s}")
      kv_segment_ids = q_segment_ids
    else:
      kv_segment_ids = _check_segment_ids(kv_segment_ids, "kv_segment_ids", (b, s))
  if interpret is None:
    interpret = jax.default_backend() != "tpu"
  elif not interpret and jax.default_backend() != "tpu":
    raise ValueError(
      f"interpret=False needs a TPU; the default backend is {jax.default_backend()!r}"
    )

  splash_kernel, splash_mask = _splash_modules()
  sizes = _block_sizes(splash_kernel, block_sizes, t, s)
  kernel = splash_kernel.make_splash_mha_single_device(
    _mask(splash_mask, t, s, n, causal, window),
    block_sizes=sizes,
    interpret=bool(interpret),
    attn_logits_soft_cap=None if softcap is None else float(softcap),
  )

  scale = h**-0.5 if scale is None else float(scale)
  q_BNTH = (q.astype(jnp.float32) * scale).astype(q.dtype).transpose(0, 2, 1, 3)
  k_BKSH = k.transpose(0, 2, 1, 3)
  v_BKSH = v.transpose(0, 2, 1, 3)

  def one_sequence(q_NTH, k_KSH, v_KSH, q_seg_T, kv_seg_S):
    seg = None if q_seg_T is None else splash_kernel.SegmentIds(q=q_seg_T, kv=kv_seg_S)
    return kernel(q_NTH, k_KSH, v_KSH, segment_ids=seg)

  seg_axis = None if q_segment_ids is None else 0
  out_BNTH = jax.vmap(one_sequence, in_axes=(0, 0, 0, seg_axis, seg_axis))(
    q_BNTH, k_BKSH, v_BKSH, q_segment_ids, kv_segment_ids
  )
  return out_BNTH.transpose(0, 2, 1, 3)


__all__ = ["LANES", "attention", "splash_attention", "splash_supports"]


def attention(
  q,
  k,
  v,
  *,
  bias=None,
  mask=None,
  causal: bool = False,
  scale=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  return_weights: bool = False,
  kv_valid=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  window=None,
  q_positions=None,
  bias_fn=None,
  softcap=None,
  **_,
) -> jax.Array:
  """``ops.dot_product_attention``'s call through splash attention, which takes the causal,
  window and segment-id parts only.

  Raises:
    ValueError: naming the parts splash does not take (a bias, a dense mask, key padding, query
      positions, attention dropout, the weights), and for inputs ``ops.dot_product_attention``
      refuses.
  """
  attention_ops.check_call(
    q,
    k,
    v,
    mask=mask,
    window=window,
    kv_valid=kv_valid,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
  )
  dropout = dropout_rate > 0.0 and dropout_rng is not None
  unsupported = [
    name
    for name, given in (
      ("bias", bias is not None or bias_fn is not None),
      ("mask", mask is not None),
      ("kv_valid", kv_valid is not None),
      ("q_positions", q_positions is not None),
      ("attention dropout", dropout),
      ("return_weights", return_weights),
    )
    if given
  ]
  if unsupported:
    raise ValueError(
      f"implementation='splash' does not take {', '.join(unsupported)}: use 'chunked' or 'xla'"
    )
  return splash_attention(
    q,
    k,
    v,
    causal=causal,
    window=window,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
    scale=scale,
    softcap=softcap,
  )
