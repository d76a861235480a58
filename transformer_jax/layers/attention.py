"""Multi-head attention (self or cross; MHA/MQA/GQA; optional RoPE) around ``ops.dot_product_attention``."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers.dense import Projection
from transformer_jax.parallel import axes as ax
from transformer_jax.parallel import rules
from transformer_jax.parallel.ring import ring_attention


@dataclasses.dataclass(frozen=True)
class MaskParts:
  """A self-attention mask described by its parts instead of a dense ``[B, N, T, S]`` array.

  Models pass it next to the dense ``mask`` when their mask is exactly ``causal`` AND key padding
  AND same-segment; kernels that build the mask block by block use it (ring attention under
  sequence parallelism). ``None`` parts are absent.
  """

  causal: bool = False
  kv_valid_BS: jax.Array | None = None    # [B, S] bool, False for padding keys
  segment_ids_BT: jax.Array | None = None  # [B, T] int, packed documents


class Attention(nnx.Module):
  """Projects to heads, attends, projects back. Takes plain numbers, not a model config."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
               use_bias: bool, init_std: float, out_init_std: float, dtype: jnp.dtype,
               param_dtype: jnp.dtype, rngs: nnx.Rngs,
               rope_theta: float | None = None, rope_interleaved: bool = False,
               rope_scaling: ops.RopeScaling | None = None, scale: float | None = None):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    d, n, k, h = d_model, num_heads, num_kv_heads, head_dim
    common = dict(init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.query = Projection("BTD,DNH->BTNH", (d, n, h), (ax.EMBED, ax.HEADS, ax.HEAD_DIM),
                            bias_shape=(n, h) if use_bias else None,
                            bias_axes=(ax.HEADS, ax.HEAD_DIM), **common)
    self.key = Projection("BSD,DKH->BSKH", (d, k, h), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
                          bias_shape=(k, h) if use_bias else None,
                          bias_axes=(ax.KV_HEADS, ax.HEAD_DIM), **common)
    self.value = Projection("BSD,DKH->BSKH", (d, k, h), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
                            bias_shape=(k, h) if use_bias else None,
                            bias_axes=(ax.KV_HEADS, ax.HEAD_DIM), **common)
    common["init_std"] = out_init_std
    self.out = Projection("BTNH,NHD->BTD", (n, h, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
                          bias_shape=(d,) if use_bias else None, bias_axes=(ax.EMBED,), **common)
    self.rope_theta = rope_theta
    self.rope_interleaved = rope_interleaved
    self.rope_scaling = rope_scaling
    self.scale = scale

  def __call__(self, x_BTD: jax.Array, kv_BSD: jax.Array | None = None, *,
               mask: jax.Array | None = None, bias: jax.Array | None = None,
               positions: jax.Array | None = None, dropout_rate: float = 0.0,
               dropout_rng: jax.Array | None = None,
               kv_cache: tuple[jax.Array, jax.Array] | StackedKV | None = None,
               cache_index: jax.Array | None = None, mask_parts: MaskParts | None = None
               ) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Self-attention over ``x`` or, with ``kv_BSD``, cross-attention to it.

    Args:
      x_BTD: queries' inputs ``[B, T, D]``.
      kv_BSD: keys'/values' inputs ``[B, S, D]`` (default ``x``).
      mask: bool, broadcastable to ``[B, N, T, S]``, True = attend.
      bias: additive, broadcastable to ``[B, N, T, S]``.
      positions: ``[B, T]`` or ``[T]``, used by RoPE (self-attention only).
      kv_cache: optional ``(k, v)``, each ``[B, S, K, H]`` (keys already rotated). With
        ``cache_index`` the new keys/values of ``x`` are written into it at that slot of each row and
        the queries attend to the whole cache (``mask``/``bias`` are over the ``S`` cache slots);
        without it the cache is read-only, e.g. cross-attention keys/values projected once by
        ``project_kv``. A ``StackedKV`` (one layer of ``[L, B, S, K, H]`` arrays) works the same way
        and is returned as one.
      cache_index: ``[B]`` int, the cache slot of each row's first new token.
      mask_parts: the same mask as ``mask``, by parts. Under a mesh with a ``sequence`` axis
        (``parallel.activation_sharding``) self-attention without bias or attention dropout then
        runs as ring attention; otherwise ``mask`` is used.

    Returns:
      ``[B, T, D]``; with ``kv_cache``, ``(out, new_kv_cache)``.
    """
    if kv_cache is not None:
      return self._cached(x_BTD, kv_cache, cache_index, mask=mask, bias=bias,
                          positions=positions)
    kv_BSD = x_BTD if kv_BSD is None else kv_BSD
    q_BTNH = self.query(x_BTD)
    k_BSKH = self.key(kv_BSD)
    v_BSKH = self.value(kv_BSD)
    if self.rope_theta is not None:
      if positions is None:
        positions = jnp.arange(x_BTD.shape[1])
      rope = dict(theta=self.rope_theta, interleaved=self.rope_interleaved,
                  scaling=self.rope_scaling)
      q_BTNH = ops.apply_rope(q_BTNH, positions, **rope)
      k_BSKH = ops.apply_rope(k_BSKH, positions, **rope)
    if self._use_ring(x_BTD, kv_BSD is x_BTD, mask_parts, bias, dropout_rate, dropout_rng):
      out_BTNH = ring_attention(
          q_BTNH, k_BSKH, v_BSKH, mesh=rules.current_mesh(), causal=mask_parts.causal,
          kv_mask_BS=mask_parts.kv_valid_BS, segment_ids_BT=mask_parts.segment_ids_BT,
          scale=self.scale)
    else:
      out_BTNH = ops.dot_product_attention(
          q_BTNH, k_BSKH, v_BSKH, bias=bias, mask=mask, scale=self.scale,
          dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    return self.out(out_BTNH)

  @staticmethod
  def _use_ring(x_BTD, self_attention, mask_parts, bias, dropout_rate, dropout_rng) -> bool:
    """Ring attention when the sequence is split over a mesh and the mask is expressible by parts
    (no additive bias such as ALiBi or T5's, no attention dropout); GSPMD handles the rest."""
    n = rules.axis_size("sequence")
    rows = rules.axis_size("data") * rules.axis_size("fsdp")
    return (n > 1 and self_attention and mask_parts is not None and bias is None
            and not (dropout_rate > 0.0 and dropout_rng is not None)
            and x_BTD.shape[1] % n == 0 and x_BTD.shape[0] % rows == 0)

  def project_kv(self, kv_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[B, S, K, H]`` of ``kv_BSD`` (no RoPE): a read-only cross-attention cache."""
    return self.key(kv_BSD), self.value(kv_BSD)

  def _cached(self, x_BTD, kv_cache, cache_index, *, mask, bias, positions):
    """Attention against a key/value cache (decoding); dropout is never applied here.

    ``kv_cache`` is a ``(k, v)`` pair of ``[B, S, K, H]`` arrays or a ``StackedKV`` view of one layer
    of ``[L, B, S, K, H]`` arrays; either comes back in the same form with the new entries written.
    """
    stacked = isinstance(kv_cache, StackedKV)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    q_BTNH = self.query(x_BTD)
    if cache_index is not None:
      k_BTKH = self.key(x_BTD)
      v_BTKH = self.value(x_BTD)
      if self.rope_theta is not None:
        if positions is None:
          raise ValueError("RoPE with a key/value cache needs positions [B, T]")
        rope = dict(theta=self.rope_theta, interleaved=self.rope_interleaved,
                    scaling=self.rope_scaling)
        q_BTNH = ops.apply_rope(q_BTNH, positions, **rope)
        k_BTKH = ops.apply_rope(k_BTKH, positions, **rope)
      k_cache = _write(k_cache, k_BTKH, cache_index, kv_cache.layer if stacked else None)
      v_cache = _write(v_cache, v_BTKH, cache_index, kv_cache.layer if stacked else None)
    k_BSKH = k_cache[kv_cache.layer] if stacked else k_cache
    v_BSKH = v_cache[kv_cache.layer] if stacked else v_cache
    out_BTNH = ops.dot_product_attention(
        q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), bias=bias, mask=mask,
        scale=self.scale)
    new_cache = StackedKV(k_cache, v_cache, kv_cache.layer) if stacked else (k_cache, v_cache)
    return self.out(out_BTNH), new_cache


class StackedKV(NamedTuple):
  """Layer ``layer`` of a layer-stacked key/value cache, passed to ``Attention`` as its ``kv_cache``.

  Decoding writes each layer's new keys/values straight into the ``[L, B, S, K, H]`` arrays (in place
  under ``jit``) instead of slicing a layer out and stacking the layers back, which would copy the
  whole cache at every step.
  """

  k: jax.Array             # [L, B, S, K, H]
  v: jax.Array             # [L, B, S, K, H]
  layer: int | jax.Array   # which layer this attention reads and writes


def _write(cache, new_BTKH, cache_index_B, layer):
  """``cache`` with row b's T new entries at slots ``cache_index[b] .. + T - 1`` (of ``layer``).

  One scatter, updated in place under ``jit``; rows may sit at different slots.
  """
  b, t = new_BTKH.shape[:2]
  rows_B1 = jnp.arange(b)[:, None]
  slots_BT = cache_index_B.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  new_BTKH = new_BTKH.astype(cache.dtype)
  if layer is None:
    return cache.at[rows_B1, slots_BT].set(new_BTKH, mode="drop")
  return cache.at[layer, rows_B1, slots_BT].set(new_BTKH, mode="drop")
