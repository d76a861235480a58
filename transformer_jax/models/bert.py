"""BERT (Devlin et al., 2019): a post-LayerNorm encoder with masked-LM, next-sentence and
sequence-classification heads."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers import Embed, Norm, Projection, Stack
from transformer_jax.layers.common import param, zeros
from transformer_jax.models.common import (
  check_length,
  check_same_shape,
  check_tokens,
  with_matmul_precision,
)
from transformer_jax.models.config import BERTConfig, unrolls_layers
from transformer_jax.parallel import axes as ax


class BERTOutput(NamedTuple):
  mlm_logits: jax.Array  # [B, T, V] float32
  nsp_logits: jax.Array  # [B, 2] float32; class 0 = "B follows A", 1 = "B is random"


class BERT(nnx.Module):
  """``BERT(config, rngs=...)(tokens, token_types, attention_mask) -> BERTOutput``."""

  def __init__(
    self,
    config: BERTConfig,
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
    dense = dict(
      init_std=c.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend
    )
    emb = dict(
      init_std=c.init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend
    )
    self.embed = Embed(c.vocab_size, c.d_model, **emb)
    self.pos_embed = Embed(c.max_len, c.d_model, axes=(ax.POSITIONS, ax.EMBED), **emb)
    self.type_embed = Embed(c.type_vocab_size, c.d_model, axes=(ax.TYPES, ax.EMBED), **emb)
    self.embed_norm = Norm(
      c.d_model, kind="layernorm", eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs
    )
    self.blocks = Stack(
      c.block_config(),
      c.num_layers,
      remat=c.remat,
      unroll=unrolls_layers(c, backend),
      rngs=rngs,
      mesh=mesh,
      backend=backend,
    )
    self.pooler = Projection(
      "BD,DE->BE",
      (c.d_model, c.d_model),
      (ax.EMBED, ax.EMBED),
      bias_shape=(c.d_model,),
      bias_axes=(ax.EMBED,),
      **dense,
    )
    # Masked-LM head: transform (dense, activation, LayerNorm), then the tied decoder plus a bias.
    self.mlm_dense = Projection(
      "BTD,DE->BTE",
      (c.d_model, c.d_model),
      (ax.EMBED, ax.EMBED),
      bias_shape=(c.d_model,),
      bias_axes=(ax.EMBED,),
      **dense,
    )
    self.mlm_norm = Norm(
      c.d_model, kind="layernorm", eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs
    )
    self.mlm_bias = param(rngs, zeros, (c.vocab_size,), (ax.VOCAB,), param_dtype)
    self.nsp = Projection(
      "BD,DC->BC",
      (c.d_model, 2),
      (ax.EMBED, ax.CLASSES),
      bias_shape=(2,),
      bias_axes=(ax.CLASSES,),
      **dense,
    )
    self.classifier = (
      Projection(
        "BD,DC->BC",
        (c.d_model, c.num_labels),
        (ax.EMBED, ax.CLASSES),
        bias_shape=(c.num_labels,),
        bias_axes=(ax.CLASSES,),
        **dense,
      )
      if c.num_labels
      else None
    )

  @with_matmul_precision
  def encode(
    self,
    tokens: jax.Array,
    token_types: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Bidirectional encoding.

    Args:
      tokens: ``[B, T]`` ids in ``[0, vocab_size)`` (under ``jax.jit`` an id outside is clamped
        silently unless the function is wrapped by ``models.checked``); token_types ``[B, T]``
        segment ids (default 0); attention_mask ``[B, T]`` bool/0-1 with False for padding
        (default all real).
      dropout_rng: a key turns dropout on.

    Returns:
      ``(hidden [B, T, D], pooled [B, D])``; pooled is ``tanh(W h_[CLS] + b)``.
    """
    embed_rng, blocks_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
    x_BTD, valid_BT = self._embedded(tokens, token_types, attention_mask, embed_rng)
    x_BTD, _ = self.blocks(x_BTD, kv_valid=valid_BT, dropout_rng=blocks_rng)
    pooled_BD = jnp.tanh(self.pooler(x_BTD[:, 0]))
    return x_BTD, pooled_BD

  @with_matmul_precision
  def attention_weights(
    self,
    tokens: jax.Array,
    token_types: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
  ) -> jax.Array:
    """Every layer's self-attention weights ``[L, B, N, T, S]`` (float32, S = T), padding keys
    masked as in ``encode`` (arguments as there; no dropout)."""
    x_BTD, valid_BT = self._embedded(tokens, token_types, attention_mask, None)
    return self.blocks.attention_weights(x_BTD, kv_valid=valid_BT)[1]

  def _embedded(self, tokens, token_types, attention_mask, embed_rng):
    """Checked inputs embedded ``[B, T, D]`` and the valid keys ``[B, T]`` (None: all)."""
    c = self.config
    check_tokens("tokens", tokens, c.vocab_size)
    check_tokens("token_types", token_types, c.type_vocab_size)
    check_same_shape("token_types", token_types, "tokens", tokens)
    check_same_shape("attention_mask", attention_mask, "tokens", tokens)
    check_length("tokens", tokens.shape[1], c.max_len)
    if token_types is None:
      token_types = jnp.zeros_like(tokens)
    positions = jnp.arange(tokens.shape[1])[None, :]
    x_BTD = self.embed(tokens) + self.pos_embed(positions) + self.type_embed(token_types)
    x_BTD = ops.dropout(self.embed_norm(x_BTD), c.dropout_rate, embed_rng)
    valid_BT = (
      None
      if attention_mask is None
      else jnp.broadcast_to(jnp.asarray(attention_mask).astype(bool), tokens.shape)
    )
    return x_BTD, valid_BT

  @with_matmul_precision
  def mlm_logits(self, x_BTD: jax.Array) -> jax.Array:
    """Masked-LM logits ``[B, T, V]`` (float32) from encoder hidden states."""
    h = self.mlm_norm(ops.get_activation(self.config.activation)(self.mlm_dense(x_BTD)))
    return (self.embed.attend(h) + self.mlm_bias[...]).astype(jnp.float32)

  @with_matmul_precision
  def __call__(
    self,
    tokens: jax.Array,
    token_types: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
  ) -> BERTOutput:
    x_BTD, pooled_BD = self.encode(tokens, token_types, attention_mask, dropout_rng=dropout_rng)
    return BERTOutput(self.mlm_logits(x_BTD), self.nsp(pooled_BD).astype(jnp.float32))

  @with_matmul_precision
  def classify(
    self,
    tokens: jax.Array,
    token_types: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
  ) -> jax.Array:
    """Sequence-classification logits ``[B, num_labels]`` from the pooled [CLS] state."""
    if self.classifier is None:
      raise ValueError("this BERT has no classification head: set num_labels > 0 in its config")
    pool_rng, enc_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
    _, pooled_BD = self.encode(tokens, token_types, attention_mask, dropout_rng=enc_rng)
    pooled_BD = ops.dropout(pooled_BD, self.config.dropout_rate, pool_rng)
    return self.classifier(pooled_BD).astype(jnp.float32)
