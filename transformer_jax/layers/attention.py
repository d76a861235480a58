"""Multi-head attention (self or cross; MHA/MQA/GQA; optional RoPE) around ``ops.dot_product_attention``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers.dense import Projection
from transformer_jax.parallel import axes as ax


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
               kv_cache: tuple[jax.Array, jax.Array] | None = None,
               cache_index: jax.Array | None = None
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
        ``project_kv``.
      cache_index: ``[B]`` int, the cache slot of each row's first new token.

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
    out_BTNH = ops.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, bias=bias, mask=mask, scale=self.scale,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng)
    return self.out(out_BTNH)

  def project_kv(self, kv_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[B, S, K, H]`` of ``kv_BSD`` (no RoPE): a read-only cross-attention cache."""
    return self.key(kv_BSD), self.value(kv_BSD)

  def _cached(self, x_BTD, kv_cache, cache_index, *, mask, bias, positions):
    """Attention against a key/value cache (decoding); dropout is never applied here."""
    k_cache_BSKH, v_cache_BSKH = kv_cache
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
      # Each row writes its T new entries at its own slot (rows of a batch have different lengths).
      write = jax.vmap(lambda c, x, i: jax.lax.dynamic_update_slice_in_dim(c, x, i, axis=0))
      k_cache_BSKH = write(k_cache_BSKH, k_BTKH.astype(k_cache_BSKH.dtype), cache_index)
      v_cache_BSKH = write(v_cache_BSKH, v_BTKH.astype(v_cache_BSKH.dtype), cache_index)
    out_BTNH = ops.dot_product_attention(
        q_BTNH, k_cache_BSKH.astype(q_BTNH.dtype), v_cache_BSKH.astype(q_BTNH.dtype), bias=bias,
        mask=mask, scale=self.scale)
    return self.out(out_BTNH), (k_cache_BSKH, v_cache_BSKH)
