"""Attention that approximates or thins out softmax attention: block-sparse patterns
(``ops.sparse``) and Linformer's low-rank projections (``ops.linformer``).

``ApproxAttention`` is ``Attention`` (the same query/key/value/output projections, so weights
move between the kinds) whose self-attention runs the kind it is given; a block builds it when its
``BlockConfig.approx`` is set.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers.attention import Attention
from transformer_jax.layers.common import normal, param
from transformer_jax.ops.linformer import linformer_attention
from transformer_jax.parallel import axes as ax


@dataclasses.dataclass(frozen=True)
class SparseKind:
  """Self-attention under a block-sparse ``pattern`` (``ops.SparsePattern``)."""

  pattern: ops.SparsePattern


@dataclasses.dataclass(frozen=True)
class LinformerKind:
  """Linformer: keys and values projected along the sequence to ``rows`` rows by learned
  ``[rows, max_len]`` projections (one shared by keys and values when ``share_kv``); an
  encoder's self-attention (no causal mask, no cache, no packed segments)."""

  rows: int
  max_len: int
  share_kv: bool = False


ApproxKind = SparseKind | LinformerKind


class ApproxAttention(Attention):
  """``Attention`` whose self-attention is a ``SparseKind`` or ``LinformerKind``."""

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    approx: ApproxKind,
    rngs: nnx.Rngs,
    param_dtype: jnp.dtype,
    **kwargs,
  ):
    super().__init__(
      d_model, num_heads, num_kv_heads, head_dim, rngs=rngs, param_dtype=param_dtype, **kwargs
    )
    self.approx = approx
    if isinstance(approx, LinformerKind):
      # E k sums max_len rows: std 1/sqrt(max_len) keeps the projected keys at the keys' scale.
      init = normal(approx.max_len**-0.5)
      shape, axes = (approx.rows, approx.max_len), (ax.POSITIONS, ax.POSITIONS)
      self.lowrank_k = param(rngs, init, shape, axes, param_dtype)
      self.lowrank_v = None if approx.share_kv else param(rngs, init, shape, axes, param_dtype)

  def __call__(
    self,
    x_BTD,
    kv_BSD=None,
    *,
    positions=None,
    causal=False,
    kv_valid=None,
    segment_ids=None,
    window=None,
    bias_fn=None,
    bias_params=None,
    dropout_rate=0.0,
    dropout_rng=None,
    cache=None,
  ):
    """As ``Attention.__call__``, self-attention only. A sparse kind decodes from a cache (each
    new query sees the cached keys its pattern row holds); Linformer takes no cache, causal
    mask or segments.

    Raises:
      ValueError: naming the option the kind does not take (cross-attention, a window or
        position bias, attention dropout; for Linformer also causal, segments or a cache).
    """
    kind = type(self.approx).__name__
    if kv_BSD is not None or window is not None or bias_fn is not None:
      raise ValueError(f"{kind} is self-attention without sliding_window or a position bias")
    if dropout_rate > 0.0 and dropout_rng is not None:
      raise ValueError(f"{kind} has no attention dropout: set attention_dropout_rate=0")
    if isinstance(self.approx, SparseKind):
      if cache is not None:
        return self._sparse_cached(x_BTD, causal, kv_valid, cache)
      q, k, v = self._rotated(x_BTD, positions)
      out_BTNH = ops.sparse_attention(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        self.approx.pattern,
        causal=causal,
        scale=self.scale,
        kv_valid=kv_valid,
        segment_ids=segment_ids,
      )
      return self.out(out_BTNH), None
    if causal or segment_ids is not None or cache is not None:
      raise ValueError(
        "LinformerKind is an encoder's attention: no causal mask, segment_ids or cache"
      )
    if x_BTD.shape[1] > self.approx.max_len:
      raise ValueError(
        f"{x_BTD.shape[1]} tokens exceed the Linformer projections' max_len={self.approx.max_len}"
      )
    q, k, v = self._rotated(x_BTD, positions)
    e_RS = self.lowrank_k[...]
    f_RS = e_RS if self.lowrank_v is None else self.lowrank_v[...]
    out_BTNH = linformer_attention(
      q, k.astype(q.dtype), v.astype(q.dtype), e_RS, f_RS, kv_valid=kv_valid, scale=self.scale
    )
    return self.out(out_BTNH), None

  def _sparse_cached(self, x_BTD, causal, kv_valid, cache):
    """Decoding: the new tokens' keys/values go into the cache, and each query attends to the
    cached keys its row of the pattern holds (``SparsePattern.rows``)."""
    if not causal or cache.window is not None or cache.lengths is None:
      raise ValueError("a sparse kind decodes causally from a full (not rolling) KVCache")
    positions = cache.positions(x_BTD.shape[1])
    q, k, v = self._rotated(x_BTD, positions)
    cache = cache.write(k, v)
    k_BSKH, v_BSKH = cache.read()
    q_pos_BT = jnp.broadcast_to(positions, q.shape[:2]).astype(jnp.int32)
    mask_BTS = self.approx.pattern.rows(q_pos_BT, k_BSKH.shape[1], causal=True)
    out_BTNH = ops.dot_product_attention(
      q,
      k_BSKH.astype(q.dtype),
      v_BSKH.astype(q.dtype),
      mask=mask_BTS[:, None],
      causal=True,
      q_positions=q_pos_BT,
      kv_valid=kv_valid,
      scale=self.scale,
    )
    return self._out_merged(out_BTNH), cache

  def weights(
    self,
    x_BTD,
    *,
    positions=None,
    causal=False,
    kv_valid=None,
    segment_ids=None,
    window=None,
    bias_fn=None,
    bias_params=None,
  ):
    """The self-attention weights ``[B, N, T, S]`` (float32): for a sparse kind, softmax under
    the pattern's mask; for Linformer, over the R projected rows (``S = R``)."""
    q, k = self._rope(self.query(x_BTD), self.key(x_BTD), positions)
    k = k.astype(q.dtype)
    if isinstance(self.approx, SparseKind):
      t = x_BTD.shape[1]
      mask = jnp.asarray(self.approx.pattern.mask(t, causal=causal))[None, None]
      return ops.dot_product_attention(
        q,
        k,
        k,
        mask=mask,
        causal=causal,
        kv_valid=kv_valid,
        q_segment_ids=segment_ids,
        scale=self.scale,
        return_weights=True,
        implementation="xla",
      )[1]
    if kv_valid is not None:
      k = k * kv_valid.astype(k.dtype)[:, :, None, None]
    k = jnp.einsum("RS,BSKH->BRKH", self.lowrank_k[...][:, : k.shape[1]].astype(k.dtype), k)
    return ops.dot_product_attention(
      q, k, k, scale=self.scale, return_weights=True, implementation="xla"
    )[1]
