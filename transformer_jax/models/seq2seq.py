"""Encoder-decoder models: the Transformer of Vaswani et al. (sinusoidal positions, post-LayerNorm,
ReLU, one shared embedding scaled by sqrt(d_model)) and T5 (shared relative-position bias, pre-RMSNorm,
no biases, optional gated GELU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers import Embed, MaskParts, Norm, Projection, RelativePositionBias, Stack
from transformer_jax.models.common import check_length, check_same_shape, check_tokens
from transformer_jax.models.config import Seq2SeqConfig
from transformer_jax.parallel import axes as ax


class Seq2Seq(nnx.Module):
  """``Seq2Seq(config, rngs=...)(src, tgt_in, src_mask=..., tgt_mask=...) -> logits [B, T, V]``."""

  def __init__(self, config: Seq2SeqConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    self.embed = Embed(c.vocab_size, c.d_model, init_std=c.embedding_init_std, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)
    stack = dict(remat=c.remat, unroll=not c.scan_layers, rngs=rngs)
    self.encoder = Stack(c.block_config(decoder=False), c.num_encoder_layers, **stack)
    self.decoder = Stack(c.block_config(decoder=True), c.num_decoder_layers, **stack)
    norm = dict(kind=c.norm, eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs)
    # Pre-norm stacks end with a norm (T5's final_layer_norm); post-norm stacks already end normed.
    self.encoder_norm = Norm(c.d_model, **norm) if c.pre_norm else None
    self.decoder_norm = Norm(c.d_model, **norm) if c.pre_norm else None
    if c.position == "relative":
      rel = dict(num_buckets=c.relative_num_buckets, max_distance=c.relative_max_distance,
                 init_std=c.init_std, param_dtype=param_dtype, rngs=rngs)
      self.encoder_rel_bias = RelativePositionBias(c.num_heads, bidirectional=True, **rel)
      self.decoder_rel_bias = RelativePositionBias(c.num_heads, bidirectional=False, **rel)
    else:
      self.encoder_rel_bias = self.decoder_rel_bias = None
    self.lm_head = (None if c.tie_embeddings else Projection(
        "BTD,DV->BTV", (c.d_model, c.vocab_size), (ax.EMBED, ax.VOCAB), init_std=c.init_std,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs))

  def _embed(self, ids_BT: jax.Array, rng: jax.Array | None) -> jax.Array:
    c = self.config
    x_BTD = self.embed(ids_BT)
    if c.embed_scale:
      x_BTD = x_BTD * jnp.asarray(c.d_model**0.5, x_BTD.dtype)
    if c.position == "sinusoidal":
      check_length("sequence", ids_BT.shape[1], c.max_len)
      x_BTD = x_BTD + ops.sinusoidal_positions(ids_BT.shape[1], c.d_model).astype(x_BTD.dtype)
    return ops.dropout(x_BTD, c.dropout_rate, rng)

  def encode(self, src: jax.Array, src_mask: jax.Array | None = None, *,
             dropout_rng: jax.Array | None = None) -> jax.Array:
    """Encoder states ``[B, S, D]`` for source ids ``[B, S]`` (src_mask: False for padding)."""
    c = self.config
    check_tokens("src", src, c.vocab_size)
    check_same_shape("src_mask", src_mask, "src", src)
    embed_rng, blocks_rng, out_rng = ((None,) * 3 if dropout_rng is None
                                      else jax.random.split(dropout_rng, 3))
    s = src.shape[1]
    mask = None if src_mask is None else ops.padding_mask(src_mask)
    bias = None if self.encoder_rel_bias is None else self.encoder_rel_bias(s, s)
    x_BSD = self.encoder(self._embed(src, embed_rng), mask=mask, bias=bias, dropout_rng=blocks_rng,
                         mask_parts=MaskParts(kv_valid_BS=src_mask))
    if self.encoder_norm is not None:
      x_BSD = ops.dropout(self.encoder_norm(x_BSD), c.dropout_rate, out_rng)
    return x_BSD

  def decode(self, tgt_in: jax.Array, encoder_out: jax.Array, src_mask: jax.Array | None = None,
             tgt_mask: jax.Array | None = None, *,
             dropout_rng: jax.Array | None = None, kv_cache: dict | None = None,
             cache_index: jax.Array | None = None):
    """Logits ``[B, T, V]`` (float32) for decoder inputs ``[B, T]`` given encoder states.

    With ``kv_cache`` (decoding, see ``transformer_jax.generate``): ``{"self": (k, v), "cross":
    (k, v)}``, self-attention arrays ``[L, B, S, K, H]`` and cross-attention ones from
    ``cross_kv(encoder_out)``; ``encoder_out`` is then unused. Row b's T new tokens sit at
    positions ``cache_index[b] + t``. Returns ``(logits, new_kv_cache)``.
    """
    if kv_cache is not None:
      if tgt_mask is not None:
        raise ValueError("with kv_cache, tgt_mask must be None (positions come from cache_index)")
      return self._cached_decode(tgt_in, kv_cache, cache_index, src_mask)
    c = self.config
    check_tokens("tgt_in", tgt_in, c.vocab_size)
    check_same_shape("tgt_mask", tgt_mask, "tgt_in", tgt_in)
    embed_rng, blocks_rng, out_rng = ((None,) * 3 if dropout_rng is None
                                      else jax.random.split(dropout_rng, 3))
    t = tgt_in.shape[1]
    self_mask = ops.causal_mask(t)
    if tgt_mask is not None:
      self_mask = ops.and_masks(self_mask, ops.padding_mask(tgt_mask))
    cross_mask = None if src_mask is None else ops.padding_mask(src_mask)
    bias = None if self.decoder_rel_bias is None else self.decoder_rel_bias(t, t)
    x_BTD = self.decoder(self._embed(tgt_in, embed_rng), mask=self_mask, bias=bias,
                         encoder_out=encoder_out, encoder_mask=cross_mask, dropout_rng=blocks_rng,
                         mask_parts=MaskParts(causal=True, kv_valid_BS=tgt_mask))
    if self.decoder_norm is not None:
      x_BTD = ops.dropout(self.decoder_norm(x_BTD), c.dropout_rate, out_rng)
    if self.lm_head is not None:
      return self.lm_head(x_BTD).astype(jnp.float32)
    if c.logits_rescale:
      x_BTD = x_BTD * jnp.asarray(c.d_model**-0.5, x_BTD.dtype)
    return self.embed.attend(x_BTD).astype(jnp.float32)

  def cross_kv(self, encoder_out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Every decoder layer's cross-attention keys/values ``[L, B, S, K, H]``, computed once."""
    return self.decoder.map_layers(lambda block: block.init_cross_cache(encoder_out))

  def _cached_decode(self, tgt_in, kv_cache, cache_index, src_mask):
    """``decode`` for T new tokens per row against key/value caches (inference only)."""
    c = self.config
    check_tokens("tgt_in", tgt_in, c.vocab_size)
    t = tgt_in.shape[1]
    s = kv_cache["self"][0].shape[2]
    q_pos_BT = cache_index[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    rel_BTS = jnp.arange(s, dtype=jnp.int32)[None, None, :] - q_pos_BT[:, :, None]  # key - query

    x_BTD = self.embed(tgt_in)
    if c.embed_scale:
      x_BTD = x_BTD * jnp.asarray(c.d_model**0.5, x_BTD.dtype)
    if c.position == "sinusoidal":
      x_BTD = x_BTD + jnp.take(ops.sinusoidal_positions(c.max_len, c.d_model), q_pos_BT,
                               axis=0, mode="clip").astype(x_BTD.dtype)
    self_mask = (rel_BTS <= 0)[:, None]
    cross_mask = None if src_mask is None else ops.padding_mask(src_mask)
    bias = (None if self.decoder_rel_bias is None
            else self.decoder_rel_bias.for_relative_positions(rel_BTS))
    x_BTD, kv_cache = self.decoder(x_BTD, mask=self_mask, bias=bias, encoder_mask=cross_mask,
                                   kv_cache=kv_cache, cache_index=cache_index)
    if self.decoder_norm is not None:
      x_BTD = self.decoder_norm(x_BTD)
    if self.lm_head is not None:
      return self.lm_head(x_BTD).astype(jnp.float32), kv_cache
    if c.logits_rescale:
      x_BTD = x_BTD * jnp.asarray(c.d_model**-0.5, x_BTD.dtype)
    return self.embed.attend(x_BTD).astype(jnp.float32), kv_cache

  def __call__(self, src: jax.Array, tgt_in: jax.Array, src_mask: jax.Array | None = None,
               tgt_mask: jax.Array | None = None, *,
               dropout_rng: jax.Array | None = None) -> jax.Array:
    enc_rng, dec_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
    encoder_out = self.encode(src, src_mask, dropout_rng=enc_rng)
    return self.decode(tgt_in, encoder_out, src_mask, tgt_mask, dropout_rng=dec_rng)
