"""Boolean attention masks (True = attend), built from small pieces and combined with ``and_masks``.

Every helper returns an array broadcastable to ``[B, N, T, S]``: a leading batch axis of 1 where the
mask does not depend on the batch, and a head axis of 1. The attention kernels give a masked logit
``MASK_VALUE`` and reduce a broadcast bias's gradient with ``sum_to``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The logit of a masked entry: a large finite negative rather than -inf, so exp() of it is exactly
# 0 and a row whose every entry is masked stays finite (the kernels then zero such rows).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _query_key_positions(q_len: int, k_len: int) -> tuple[jax.Array, jax.Array]:
  # Queries are aligned to the end of the keys, so that a decoding step (T=1) sits at S-1.
  q_pos = jnp.arange(q_len)[:, None] + (k_len - q_len)
  k_pos = jnp.arange(k_len)[None, :]
  return q_pos, k_pos


def causal_mask(q_len: int, k_len: int | None = None) -> jax.Array:
  """``[1, 1, T, S]``: query ``i`` (at key position ``S - T + i``) sees keys up to itself."""
  k_len = q_len if k_len is None else k_len
  q_pos, k_pos = _query_key_positions(q_len, k_len)
  return (k_pos <= q_pos)[None, None]


def sliding_window_mask(q_len: int, k_len: int | None, window: int) -> jax.Array:
  """``[1, 1, T, S]``: attend only to keys less than ``window`` positions away (either side).

  Combined with ``causal_mask`` this is the local attention of Longformer/Mistral: query ``i`` sees
  keys ``i - window + 1 .. i``.
  """
  if window < 1:
    raise ValueError(f"window={window} must be >= 1")
  k_len = q_len if k_len is None else k_len
  q_pos, k_pos = _query_key_positions(q_len, k_len)
  return (jnp.abs(q_pos - k_pos) < window)[None, None]


def padding_mask(key_valid: jax.Array, query_valid: jax.Array | None = None) -> jax.Array:
  """Mask of real (non-padding) positions.

  Args:
    key_valid: ``[B, S]`` bool or 0/1, True for real key tokens.
    query_valid: optional ``[B, T]``; if given, padding queries attend to nothing (their rows are
      all False, so attention returns zeros for them).

  Returns:
    ``[B, 1, 1, S]`` or, with ``query_valid``, ``[B, 1, T, S]``.
  """
  key_valid = key_valid.astype(bool)
  mask = key_valid[:, None, None, :]
  if query_valid is not None:
    mask = mask & query_valid.astype(bool)[:, None, :, None]
  return mask


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array | None = None) -> jax.Array:
  """``[B, 1, T, S]``: tokens attend only within their own segment (packed sequences).

  Segment ids are integers ``[B, T]`` (and ``[B, S]``); equal ids attend to each other.
  """
  kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
  return (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :])[:, None]


def and_masks(*masks: jax.Array | None) -> jax.Array | None:
  """Logical AND of the given masks (``None`` entries are skipped; all ``None`` gives ``None``)."""
  out = None
  for m in masks:
    if m is None:
      continue
    out = m if out is None else jnp.logical_and(out, m)
  return out


def sum_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """``x`` summed over the axes that ``shape`` broadcasts (leading ones, and those of size 1): the
  cotangent of an array of ``shape`` broadcast to ``x``'s shape."""
  lead = x.ndim - len(shape)
  x = jnp.sum(x, axis=tuple(range(lead))) if lead else x
  axes = tuple(i for i, d in enumerate(shape) if d == 1 and x.shape[i] != 1)
  return jnp.sum(x, axis=axes, keepdims=True) if axes else x
