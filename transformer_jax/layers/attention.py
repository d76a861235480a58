"""Multi-head attention (self or cross; MHA/MQA/GQA; optional RoPE) around
``ops.dot_product_attention``; decoding passes a ``KVCache`` in and out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers.cache import KVCache
from transformer_jax.layers.dense import Norm, Projection
from transformer_jax.parallel import axes as ax
from transformer_jax.ops.linear_attn import EPS as LINEAR_EPS
from transformer_jax.ops.linear_attn import feature_map as linear_feature_map


@dataclasses.dataclass(frozen=True)
class LinearKind:
  """Self-attention as causal linear attention (``ops.linear_attention``) instead of softmax:
  ``chunk_size`` positions per chunk of its parallel form, and a decay per query head (RetNet's
  gamma) or None."""

  chunk_size: int = 64
  decay: tuple[float, ...] | None = None


class Attention(nnx.Module):
  """Projects to heads, attends, projects back. Takes plain numbers, not a model config."""

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    use_bias: bool,
    init_std: float,
    out_init_std: float,
    dtype: jnp.dtype,
    param_dtype: jnp.dtype,
    rngs: nnx.Rngs,
    rope_theta: float | None = None,
    rope_interleaved: bool = False,
    rope_scaling: ops.RopeScaling | None = None,
    scale: float | None = None,
    implementation: ops.Implementation | None = None,
    mesh: Mesh | None = None,
    linear: LinearKind | None = None,
    backend: backends.Backend | None = None,
    qkv_bias: bool | None = None,
    out_bias: bool | None = None,
    qk_norm: Literal["layernorm", "rmsnorm"] | None = None,
    qk_norm_eps: float = 1e-6,
  ):
    """``qkv_bias``/``out_bias``: biases on the query/key/value and output projections (None:
    ``use_bias``). ``qk_norm``: a norm of that kind (epsilon ``qk_norm_eps``) over the head
    dimension of each query and key head before RoPE, one ``[head_dim]`` scale for the queries
    and one for the keys (Qwen3); None: none. ``implementation``: the attention kernel (None: the
    backend's choice). ``mesh``: the mesh the model runs on; self-attention runs as ring attention
    when it has a ``sequence`` axis of size > 1 (see ``__call__``). ``linear``: causal linear
    attention instead of softmax (its decoding cache is a ``LinearCache``). ``backend``: the
    kernels (``Backend.attention`` and its products; default ``backends.current()``)."""
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    d, n, k, h = d_model, num_heads, num_kv_heads, head_dim
    qkv_bias = use_bias if qkv_bias is None else qkv_bias
    out_bias = use_bias if out_bias is None else out_bias
    self.backend = backend = backend or backends.current()
    common = dict(
      init_std=init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend
    )
    self.query = Projection(
      "BTD,DNH->BTNH",
      (d, n, h),
      (ax.EMBED, ax.HEADS, ax.HEAD_DIM),
      bias_shape=(n, h) if qkv_bias else None,
      bias_axes=(ax.HEADS, ax.HEAD_DIM),
      **common,
    )
    self.key = Projection(
      "BSD,DKH->BSKH",
      (d, k, h),
      (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
      bias_shape=(k, h) if qkv_bias else None,
      bias_axes=(ax.KV_HEADS, ax.HEAD_DIM),
      **common,
    )
    self.value = Projection(
      "BSD,DKH->BSKH",
      (d, k, h),
      (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM),
      bias_shape=(k, h) if qkv_bias else None,
      bias_axes=(ax.KV_HEADS, ax.HEAD_DIM),
      **common,
    )
    common["init_std"] = out_init_std
    self.out = Projection(
      "BTNH,NHD->BTD",
      (n, h, d),
      (ax.HEADS, ax.HEAD_DIM, ax.EMBED),
      bias_shape=(d,) if out_bias else None,
      bias_axes=(ax.EMBED,),
      **common,
    )
    if qk_norm is None:
      self.q_norm = self.k_norm = None
    else:
      norm = dict(kind=qk_norm, eps=qk_norm_eps, param_dtype=param_dtype, rngs=rngs)
      self.q_norm = Norm(h, axis=ax.HEAD_DIM, **norm)
      self.k_norm = Norm(h, axis=ax.HEAD_DIM, **norm)
    self.rope_theta = rope_theta
    self.rope_interleaved = rope_interleaved
    self.rope_scaling = rope_scaling
    self.scale = scale
    self.implementation = implementation
    self.mesh = mesh
    self.linear = linear

  def __call__(
    self,
    x_BTD: jax.Array,
    kv_BSD: jax.Array | None = None,
    *,
    positions: jax.Array | None = None,
    causal: bool = False,
    kv_valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    bias_fn: Callable[..., jax.Array] | None = None,
    bias_params: Any = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    cache: KVCache | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """Self-attention over ``x`` or, with ``kv_BSD`` (or a read-only ``cache``), cross-attention.

    The mask is given by its parts (see ``ops.dot_product_attention``), never as a dense array.

    Args:
      x_BTD: queries' inputs ``[B, T, D]``.
      kv_BSD: keys'/values' inputs ``[B, S, D]`` (default ``x``).
      positions: ``[B, T]`` or ``[T]`` positions for RoPE (default ``0..T-1``, or the cache slots).
      causal: queries see keys at positions up to their own.
      kv_valid: ``[B, S]`` bool, False for padding keys.
      segment_ids: ``[B, T]`` int; tokens attend only within their segment (self-attention).
      window: sliding window: keys less than ``window`` positions away.
      bias_fn: additive bias of the positions (``ops.AlibiBias``, ``ops.RelativeBias``), with its
        ``bias_params``.
      dropout_rate: on the attention weights, applied when ``dropout_rng`` is given.
      cache: one layer of a ``KVCache`` (decoding). A self-attention cache gets the keys/values of
        ``x`` written at its slots ``lengths[b] ..``, which are the queries' positions; the queries
        attend to the whole cache. A rolling cache (``KVCache.window``) holds the last W
        positions in a ring; the queries attend to them and to the new tokens. A read-only cache
        supplies the keys/values (``kv_BSD`` unused) and its ``kv_valid``.

    Returns:
      ``(out [B, T, D], cache)``: the cache with the new entries written (None without one).

    The kernel is the backend's choice (``Backend.attention``, or the layer's
    ``implementation``): under a mesh with a ``sequence`` axis of size > 1, self-attention without
    a cache, bias, window or attention dropout runs as ring attention (``parallel.ring``); GSPMD
    handles the rest.
    """
    if self.linear is not None:
      return self._linear(x_BTD, positions, causal, cache, kv_valid, segment_ids)
    q_BTNH = self.query(x_BTD)
    q_positions = None
    if cache is not None and cache.lengths is None:  # keys/values projected once
      k_BSKH, v_BSKH = cache.read()
      kv_valid = cache.kv_valid
    else:
      kv_BSD = x_BTD if kv_BSD is None else kv_BSD
      k_BSKH, v_BSKH = self.key(kv_BSD), self.value(kv_BSD)
      if cache is not None:
        positions = q_positions = cache.positions(x_BTD.shape[1])
      q_BTNH, k_BSKH = self._rope(q_BTNH, k_BSKH, positions)
      if cache is not None and cache.window is not None:
        # A rolling cache: the W cached keys in position order, then the T new ones, so key j
        # sits at position lengths - W + j for every row; the queries' positions are given in
        # that frame (W + t), the same for every row, and the chunked kernel can skip the keys
        # outside each query block's window.
        old_k, old_v, old_valid = cache.ordered()
        w = cache.max_len
        cache = cache.write_rolling(k_BSKH, v_BSKH)
        k_BSKH = jnp.concatenate([old_k, k_BSKH.astype(old_k.dtype)], axis=1)
        v_BSKH = jnp.concatenate([old_v, v_BSKH.astype(old_v.dtype)], axis=1)
        t = x_BTD.shape[1]
        kv_valid = jnp.concatenate([old_valid, jnp.ones((old_valid.shape[0], t), bool)], axis=1)
        q_positions = jnp.arange(w, w + t, dtype=jnp.int32)[None, :]
      elif cache is not None:
        cache = cache.write(k_BSKH, v_BSKH)
        k_BSKH, v_BSKH = cache.read()
    out_BTNH = self.backend.attention(
      q_BTNH,
      k_BSKH.astype(q_BTNH.dtype),
      v_BSKH.astype(q_BTNH.dtype),
      causal=causal,
      kv_valid=kv_valid,
      q_segment_ids=segment_ids,
      window=window,
      q_positions=q_positions,
      bias_fn=bias_fn,
      bias_params=bias_params,
      scale=self.scale,
      dropout_rate=dropout_rate,
      dropout_rng=dropout_rng,
      implementation=self.implementation,
      mesh=self.mesh,
      self_attention=cache is None and kv_BSD is x_BTD,
    )
    if cache is not None:
      return self._out_merged(out_BTNH), cache
    return self.out(out_BTNH), None

  def _rope(self, q_BTNH, k_BTKH, positions):
    """Queries and keys normalised per head (if the layer has ``qk_norm``), then rotated by RoPE
    (if it has it) at ``positions`` (default ``0..T-1``)."""
    if self.q_norm is not None:
      q_BTNH = self.q_norm(q_BTNH)
      k_BTKH = self.k_norm(k_BTKH)
    if self.rope_theta is None:
      return q_BTNH, k_BTKH
    positions = jnp.arange(q_BTNH.shape[1]) if positions is None else positions
    rope = dict(theta=self.rope_theta, interleaved=self.rope_interleaved, scaling=self.rope_scaling)
    return ops.apply_rope(q_BTNH, positions, **rope), ops.apply_rope(k_BTKH, positions, **rope)

  def _rotated(self, x_BTD, positions):
    """Queries and keys with RoPE (if any) at ``positions``, and values."""
    q_BTNH, k_BTKH = self._rope(self.query(x_BTD), self.key(x_BTD), positions)
    return q_BTNH, k_BTKH, self.value(x_BTD)

  def _linear(self, x_BTD, positions, causal, cache, kv_valid=None, segment_ids=None):
    """Causal linear attention; with a one-layer ``LinearCache``, from and into its state.

    ``kv_valid`` (padding) and ``segment_ids`` (packed documents, the state emptied at each
    document's first position) as in ``ops.linear_attention``. With a cache, the tokens past a
    row's ``new_valid`` are its right padding: they neither add to nor decay its state."""
    if not causal:
      raise ValueError("linear attention here is causal (a decoder's self-attention)")
    lin = self.linear
    if cache is None:
      q, k, v = self._rotated(x_BTD, positions)
      out_BTNH = ops.linear_attention(
        q,
        k,
        v,
        chunk_size=lin.chunk_size,
        decay=lin.decay,
        kv_valid=kv_valid,
        segment_ids=segment_ids,
      )
      return self.out(out_BTNH.astype(q.dtype)), None
    t = x_BTD.shape[1]
    q, k, v = self._rotated(x_BTD, cache.positions(t))
    state = ops.LinearState(cache.s[0], cache.z[0])
    if t == 1 and cache.new_valid is None:
      out_BTNH, state = ops.linear_attention_step(state, q, k, v, decay=lin.decay)
    else:
      n_B = (
        jnp.full((x_BTD.shape[0],), t, jnp.int32)
        if cache.new_valid is None
        else jnp.asarray(cache.new_valid, jnp.int32)
      )
      valid_BT = jnp.arange(t)[None, :] < n_B[:, None]
      out_BTNH, state = ops.linear_attention(
        q,
        k,
        v,
        chunk_size=lin.chunk_size,
        decay=lin.decay,
        initial_state=state,
        return_state=True,
        kv_valid=valid_BT,
      )
    cache = cache.replace(s=(state.s,), z=(state.z,))
    return self._out_merged(out_BTNH.astype(q.dtype)), cache

  def weights(
    self,
    x_BTD: jax.Array,
    *,
    positions: jax.Array | None = None,
    causal: bool = False,
    kv_valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    bias_fn: Callable[..., jax.Array] | None = None,
    bias_params: Any = None,
  ) -> jax.Array:
    """The self-attention weights ``[B, N, T, S]`` (float32) that ``__call__`` on ``x`` uses,
    with the same mask and bias parts (no cache, no dropout): for pictures and inspection."""
    if self.linear is not None:
      return self._linear_weights(x_BTD, positions, kv_valid, segment_ids)
    q_BTNH, k_BSKH = self._rope(self.query(x_BTD), self.key(x_BTD), positions)
    # The values do not change the weights; the keys stand in for them.
    _, weights_BNTS = ops.dot_product_attention(
      q_BTNH,
      k_BSKH.astype(q_BTNH.dtype),
      k_BSKH.astype(q_BTNH.dtype),
      causal=causal,
      kv_valid=kv_valid,
      q_segment_ids=segment_ids,
      window=window,
      bias_fn=bias_fn,
      bias_params=bias_params,
      scale=self.scale,
      return_weights=True,
      implementation="xla",
    )
    return weights_BNTS

  def _linear_weights(self, x_BTD, positions, kv_valid=None, segment_ids=None):
    """Linear attention's weights ``[B, N, T, T]``: ``phi(q_i) . phi(k_j)`` over its row's sum,
    causal, for valid keys ``j`` of query i's document, decayed by gamma per valid position in
    ``(j, i]`` (as ``ops.linear_attention`` weighs them)."""
    q, k = self._rope(self.query(x_BTD), self.key(x_BTD), positions)
    b, t, n, _ = q.shape
    phi_k = jnp.repeat(linear_feature_map(k), n // k.shape[2], axis=2)
    w_BNTS = jnp.einsum("bins,bjns->bnij", linear_feature_map(q), phi_k)
    valid_BT = jnp.ones((b, t), bool) if kv_valid is None else jnp.asarray(kv_valid, bool)
    doc_BT = (
      jnp.zeros((b, t), jnp.int32)
      if segment_ids is None
      else jnp.concatenate(
        [
          jnp.zeros((b, 1), jnp.int32),
          jnp.cumsum(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1, dtype=jnp.int32),
        ],
        1,
      )
    )
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    same_BTT = (j <= i)[None] & (doc_BT[:, :, None] == doc_BT[:, None, :]) & valid_BT[:, None, :]
    mask_BNTT = same_BTT[:, None].astype(jnp.float32)
    if self.linear.decay is not None:
      count_BT = jnp.cumsum(valid_BT, axis=1, dtype=jnp.int32)
      gap_BTT = jnp.where(same_BTT, count_BT[:, :, None] - count_BT[:, None, :], 0)
      log_g_N = jnp.log(jnp.asarray(self.linear.decay, jnp.float32))
      mask_BNTT = mask_BNTT * jnp.exp(
        log_g_N[None, :, None, None] * gap_BTT[:, None].astype(jnp.float32)
      )
    w_BNTS = w_BNTS * mask_BNTT
    return w_BNTS / (jnp.sum(w_BNTS, axis=-1, keepdims=True) + LINEAR_EPS)

  def project_kv(self, kv_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[B, S, K, H]`` of ``kv_BSD`` (no RoPE): a read-only cross-attention
    cache."""
    return self.key(kv_BSD), self.value(kv_BSD)

  def _out_merged(self, out_BTNH: jax.Array) -> jax.Array:
    """``self.out`` with the heads merged into one contracted axis (the same numbers).

    ``jnp.einsum("BTNH,NHD->BTD")`` contracts ``(H, N)`` in that order and XLA's CPU backend then
    copies the ``[N, H, D]`` kernel into an ``[H, N, D]`` layout at every call, i.e. at every layer
    of every decoded token; contracting the merged ``N*H`` axis reads the kernel where it is.
    """
    return self.out(out_BTNH, merged=True)
