"""cuDNN's fused attention behind ``ops.dot_product_attention``'s arguments: NVIDIA GPUs only.

``attention`` turns the mask's parts into what ``jax.nn.dot_product_attention(implementation=
"cudnn")`` takes, and with the kernel table's ``cudnn_packed_segments`` gives segment ids to
cuDNN as packed sequences (its ragged layout, Hopper and later) where each row's runs fit
(``packed_segments``). The GPU backend calls it where ``ops.choose_implementation`` gives
``"cudnn"``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.ops import attention as attention_ops
from transformer_jax.ops.masks import and_masks, segment_runs


def packed_segments(
  q,
  k,
  *,
  table_segments: int,
  window: int | None,
  bias: bool,
  mask: bool,
  kv_valid: bool,
  q_positions: bool,
  kv_segment_ids: bool,
) -> int:
  """How many packed sequences per row cuDNN takes segment ids as (0: as a dense mask).

  Packed needs the kernel table to ask for it (``table_segments`` >= 2, its
  ``cudnn_packed_segments``) and self-attention (``T == S``, one set of segment ids) with as many
  key/value heads as query heads (jax's packed layout strides the keys by the query heads),
  causal or bidirectional, with segment ids as the only other mask part. ``attention`` packs only
  on Hopper and later GPUs, which have cuDNN's ragged layout.
  """
  m = table_segments
  if m < 2 or kv_segment_ids or bias or mask or kv_valid or q_positions or window is not None:
    return 0
  if q.shape[1] != k.shape[1] or q.shape[2] != k.shape[2]:
    return 0
  return m


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
  bias_params=None,
  table_segments: int = 0,
  **_,
) -> jax.Array:
  """``ops.dot_product_attention``'s call through cuDNN's fused kernel
  (``jax.nn.dot_product_attention``).

  The mask parts become what that API takes: ``causal`` (``T == S`` with default positions:
  cuDNN aligns the causal mask to the first key), ``window`` (``local_window_size`` when causal;
  cuDNN has no two-sided window, so without causal it is a dense mask), ``kv_valid`` (key lengths
  when it is concretely a prefix, else a dense mask), segment ids (a dense mask; with
  ``packed_segments``, packed sequences where each row's runs fit, the mask elsewhere) and
  ``bias_fn`` (a dense bias). cuDNN folds a dense mask into its bias, so a query row whose every
  key is masked follows cuDNN's convention, not the zeros of "xla" and "chunked".

  Args:
    q, k, v, bias, mask, causal, scale, dropout_rate, dropout_rng, return_weights, kv_valid,
      q_segment_ids, kv_segment_ids, window, q_positions, bias_fn, bias_params: as in
      ``ops.dot_product_attention``.
    table_segments: the kernel table's ``cudnn_packed_segments``.

  Raises:
    ValueError: off an NVIDIA GPU, for dtypes other than bfloat16/float16, for the weights,
      dropout, causal with ``T != S`` or given positions, and for inputs
      ``ops.dot_product_attention`` refuses.
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
  b, t, _, _ = q.shape
  s = k.shape[1]
  q_pos_BT = attention_ops.query_positions(q_positions, b, t, s)
  platform = jax.default_backend()
  if platform != "gpu":
    raise ValueError(
      f"implementation='cudnn' needs an NVIDIA GPU; the default backend is {platform!r}: use "
      "'chunked' or 'xla'"
    )
  if q.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(
      f"implementation='cudnn' computes in bfloat16 or float16; got q.dtype={q.dtype}: use "
      "dtype bfloat16 (a model's config.dtype), or implementation 'xla' or 'chunked'"
    )
  if return_weights:
    raise ValueError("return_weights=True is not available with implementation='cudnn'")
  if dropout_rate > 0.0 and dropout_rng is not None:
    raise ValueError("attention dropout is not available with implementation='cudnn'")
  if causal and (t != s or q_positions is not None):
    raise ValueError(
      f"implementation='cudnn' takes causal only with T == S and default positions; got T={t}, "
      f"S={s}, q_positions={'given' if q_positions is not None else None}"
    )
  packed = (
    packed_segments(
      q,
      k,
      table_segments=table_segments,
      window=window,
      bias=bias is not None or bias_fn is not None,
      mask=mask is not None,
      kv_valid=kv_valid is not None,
      q_positions=q_positions is not None,
      kv_segment_ids=kv_segment_ids is not None,
    )
    if q_segment_ids is not None
    else 0
  )
  key_lengths = None
  if kv_valid is not None:
    try:
      valid = np.asarray(kv_valid).astype(bool)
      lengths = valid.sum(axis=1)
      if (valid == (np.arange(s)[None] < lengths[:, None])).all():
        key_lengths = jnp.asarray(lengths, jnp.int32)
    except jax.errors.TracerArrayConversionError:
      pass  # traced: not known to be a prefix, so it goes in as a dense mask
  # cuDNN's sliding window looks back only (with causal); a two-sided one is a dense mask.
  dense_window = None if causal else window
  parts = attention_ops.parts_mask(
    q_pos_BT,
    s,
    causal=False,
    window=dense_window,
    kv_valid=kv_valid if key_lengths is None else None,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
  )
  mask = and_masks(mask, parts)
  if bias_fn is not None:
    fn_bias = bias_fn(bias_params, q_pos_BT, jnp.arange(s, dtype=jnp.int32))
    bias = fn_bias if bias is None else bias + fn_bias
  if mask is not None:  # [B, 1|N, T, S]: cuDNN broadcasts its bias over the heads
    mask = jnp.broadcast_to(mask, (b, mask.shape[1] if mask.ndim == 4 else 1, t, s))
  if bias is not None:
    bias = bias.astype(q.dtype)
  local = (window - 1, 0) if causal and window is not None else None
  as_mask = functools.partial(
    jax.nn.dot_product_attention,
    bias=bias,
    mask=mask,
    scale=scale,
    is_causal=causal,
    key_value_seq_lengths=key_lengths,
    local_window_size=local,
    implementation="cudnn",
  )
  if not packed or not ragged_layout():
    return as_mask(q, k, v)
  # Rows of at most `packed` runs as packed sequences, the others through the mask above.
  lengths_BM, starts_BM1, fits = segment_runs(q_segment_ids, packed)
  as_runs = functools.partial(
    packed_attention,
    lengths_BM=lengths_BM,
    starts_BM1=starts_BM1,
    causal=causal,
    scale=q.shape[-1] ** -0.5 if scale is None else scale,
  )
  return jax.lax.cond(fits, as_runs, as_mask, q, k, v)


def ragged_layout() -> bool:
  """cuDNN's ragged (packed-sequence) layout runs on Hopper and later GPUs."""
  capability = getattr(jax.devices()[0], "compute_capability", None)
  return capability is not None and tuple(map(int, capability.split("."))) >= (9, 0)


def packed_attention(q, k, v, *, lengths_BM, starts_BM1, causal: bool, scale: float):
  """cuDNN's fused attention over the runs of ``ops.masks.segment_runs``: each run of each row
  is a sequence of its own (``[B, T, N, H]`` in and out, MHA)."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 - GPU only

  mask_type = cudnn.MaskType.PADDING_CAUSAL if causal else cudnn.MaskType.PADDING
  return cudnn.dot_product_attention(
    q,
    k,
    v,
    q_seqlen=lengths_BM,
    kv_seqlen=lengths_BM,
    q_offsets=starts_BM1,
    kv_offsets=starts_BM1,
    scale=scale,
    mask_type=mask_type,
    qkv_layout="BTNH",
  )
