"""One transformer block (self-attention, optional cross-attention, feed-forward), pre- or post-norm."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers.attention import Attention
from transformer_jax.layers.common import split_key
from transformer_jax.layers.dense import Norm
from transformer_jax.layers.mlp import MLP


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
  pre_norm: bool                          # pre-LN (GPT-2, T5, LLaMA) or post-LN (BERT, Vaswani)
  use_bias: bool                          # biases on the attention and MLP projections
  cross_attention: bool = False           # decoder blocks of an encoder-decoder
  rope_theta: float | None = None         # None: no rotary embedding
  rope_interleaved: bool = False
  rope_scaling: ops.RopeScaling | None = None
  attention_scale: float | None = None    # None: 1/sqrt(head_dim); T5 uses 1.0
  dropout_rate: float = 0.0               # on each residual branch
  attention_dropout_rate: float = 0.0     # on the attention weights
  ffn_dropout_rate: float = 0.0           # after the MLP activation (T5)
  init_std: float = 0.02
  out_init_std: float = 0.02              # output projections (GPT-2 scales by 1/sqrt(2L))
  dtype: str = "float32"
  param_dtype: str = "float32"


class Block(nnx.Module):
  """``x + attn(norm x)`` then ``x + mlp(norm x)`` (pre-norm) or ``norm(x + attn x)`` (post-norm)."""

  def __init__(self, cfg: BlockConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    norm = dict(kind=cfg.norm, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
    attn = dict(use_bias=cfg.use_bias, init_std=cfg.init_std, out_init_std=cfg.out_init_std,
                dtype=dtype, param_dtype=param_dtype, rngs=rngs, scale=cfg.attention_scale)
    self.attn_norm = Norm(cfg.d_model, **norm)
    self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          rope_theta=cfg.rope_theta, rope_interleaved=cfg.rope_interleaved,
                          rope_scaling=cfg.rope_scaling, **attn)
    if cfg.cross_attention:
      self.cross_norm = Norm(cfg.d_model, **norm)
      # Cross-attention keys come from the encoder: no rotary embedding, all heads (MHA).
      self.cross_attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                  **attn)
    else:
      self.cross_norm = self.cross_attn = None
    self.mlp_norm = Norm(cfg.d_model, **norm)
    self.mlp = MLP(cfg.d_model, cfg.d_ff, activation=cfg.activation, gated=cfg.gated,
                   use_bias=cfg.use_bias, init_std=cfg.init_std, out_init_std=cfg.out_init_std,
                   dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  def _residual(self, x, norm, fn, rng):
    """One sub-layer with its residual connection, dropout and norm in the configured place."""
    rate = self.cfg.dropout_rate
    if self.cfg.pre_norm:
      return x + ops.dropout(fn(norm(x)), rate, rng)
    return norm(x + ops.dropout(fn(x), rate, rng))

  def __call__(self, x_BTD: jax.Array, *, mask: jax.Array | None = None,
               bias: jax.Array | None = None, positions: jax.Array | None = None,
               encoder_out: jax.Array | None = None, encoder_mask: jax.Array | None = None,
               encoder_bias: jax.Array | None = None,
               dropout_rng: jax.Array | None = None,
               kv_cache: dict | None = None,
               cache_index: jax.Array | None = None,
               mask_parts=None) -> jax.Array | tuple[jax.Array, dict]:
    """Args: x ``[B, T, D]``; masks/biases broadcastable to ``[B, N, T, S]``; encoder_out ``[B, S, D]``.

    ``kv_cache`` (decoding) is ``{"self": (k, v)}`` plus, for cross-attention blocks,
    ``"cross": (k, v)`` projected once from the encoder output (``encoder_out`` is then unused);
    each array is ``[B, S, K, H]``. Self-attention writes at ``cache_index`` ``[B]``. With a cache
    the block returns ``(x, new_kv_cache)``. ``mask_parts``: the self-attention mask by parts
    (``layers.attention.MaskParts``), for ring attention.
    """
    if kv_cache is not None:
      return self._cached(x_BTD, kv_cache, cache_index, mask=mask, bias=bias,
                          positions=positions, encoder_mask=encoder_mask,
                          encoder_bias=encoder_bias)
    cfg = self.cfg
    r_attn, r_attn_w, r_cross, r_cross_w, r_mlp, r_mlp_in = split_key(dropout_rng, 6)
    attn_drop = cfg.attention_dropout_rate
    x = self._residual(x_BTD, self.attn_norm, lambda h: self.attn(
        h, mask=mask, bias=bias, positions=positions, dropout_rate=attn_drop,
        dropout_rng=r_attn_w, mask_parts=mask_parts), r_attn)
    if self.cross_attn is not None:
      if encoder_out is None:
        raise ValueError("this block has cross-attention: pass encoder_out [B, S, D]")
      x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(
          h, encoder_out, mask=encoder_mask, bias=encoder_bias, dropout_rate=attn_drop,
          dropout_rng=r_cross_w), r_cross)
    return self._residual(x, self.mlp_norm, lambda h: self.mlp(
        h, dropout_rate=cfg.ffn_dropout_rate, dropout_rng=r_mlp_in), r_mlp)

  def init_cross_cache(self, encoder_out_BSD: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cross-attention keys/values ``[B, S, K, H]`` of the encoder output, computed once."""
    return self.cross_attn.project_kv(encoder_out_BSD)

  def _cached(self, x_BTD, kv_cache, cache_index, *, mask, bias, positions, encoder_mask,
              encoder_bias):
    """The block at inference (no dropout) against key/value caches."""
    new_cache = dict(kv_cache)

    def self_attn(h):
      out, new_cache["self"] = self.attn(h, mask=mask, bias=bias, positions=positions,
                                         kv_cache=kv_cache["self"], cache_index=cache_index)
      return out

    x = self._residual(x_BTD, self.attn_norm, self_attn, None)
    if self.cross_attn is not None:
      x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(
          h, mask=encoder_mask, bias=encoder_bias, kv_cache=kv_cache["cross"])[0], None)
    return self._residual(x, self.mlp_norm, self.mlp, None), new_cache
