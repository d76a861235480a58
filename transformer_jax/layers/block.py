"""One transformer block (self-attention, optional cross-attention, feed-forward), pre- or
post-norm."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers.approx import ApproxAttention, ApproxKind
from transformer_jax.layers.attention import Attention, LinearKind
from transformer_jax.layers.cache import KVCache
from transformer_jax.layers.common import split_key
from transformer_jax.layers.dense import Norm
from transformer_jax.layers.mlp import MLP
from transformer_jax.layers.moe import MoE, MoEKind


@dataclasses.dataclass(frozen=True, slots=True)
class BlockConfig:
  """Everything a block needs; each model builds one from its own config."""

  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  d_ff: int
  activation: ops.Activation
  gated: bool
  norm: Literal["layernorm", "rmsnorm"]
  norm_eps: float
  pre_norm: bool  # pre-LN (GPT-2, T5, LLaMA) or post-LN (BERT, Vaswani)
  use_bias: bool  # biases on the attention and MLP projections
  # Biases per projection group (None: use_bias): query/key/value, attention output, MLP.
  qkv_bias: bool | None = None
  out_bias: bool | None = None
  mlp_bias: bool | None = None
  qk_norm: bool = False  # the block's norm over head_dim on queries and keys (before RoPE)
  cross_attention: bool = False  # decoder blocks of an encoder-decoder
  rope_theta: float | None = None  # None: no rotary embedding
  rope_interleaved: bool = False
  rope_scaling: ops.RopeScaling | None = None
  attention_scale: float | None = None  # None: 1/sqrt(head_dim); T5 uses 1.0
  attention_impl: ops.Implementation | None = (
    None  # kernel of ops.dot_product_attention; None: auto
  )
  linear: LinearKind | None = None  # self-attention as causal linear attention
  approx: ApproxKind | None = None  # self-attention block-sparse or Linformer (layers.approx)
  dropout_rate: float = 0.0  # on each residual branch
  attention_dropout_rate: float = 0.0  # on the attention weights
  ffn_dropout_rate: float = 0.0  # after the MLP activation (T5)
  init_std: float = 0.02
  out_init_std: float = 0.02  # output projections (GPT-2 scales by 1/sqrt(2L))
  dtype: str = "float32"
  param_dtype: str = "float32"
  norm_offset: float = 0.0  # RMSNorm scale (offset + w) (Gemma: 1.0)
  post_norms: bool = False  # a norm on each sub-layer's output before the residual add (Gemma)
  attn_softcap: float | None = None  # self-attention logits soft-cap (Gemma 2)
  rope_local_theta: float | None = None  # RoPE base of the layer's local (sliding) calls
  moe: MoEKind | None = None  # the feed-forward as a mixture of experts (layers.moe)


class Block(nnx.Module):
  """``x + attn(norm x)`` then ``x + mlp(norm x)`` (pre-norm) or ``norm(x + attn x)``
  (post-norm)."""

  def __init__(
    self,
    cfg: BlockConfig,
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    """``mesh``: where the block runs (see ``Attention``); ``backend``: its kernels (default
    ``backends.current()``)."""
    self.cfg = cfg
    backend = backend or backends.current()
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = dict(kind=cfg.norm, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    if cfg.norm_offset:
      norm["offset"] = cfg.norm_offset
    attn = dict(
      use_bias=cfg.use_bias,
      init_std=cfg.init_std,
      out_init_std=cfg.out_init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      scale=cfg.attention_scale,
      implementation=cfg.attention_impl,
      mesh=mesh,
      backend=backend,
    )
    self.attn_norm = Norm(cfg.d_model, **norm)
    self_kind = {} if cfg.approx is None else {"approx": cfg.approx}
    self.attn = (Attention if cfg.approx is None else ApproxAttention)(
      cfg.d_model,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
      rope_theta=cfg.rope_theta,
      rope_interleaved=cfg.rope_interleaved,
      rope_scaling=cfg.rope_scaling,
      linear=cfg.linear,
      qkv_bias=cfg.qkv_bias,
      out_bias=cfg.out_bias,
      qk_norm=cfg.norm if cfg.qk_norm else None,
      qk_norm_eps=cfg.norm_eps,
      **self_kind,
      **attn,
      **({} if cfg.attn_softcap is None else {"softcap": cfg.attn_softcap}),
      **({} if cfg.rope_local_theta is None else {"local_rope_theta": cfg.rope_local_theta}),
      **({"norm_offset": cfg.norm_offset} if cfg.qk_norm and cfg.norm_offset else {}),
    )
    if cfg.cross_attention:
      self.cross_norm = Norm(cfg.d_model, **norm)
      # Cross-attention keys come from the encoder: no rotary embedding; the same heads (and
      # key/value heads) as self-attention.
      self.cross_attn = Attention(
        cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, **attn
      )
    else:
      self.cross_norm = self.cross_attn = None
    self.mlp_norm = Norm(cfg.d_model, **norm)
    if cfg.post_norms:
      self.attn_post_norm, self.mlp_post_norm = Norm(cfg.d_model, **norm), Norm(cfg.d_model, **norm)
    if cfg.moe is not None:
      self.mlp = MoE(
        cfg.d_model,
        cfg.moe,
        activation=cfg.activation,
        init_std=cfg.init_std,
        out_init_std=cfg.out_init_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        backend=backend,
        mesh=mesh,
      )
    else:
      self.mlp = MLP(
        cfg.d_model,
        cfg.d_ff,
        activation=cfg.activation,
        gated=cfg.gated,
        use_bias=cfg.use_bias if cfg.mlp_bias is None else cfg.mlp_bias,
        init_std=cfg.init_std,
        out_init_std=cfg.out_init_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        backend=backend,
      )

  def _residual(self, x, norm, fn, rng, post=None):
    """One sub-layer with its residual connection, dropout and norm in the configured place
    (``post``: a norm on the sub-layer's output, Gemma's sandwich)."""
    rate = self.cfg.dropout_rate
    if post is not None:
      return x + ops.dropout(post(fn(norm(x))), rate, rng)
    if self.cfg.pre_norm:
      return x + ops.dropout(fn(norm(x)), rate, rng)
    return norm(x + ops.dropout(fn(x), rate, rng))

  def __call__(
    self,
    x_BTD: jax.Array,
    *,
    positions: jax.Array | None = None,
    causal: bool = False,
    kv_valid: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    window: int | None = None,
    bias_fn=None,
    bias_params=None,
    encoder_out: jax.Array | None = None,
    encoder_valid: jax.Array | None = None,
    dropout_rng: jax.Array | None = None,
    cache: KVCache | None = None,
    local: bool = False,
    moe_stats: list | None = None,
  ) -> tuple[jax.Array, KVCache | None]:
    """The block on ``x`` ``[B, T, D]``.

    The self-attention mask and bias come by parts (``positions``, ``causal``, ``kv_valid``,
    ``segment_ids``, ``window``, ``bias_fn``/``bias_params``: see ``Attention``); cross-attention
    attends to ``encoder_out`` ``[B, S, D]`` with ``encoder_valid`` ``[B, S]`` marking its padding.
    ``cache`` (decoding) is one layer of a ``KVCache``: self-attention writes into it, and
    cross-attention reads ``cache.cross`` (``encoder_out`` is then unused). ``local``: this is
    a sliding (local) layer: its RoPE base is ``rope_local_theta`` where the config has one.
    ``moe_stats``: a list a mixture-of-experts block appends its router statistics to
    (``layers.moe.MoE``).

    Returns:
      ``(x [B, T, D], cache)``, the cache with this step's keys/values (None without one).
    """
    cfg = self.cfg
    r_attn, r_attn_w, r_cross, r_cross_w, r_mlp, r_mlp_in = split_key(dropout_rng, 6)
    attn_drop = cfg.attention_dropout_rate

    def self_attn(h):
      nonlocal cache
      out, cache = self.attn(
        h,
        positions=positions,
        causal=causal,
        kv_valid=kv_valid,
        segment_ids=segment_ids,
        window=window,
        bias_fn=bias_fn,
        bias_params=bias_params,
        dropout_rate=attn_drop,
        dropout_rng=r_attn_w,
        cache=cache,
        **({"local": True} if local else {}),
      )
      return out

    posts = (self.attn_post_norm, self.mlp_post_norm) if cfg.post_norms else (None, None)
    x = self._residual(x_BTD, self.attn_norm, self_attn, r_attn, posts[0])
    if self.cross_attn is not None:
      cross = None if cache is None else cache.cross
      if encoder_out is None and cross is None:
        raise ValueError(
          "this block has cross-attention: pass encoder_out [B, S, D] (or a cache "
          "with its cross-attention keys/values)"
        )
      x = self._residual(
        x,
        self.cross_norm,
        lambda h: self.cross_attn(
          h,
          encoder_out,
          kv_valid=encoder_valid,
          dropout_rate=attn_drop,
          dropout_rng=r_cross_w,
          cache=cross,
        )[0],
        r_cross,
      )
    x = self._residual(
      x, self.mlp_norm, lambda h: self._ffn(h, r_mlp_in, moe_stats), r_mlp, posts[1]
    )
    return x, cache

  def _ffn(self, h_BTD, dropout_rng, moe_stats):
    if self.cfg.moe is None:
      return self.mlp(h_BTD, dropout_rate=self.cfg.ffn_dropout_rate, dropout_rng=dropout_rng)
    y_BTD, stats = self.mlp(h_BTD)
    if moe_stats is not None:
      moe_stats.append(stats)
    return y_BTD

  def attention_weights(self, x_BTD: jax.Array, **mask_parts) -> jax.Array:
    """The self-attention weights ``[B, N, T, S]`` of this block on its input ``x`` (the mask and
    bias parts as in ``__call__``; see ``Attention.weights``)."""
    h_BTD = self.attn_norm(x_BTD) if self.cfg.pre_norm else x_BTD
    if not mask_parts.pop("local", False):
      return self.attn.weights(h_BTD, **mask_parts)
    return self.attn.weights(h_BTD, **mask_parts, local=True)

  def project_cross_kv(self, encoder_out_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cross-attention keys/values ``[B, S, K, H]`` of the encoder output, computed once."""
    return self.cross_attn.project_kv(encoder_out_BSD)
