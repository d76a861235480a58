"""Encoder-decoder models: the Transformer of Vaswani et al. (sinusoidal positions, post-LayerNorm,
ReLU, one shared embedding scaled by sqrt(d_model)) and T5 (shared relative-position bias,
pre-RMSNorm, no biases, optional gated GELU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers import Embed, KVCache, Norm, RelativePositionBias, Stack
from transformer_jax.models.common import (
  check_length,
  check_same_shape,
  check_tokens,
  output_heads,
  with_matmul_precision,
)
from transformer_jax.models.config import Seq2SeqConfig, unrolls_layers


class Seq2Seq(nnx.Module):
  """``Seq2Seq(config, rngs=...)(src, tgt_in, src_mask=..., tgt_mask=...) -> logits [B, T, V]``.

  Ids in ``[0, vocab_size)``: eager calls refuse others; under ``jax.jit`` the embedding lookup
  clamps them silently (``models.checked`` checks them on the device)."""

  def __init__(
    self,
    config: Seq2SeqConfig,
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    """``mesh``: the device mesh the model runs on; ``backend``: its kernels (see ``GPT``)."""
    self.config = config
    self.backend = backend = backend or backends.current()
    c = config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    self.embed = Embed(
      c.vocab_size,
      c.d_model,
      init_std=c.embedding_init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
    stack = dict(
      remat=c.remat, unroll=unrolls_layers(c, backend), rngs=rngs, mesh=mesh, backend=backend
    )
    self.encoder = Stack(c.block_config(decoder=False), c.num_encoder_layers, **stack)
    self.decoder = Stack(c.block_config(decoder=True), c.num_decoder_layers, **stack)
    norm = dict(kind=c.norm, eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs)
    # Pre-norm stacks end with a norm (T5's final_layer_norm); post-norm stacks already end normed.
    self.encoder_norm = Norm(c.d_model, **norm) if c.pre_norm else None
    self.decoder_norm = Norm(c.d_model, **norm) if c.pre_norm else None
    if c.position == "relative":
      rel = dict(
        num_buckets=c.relative_num_buckets,
        max_distance=c.relative_max_distance,
        init_std=c.init_std,
        param_dtype=param_dtype,
        rngs=rngs,
      )
      self.encoder_rel_bias = RelativePositionBias(c.num_heads, bidirectional=True, **rel)
      self.decoder_rel_bias = RelativePositionBias(c.num_heads, bidirectional=False, **rel)
    else:
      self.encoder_rel_bias = self.decoder_rel_bias = None
    self.lm_head, self.classifier = output_heads(
      c, dtype=dtype, param_dtype=param_dtype, backend=backend, rngs=rngs
    )

  def _embed(
    self, ids_BT: jax.Array, positions_BT: jax.Array | None, rng: jax.Array | None
  ) -> jax.Array:
    c = self.config
    x_BTD = self.embed(ids_BT)
    if c.embed_scale:
      x_BTD = x_BTD * jnp.asarray(c.d_model**0.5, x_BTD.dtype)
    if c.position == "sinusoidal":
      if positions_BT is None:
        check_length("sequence", ids_BT.shape[1], c.max_len)
        positions_BT = jnp.arange(ids_BT.shape[1])[None]
      x_BTD = x_BTD + jnp.take(
        ops.sinusoidal_positions(c.max_len, c.d_model), positions_BT, axis=0, mode="clip"
      ).astype(x_BTD.dtype)
    return ops.dropout(x_BTD, c.dropout_rate, rng)

  @staticmethod
  def _relative_bias(rel_bias: RelativePositionBias | None) -> dict:
    """T5's bias as a function of positions, its table the (differentiable) parameters."""
    if rel_bias is None:
      return {}
    return dict(bias_fn=rel_bias.bias_fn, bias_params=rel_bias.table())

  @with_matmul_precision
  def encode(
    self, src: jax.Array, src_mask: jax.Array | None = None, *, dropout_rng: jax.Array | None = None
  ) -> jax.Array:
    """Encoder states ``[B, S, D]`` for source ids ``[B, S]`` (src_mask: False for padding)."""
    c = self.config
    check_tokens("src", src, c.vocab_size)
    check_same_shape("src_mask", src_mask, "src", src)
    embed_rng, blocks_rng, out_rng = (
      (None,) * 3 if dropout_rng is None else jax.random.split(dropout_rng, 3)
    )
    x_BSD, _ = self.encoder(
      self._embed(src, None, embed_rng),
      kv_valid=_valid(src_mask, src),
      dropout_rng=blocks_rng,
      **self._relative_bias(self.encoder_rel_bias),
    )
    if self.encoder_norm is not None:
      x_BSD = ops.dropout(self.encoder_norm(x_BSD), c.dropout_rate, out_rng)
    return x_BSD

  @with_matmul_precision
  def classify(
    self, src: jax.Array, src_mask: jax.Array | None = None, *, dropout_rng: jax.Array | None = None
  ) -> jax.Array:
    """Classification logits ``[B, num_labels]`` (float32) from the mean of the encoder states
    over the real source tokens (the encoder has no [CLS] position); the decoder is unused."""
    if self.classifier is None:
      raise ValueError("this Seq2Seq has no classification head: set num_labels > 0 in its config")
    x_BSD = self.encode(src, src_mask, dropout_rng=dropout_rng).astype(jnp.float32)
    valid_BS = jnp.ones(src.shape, bool) if src_mask is None else _valid(src_mask, src)
    w_BS = valid_BS.astype(jnp.float32)
    pooled_BD = jnp.sum(x_BSD * w_BS[..., None], 1) / jnp.maximum(jnp.sum(w_BS, 1), 1.0)[:, None]
    return self.classifier(pooled_BD).astype(jnp.float32)

  @with_matmul_precision
  def decode(
    self,
    tgt_in: jax.Array,
    encoder_out: jax.Array | None,
    src_mask: jax.Array | None = None,
    tgt_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
    cache: KVCache | None = None,
    layer_params: tuple[nnx.State, ...] | None = None,
  ):
    """Logits ``[B, T, V]`` (float32) for decoder inputs ``[B, T]`` given encoder states.

    With a ``cache`` (decoding, see ``transformer_jax.generate``): a ``KVCache`` from
    ``init_cache`` whose ``cross`` holds the encoder's keys/values (``cross_cache``);
    ``encoder_out`` and ``src_mask`` are then unused. Row b's T new tokens sit at positions
    ``cache.lengths[b] + t``. ``layer_params``: the decoder layers' parameters from
    ``split_layers`` (optional). Returns ``(logits, cache)``.
    """
    c = self.config
    check_tokens("tgt_in", tgt_in, c.vocab_size)
    check_same_shape("tgt_mask", tgt_mask, "tgt_in", tgt_in)
    positions_BT = None
    if cache is not None:
      if tgt_mask is not None:
        raise ValueError("with a cache, tgt_mask must be None (positions come from its lengths)")
      if cache.cross is None:
        raise ValueError(
          "the cache has no cross-attention keys/values: add them with "
          "cross_cache (generate.with_encoder)"
        )
      positions_BT = cache.positions(tgt_in.shape[1])
    embed_rng, blocks_rng, out_rng = (
      (None,) * 3 if dropout_rng is None else jax.random.split(dropout_rng, 3)
    )
    x_BTD, cache = self.decoder(
      self._embed(tgt_in, positions_BT, embed_rng),
      causal=True,
      kv_valid=_valid(tgt_mask, tgt_in),
      encoder_out=encoder_out,
      encoder_valid=_valid(src_mask, encoder_out),
      dropout_rng=blocks_rng,
      cache=cache,
      layer_params=layer_params,
      **self._relative_bias(self.decoder_rel_bias),
    )
    if self.decoder_norm is not None:
      x_BTD = ops.dropout(self.decoder_norm(x_BTD), c.dropout_rate, out_rng)
    if self.lm_head is not None:
      logits_BTV = self.lm_head(x_BTD).astype(jnp.float32)
    else:
      if c.logits_rescale:
        x_BTD = x_BTD * jnp.asarray(c.d_model**-0.5, x_BTD.dtype)
      logits_BTV = self.embed.attend(x_BTD).astype(jnp.float32)
    return logits_BTV if cache is None else (logits_BTV, cache)

  @staticmethod
  def init_cache(config: Seq2SeqConfig, batch_size: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """An empty decoder ``KVCache`` of ``max_len`` slots per row (add ``cross_cache``)."""
    return KVCache.zeros(
      config.num_decoder_layers, batch_size, max_len, config.kv_heads, config.head_size, dtype
    )

  @with_matmul_precision
  def cross_cache(self, encoder_out: jax.Array, src_mask: jax.Array | None = None) -> KVCache:
    """Every decoder layer's cross-attention keys/values of ``encoder_out`` ``[B, S, D]``,
    projected once, as a read-only ``KVCache`` (``src_mask`` ``[B, S]``: False for padding)."""
    k_LBSKH, v_LBSKH = self.decoder.map_layers(lambda block: block.project_cross_kv(encoder_out))
    b, s = encoder_out.shape[:2]
    valid_BS = jnp.ones((b, s), bool) if src_mask is None else _valid(src_mask, encoder_out)
    return KVCache.read_only(k_LBSKH, v_LBSKH, valid_BS)

  def split_layers(self) -> tuple[nnx.State, ...]:
    """The decoder layers' parameters, one state per layer: ``layer_params`` of a decoding loop."""
    return self.decoder.split_layers()

  @with_matmul_precision
  def __call__(
    self,
    src: jax.Array,
    tgt_in: jax.Array,
    src_mask: jax.Array | None = None,
    tgt_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
  ) -> jax.Array:
    enc_rng, dec_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
    encoder_out = self.encode(src, src_mask, dropout_rng=enc_rng)
    return self.decode(tgt_in, encoder_out, src_mask, tgt_mask, dropout_rng=dec_rng)


def _valid(mask: jax.Array | None, like: jax.Array | None) -> jax.Array | None:
  """A ``[B, L]`` (or broadcastable) 0/1 or bool padding mask as ``[B, L]`` bool (None stays)."""
  if mask is None or like is None:
    return mask if mask is None else jnp.asarray(mask).astype(bool)
  return jnp.broadcast_to(jnp.asarray(mask).astype(bool), like.shape[:2])
