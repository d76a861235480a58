"""Linformer (Wang et al. 2020): attention with keys and values projected along the sequence.

``softmax(scale * q (E k)^T) (F v)``: ``E`` and ``F`` ``[R, S]`` map the S keys and values to R
rows, so the scores are ``[T, R]``: linear in the length for a fixed R. With ``R = S`` and
identity projections this is full (unmasked) attention. Padding keys are zeroed before the
projection, so they add nothing to the projected rows (the rows still take part in every query's
softmax: Linformer has no key mask after projecting).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.ops.attention import check_qkv, dot_product_attention


def linformer_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  e_RS: jax.Array,
  f_RS: jax.Array | None = None,
  *,
  kv_valid: jax.Array | None = None,
  scale: float | None = None,
) -> jax.Array:
  """Attention over ``R`` rows of keys ``E k`` and values ``F v``.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]`` (``N % K == 0``).
    v: values ``[B, S, K, H]``.
    e_RS: the keys' projection ``[R, S]`` (a longer table is cut to its first S columns, so one
      table serves every length up to its own).
    f_RS: the values' projection (default ``e_RS``: keys and values share it).
    kv_valid: ``[B, S]`` bool, False for padding keys (zeroed before projecting).
    scale: logits scale; default ``1 / sqrt(H)``.

  Returns:
    ``[B, T, N, H]`` in q's dtype.

  Raises:
    ValueError: for shapes that do not match, or a projection with fewer than S columns.
  """
  check_qkv(q, k, v)
  s = k.shape[1]
  f_RS = e_RS if f_RS is None else f_RS
  for name, p in (("e_RS", e_RS), ("f_RS", f_RS)):
    if p.ndim != 2 or p.shape[1] < s:
      raise ValueError(f"{name} must be [R, S'] with S' >= S={s}; got shape {p.shape}")
  if e_RS.shape[0] != f_RS.shape[0]:
    raise ValueError(f"e_RS {e_RS.shape} and f_RS {f_RS.shape} must have the same rows R")
  if kv_valid is not None:
    if kv_valid.shape != (k.shape[0], s):
      raise ValueError(f"kv_valid must be [B, S] = {(k.shape[0], s)}; got {kv_valid.shape}")
    keep_BS11 = kv_valid.astype(k.dtype)[:, :, None, None]
    k, v = k * keep_BS11, v * keep_BS11
  k_BRKH = jnp.einsum("RS,BSKH->BRKH", e_RS[:, :s].astype(k.dtype), k)
  v_BRKH = jnp.einsum("RS,BSKH->BRKH", f_RS[:, :s].astype(v.dtype), v)
  return dot_product_attention(q, k_BRKH, v_BRKH, scale=scale)
