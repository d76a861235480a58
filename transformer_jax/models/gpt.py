"""Decoder-only language models: GPT-2 (learned positions, LayerNorm, GELU, tied embeddings) and
LLaMA (RoPE, RMSNorm, SwiGLU, GQA, untied), plus ALiBi and sliding-window attention as options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers import Embed, MaskParts, Norm, Projection, Stack
from transformer_jax.models.common import check_length, check_same_shape, check_tokens
from transformer_jax.models.config import GPTConfig
from transformer_jax.parallel import axes as ax


class GPT(nnx.Module):
  """``GPT(config, rngs=nnx.Rngs(0))(tokens) -> logits [B, T, V]``."""

  def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
    self.config = config
    c = config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    self.embed = Embed(c.vocab_size, c.d_model, init_std=c.init_std, dtype=dtype,
                       param_dtype=param_dtype, rngs=rngs)
    self.pos_embed = (Embed(c.max_len, c.d_model, init_std=c.init_std / 2, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs, axes=(ax.POSITIONS, ax.EMBED))
                      if c.position == "learned" else None)
    self.blocks = Stack(c.block_config(), c.num_layers, remat=c.remat, unroll=not c.scan_layers,
                        rngs=rngs)
    self.final_norm = Norm(c.d_model, kind=c.norm, eps=c.norm_eps, param_dtype=param_dtype,
                           rngs=rngs)
    self.lm_head = (None if c.tie_embeddings else Projection(
        "BTD,DV->BTV", (c.d_model, c.vocab_size), (ax.EMBED, ax.VOCAB), init_std=c.init_std,
        dtype=dtype, param_dtype=param_dtype, rngs=rngs))

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None, attention_mask: jax.Array | None = None, *,
               dropout_rng: jax.Array | None = None, kv_cache=None,
               cache_index: jax.Array | None = None):
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` token ids.
      positions: ``[B, T]`` positions (default ``0..T-1``); packed sequences restart them per document.
      segment_ids: ``[B, T]`` ints; tokens attend only within their segment (packed documents).
      attention_mask: ``[B, T]`` bool/0-1, False for padding keys.
      dropout_rng: a PRNG key turns dropout on (training); None means deterministic.
      kv_cache: decoding (see ``transformer_jax.generate``): ``{"self": (k, v)}`` with k, v
        ``[L, B, S, K, H]``. The T new tokens of row b sit at positions ``cache_index[b] + t`` and
        are written to those cache slots; they attend to the cache slots up to their own position
        (slots past a row's position may hold stale entries: they are masked). ``positions``,
        ``segment_ids`` and ``attention_mask`` must then be None.
      cache_index: ``[B]`` int, each row's number of tokens already in the cache.

    Returns:
      float32 logits ``[B, T, V]``; with ``kv_cache``, ``(logits, new_kv_cache)``.
    """
    if kv_cache is not None:
      if positions is not None or segment_ids is not None or attention_mask is not None:
        raise ValueError("with kv_cache, positions/segment_ids/attention_mask must be None "
                         "(positions come from cache_index)")
      x_BTD, kv_cache = self._cached_hidden_states(tokens, kv_cache, cache_index)
      return self.logits(x_BTD), kv_cache
    return self.logits(self.hidden_states(
        tokens, positions, segment_ids, attention_mask, dropout_rng=dropout_rng))

  def hidden_states(self, tokens, positions=None, segment_ids=None, attention_mask=None, *,
                    dropout_rng=None) -> jax.Array:
    """The final-normed hidden states ``[B, T, D]`` (before the output projection)."""
    c = self.config
    check_tokens("tokens", tokens, c.vocab_size)
    for name, arr in (("positions", positions), ("segment_ids", segment_ids),
                      ("attention_mask", attention_mask)):
      if arr is not None and jnp.ndim(arr) == 2:
        check_same_shape(name, arr, "tokens", tokens)
    t = tokens.shape[1]
    if c.position in ("learned", "sinusoidal"):
      check_length("tokens", t, c.max_len)
    if positions is None:
      positions = jnp.arange(t)[None, :]
    embed_rng, blocks_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)

    x_BTD = self.embed(tokens)
    if self.pos_embed is not None:
      x_BTD = x_BTD + self.pos_embed(positions)
    elif c.position == "sinusoidal":
      x_BTD = x_BTD + jnp.take(ops.sinusoidal_positions(c.max_len, c.d_model), positions,
                               axis=0).astype(x_BTD.dtype)
    x_BTD = ops.dropout(x_BTD, c.dropout_rate, embed_rng)

    mask = ops.causal_mask(t)
    if segment_ids is not None:
      mask = ops.and_masks(mask, ops.segment_mask(segment_ids))
    if attention_mask is not None:
      mask = ops.and_masks(mask, ops.padding_mask(attention_mask))
    if c.sliding_window is not None:
      mask = ops.and_masks(mask, ops.sliding_window_mask(t, t, c.sliding_window))
    bias = ops.alibi_bias(c.num_heads, t, t) if c.position == "alibi" else None
    parts = (MaskParts(causal=True, kv_valid_BS=attention_mask, segment_ids_BT=segment_ids)
             if c.sliding_window is None else None)

    x_BTD = self.blocks(x_BTD, mask=mask, bias=bias, positions=positions, dropout_rng=blocks_rng,
                        mask_parts=parts)
    return self.final_norm(x_BTD)

  def _cached_hidden_states(self, tokens, kv_cache, cache_index):
    """``hidden_states`` for T new tokens per row against a key/value cache (inference only)."""
    c = self.config
    check_tokens("tokens", tokens, c.vocab_size)
    t = tokens.shape[1]
    s = kv_cache["self"][0].shape[2]
    q_pos_BT = cache_index[:, None].astype(jnp.int32) + jnp.arange(t, dtype=jnp.int32)[None, :]
    k_pos_S = jnp.arange(s, dtype=jnp.int32)
    dist_BTS = q_pos_BT[:, :, None] - k_pos_S[None, None, :]       # query minus key position

    x_BTD = self.embed(tokens)
    if self.pos_embed is not None:
      x_BTD = x_BTD + self.pos_embed(q_pos_BT)
    elif c.position == "sinusoidal":
      x_BTD = x_BTD + jnp.take(ops.sinusoidal_positions(c.max_len, c.d_model), q_pos_BT,
                               axis=0, mode="clip").astype(x_BTD.dtype)
    mask_BTS = dist_BTS >= 0
    if c.sliding_window is not None:
      mask_BTS = mask_BTS & (dist_BTS < c.sliding_window)
    bias = None
    if c.position == "alibi":
      slopes_N = jnp.asarray(ops.alibi_slopes(c.num_heads), jnp.float32)
      bias = -slopes_N[None, :, None, None] * jnp.abs(dist_BTS)[:, None].astype(jnp.float32)
    x_BTD, kv_cache = self.blocks(x_BTD, mask=mask_BTS[:, None], bias=bias, positions=q_pos_BT,
                                  kv_cache=kv_cache, cache_index=cache_index)
    return self.final_norm(x_BTD), kv_cache

  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Output projection (tied to the embedding unless ``tie_embeddings=False``), float32."""
    logits_BTV = self.embed.attend(x_BTD) if self.lm_head is None else self.lm_head(x_BTD)
    return logits_BTV.astype(jnp.float32)
