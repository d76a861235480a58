"""Multi-head attention (self or cross; MHA/MQA/GQA; optional RoPE) around ``ops.dot_product_attention``."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import flax.struct
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

    ``kv_cache`` is a ``(k, v)`` pair of ``[B, S, K, H]`` arrays or a ``StackedKV`` (one layer of a
    model's caches); it comes back in the same form with the new entries written.
    """
    stacked = isinstance(kv_cache, StackedKV)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    layer = kv_cache.layer if stacked else None
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
      k_cache = _write(k_cache, k_BTKH, cache_index, layer)
      v_cache = _write(v_cache, v_BTKH, cache_index, layer)
    k_BSKH, v_BSKH = _read(k_cache, layer), _read(v_cache, layer)
    out_BTNH = ops.dot_product_attention(
        q_BTNH, k_BSKH.astype(q_BTNH.dtype), v_BSKH.astype(q_BTNH.dtype), bias=bias, mask=mask,
        scale=self.scale)
    new_cache = StackedKV(k_cache, v_cache, layer) if stacked else (k_cache, v_cache)
    return self._out_merged(out_BTNH), new_cache

  def _out_merged(self, out_BTNH: jax.Array) -> jax.Array:
    """``self.out`` with the heads merged into one contracted axis (the same numbers).

    ``jnp.einsum("BTNH,NHD->BTD")`` contracts ``(H, N)`` in that order and XLA's CPU backend then
    copies the ``[N, H, D]`` kernel into an ``[H, N, D]`` layout at every call, i.e. at every layer of
    every decoded token; contracting the merged ``N*H`` axis reads the kernel where it is.
    """
    b, t, n, h = out_BTNH.shape
    proj = self.out
    kernel_ED = proj.kernel[...].reshape(n * h, -1).astype(proj.dtype)  # E = N * H
    y_BTD = jnp.einsum("BTE,ED->BTD", out_BTNH.reshape(b, t, n * h).astype(proj.dtype), kernel_ED)
    if proj.bias is not None:
      y_BTD = y_BTD + proj.bias[...].astype(proj.dtype)
    return y_BTD


@flax.struct.dataclass
class LayerCaches:
  """Keys (or values) of ``L`` layers as ``L`` separate heads-major arrays: the decoding layout.

  Each layer's array is ``[B * K, S, H]`` (rows of one batch row's heads together); ``shape`` is the
  logical ``[L, B, S, K, H]`` of the stacked form. On CPU a one-token step reads the cache several
  times faster this way than from one ``[L, B, S, K, H]`` array: slicing a layer out of the stacked
  array copies it, and a ``[B, S, K, H]`` slice is transposed to heads-major for the batched matrix
  products of attention (copied again), at every layer of every step. The batch and head axes are
  merged so that the products read the array exactly as stored, with no size-1 axis to drop when
  B = 1 (XLA then fuses a copy of the cache update into the reader).
  """

  layers: tuple[jax.Array, ...]                        # L arrays [B * K, S, H]
  kv_heads: int = flax.struct.field(pytree_node=False)  # K

  @property
  def shape(self) -> tuple[int, ...]:
    """``(L, B, S, K, H)``."""
    bk, s, h = self.layers[0].shape
    return (len(self.layers), bk // self.kv_heads, s, self.kv_heads, h)

  @property
  def dtype(self) -> jnp.dtype:
    return self.layers[0].dtype

  @classmethod
  def from_stacked(cls, x_LBSKH: jax.Array) -> "LayerCaches":
    l, b, s, k, h = x_LBSKH.shape
    return cls(tuple(jnp.transpose(x_LBSKH[i], (0, 2, 1, 3)).reshape(b * k, s, h)
                     for i in range(l)), k)

  def layer_BSKH(self, i: int) -> jax.Array:
    """Layer ``i`` as ``[B, S, K, H]`` (a transpose XLA folds into the attention products)."""
    _, b, s, k, h = self.shape
    return jnp.transpose(self.layers[i].reshape(b, k, s, h), (0, 2, 1, 3))

  def stacked(self) -> jax.Array:
    """The ``[L, B, S, K, H]`` array."""
    return jnp.stack([self.layer_BSKH(i) for i in range(len(self.layers))])


class StackedKV(NamedTuple):
  """Layer ``layer`` of a model's key/value caches, passed to ``Attention`` as its ``kv_cache``.

  ``k`` and ``v`` are either ``[L, B, S, K, H]`` arrays or ``LayerCaches``. Attention writes its new
  entries into them in place (under ``jit``) and the next layer gets them: nothing is sliced out and
  stacked back, which would copy the whole cache at every step.
  """

  k: jax.Array | LayerCaches
  v: jax.Array | LayerCaches
  layer: int | jax.Array   # which layer this attention reads and writes (an int for LayerCaches)


def _read(cache, layer) -> jax.Array:
  """One layer's ``[B, S, K, H]`` (transposing ``LayerCaches`` back is free: XLA folds it into the
  attention products, which want heads-major operands)."""
  if isinstance(cache, LayerCaches):
    return cache.layer_BSKH(layer)
  return cache if layer is None else cache[layer]


def _write(cache, new_BTKH, cache_index_B, layer):
  """``cache`` with row b's T new entries at slots ``cache_index[b] .. + T - 1`` (of ``layer``).

  Updated in place under ``jit``: a scatter (rows may sit at different slots), or for one row a
  ``dynamic_update_slice``. XLA rewrites a one-row scatter into a bounds-checked update that it then
  duplicates into each consumer, copying the layer's cache several times per step.
  """
  b, t = new_BTKH.shape[:2]
  index_B = cache_index_B.astype(jnp.int32)
  new_BTKH = new_BTKH.astype(cache.dtype)
  heads_major = isinstance(cache, LayerCaches)
  x = cache.layers[layer] if heads_major else cache
  if b == 1:
    zero = jnp.zeros((), jnp.int32)
    if heads_major:  # [K, S, H]
      x = jax.lax.dynamic_update_slice(x, jnp.swapaxes(new_BTKH[0], 0, 1), (zero, index_B[0], zero))
    else:
      start = (zero, index_B[0], zero, zero)
      x = jax.lax.dynamic_update_slice(
          x, new_BTKH if layer is None else new_BTKH[None],
          start if layer is None else (jnp.asarray(layer, jnp.int32),) + start)
  else:
    rows_B1 = jnp.arange(b)[:, None]
    slots_BT = index_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    if heads_major:  # [B, K, S, H] indexed by (rows, :, slots): the [B, T] index dims come first
      x = x.reshape(b, -1, *x.shape[1:]).at[rows_B1, :, slots_BT].set(new_BTKH, mode="clip")
      x = x.reshape(-1, *x.shape[2:])
    elif layer is None:
      x = x.at[rows_B1, slots_BT].set(new_BTKH, mode="clip")
    else:
      x = x.at[layer, rows_B1, slots_BT].set(new_BTKH, mode="clip")
  if heads_major:
    return LayerCaches(cache.layers[:layer] + (x,) + cache.layers[layer + 1:], cache.kv_heads)
  return x
