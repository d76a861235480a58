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


def segment_runs(segment_ids: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Each row's segments as runs of equal ids: their lengths and starts, for a kernel that takes
  packed sequences (cuDNN's ragged layout) instead of a ``[B, 1, T, T]`` segment mask.

  Args:
    segment_ids: ``[B, T]`` ints, as for ``segment_mask``.
    max_runs: ``M``, the most runs a row may hold (static).

  Returns:
    ``(lengths [B, M], starts [B, M + 1], fits)``: run ``j`` of row ``b`` covers tokens
    ``starts[b, j] .. starts[b, j] + lengths[b, j] - 1``; absent runs are ``-1`` in both (so the
    last column of ``starts`` is always ``-1``). ``fits`` is a boolean scalar: every row has at
    most ``M`` runs and no id comes back after its run ends, which is when attention within
    these runs equals attention under ``segment_mask(segment_ids)``. Where ``fits`` is False the
    runs are not that mask's segments and must not be used.
  """
  if max_runs < 1:
    raise ValueError(f"max_runs={max_runs} must be >= 1")
  if segment_ids.ndim != 2:
    raise ValueError(f"segment_ids must be [B, T]; got shape {segment_ids.shape}")
  b, t = segment_ids.shape
  begins_BT = jnp.concatenate(
    [jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
  )
  starts_BM = jax.vmap(lambda row: jnp.nonzero(row, size=max_runs, fill_value=-1)[0])(begins_BT)
  starts_BM = starts_BM.astype(jnp.int32)
  present_BM = starts_BM >= 0
  ends_BM = jnp.concatenate([starts_BM[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)
  ends_BM = jnp.where(ends_BM >= 0, ends_BM, t)
  lengths_BM = jnp.where(present_BM, ends_BM - starts_BM, -1)
  # An id that comes back after its run ended is one segment in two runs: not what they describe.
  run_ids_BM = jnp.take_along_axis(segment_ids, jnp.maximum(starts_BM, 0), axis=1)
  both_BMM = present_BM[:, :, None] & present_BM[:, None, :] & ~jnp.eye(max_runs, dtype=bool)
  repeated = jnp.any(both_BMM & (run_ids_BM[:, :, None] == run_ids_BM[:, None, :]))
  fits = jnp.all(begins_BT.sum(axis=1) <= max_runs) & ~repeated
  starts = jnp.concatenate([starts_BM, jnp.full((b, 1), -1, jnp.int32)], axis=1)
  return lengths_BM, starts, fits


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
