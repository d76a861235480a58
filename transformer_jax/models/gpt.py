"""Decoder-only language models: GPT-2 (learned positions, LayerNorm, GELU, tied embeddings) and
LLaMA (RoPE, RMSNorm, SwiGLU, GQA, untied), plus ALiBi and sliding-window attention as options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers import Embed, KVCache, LinearCache, Norm, Stack
from transformer_jax.models.common import (
  check_length,
  check_positions,
  check_same_shape,
  check_tokens,
  hidden_lm_loss,
  output_heads,
  with_matmul_precision,
)
from transformer_jax.models.config import GPTConfig, unrolls_layers
from transformer_jax.parallel import axes as ax


class GPT(nnx.Module):
  """``GPT(config, rngs=nnx.Rngs(0))(tokens) -> logits [B, T, V]``."""

  def __init__(
    self,
    config: GPTConfig,
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    """``mesh``: the device mesh the model runs on (activation shardings, ring attention under
    ``mesh.sequence > 1``); None on one device or to leave the layout to GSPMD. ``backend``: the
    kernels its layers call (default ``backends.current()``, the default kernel table)."""
    self.config = config
    self.backend = backend = backend or backends.current()
    c = config
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    # Sinusoidal positions (Vaswani et al. 3.4): token embeddings drawn with std d^-0.5 and
    # multiplied by sqrt(d), so tokens and the fixed table (entries of size ~1) are of one scale.
    token_std = c.d_model**-0.5 if c.position == "sinusoidal" else c.init_std
    self.embed = Embed(
      c.vocab_size,
      c.d_model,
      init_std=token_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
    self.pos_embed = (
      Embed(
        c.max_len,
        c.d_model,
        init_std=c.init_std / 2,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        axes=(ax.POSITIONS, ax.EMBED),
      )
      if c.position == "learned"
      else None
    )
    self.blocks = Stack(
      c.block_config(),
      c.num_layers,
      remat=c.remat,
      unroll=unrolls_layers(c, backend),
      reversible=c.reversible,
      rngs=rngs,
      mesh=mesh,
      backend=backend,
      **(
        {}
        if c.layer_types is None
        else {"local_layers": tuple(k == "sliding_attention" for k in c.layer_types)}
      ),
      **({"dense_layers": c.dense_layers} if c.dense_layers else {}),
    )
    self.final_norm = Norm(
      c.d_model,
      kind=c.norm,
      eps=c.norm_eps,
      param_dtype=param_dtype,
      rngs=rngs,
      **({"offset": float(c.norm_offset)} if c.norm_offset else {}),
    )
    self.lm_head, self.classifier = output_heads(
      c, dtype=dtype, param_dtype=param_dtype, rngs=rngs, backend=backend
    )

  @with_matmul_precision
  def __call__(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
    cache: KVCache | None = None,
    layer_params: tuple[nnx.State, ...] | None = None,
    moe_stats: list | None = None,
  ):
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` token ids in ``[0, vocab_size)``: an eager call refuses others; under
        ``jax.jit`` the embedding lookup clamps them silently (``models.checked`` checks them).
      positions: ``[B, T]`` positions (default ``0..T-1``); packed sequences restart them per
      document.
        With a learned or sinusoidal table they must lie in ``[0, max_len)`` (refused eagerly,
        and under ``models.checked``; a plain ``jax.jit`` clamps them).
      segment_ids: ``[B, T]`` ints; tokens attend only within their segment (packed documents).
      attention_mask: ``[B, T]`` bool/0-1, False for padding keys.
      dropout_rng: a PRNG key turns dropout on (training); None means deterministic.
      cache: decoding (see ``transformer_jax.generate``): a ``KVCache`` from ``init_cache``. Row b's
        T new tokens sit at positions ``cache.lengths[b] + t``, are written to those slots and
        attend to the slots up to their own position. ``positions``, ``segment_ids`` and
        ``attention_mask`` must then be None.
      layer_params: with a cache, the layers' parameters from ``split_layers`` (optional: the
        same numbers, faster inside a decoding loop).
      moe_stats: a list the mixture-of-experts layers' router statistics are appended to (one
        dict of ``[L, ...]`` arrays: ``layers.moe.MoE``), for the training loss and metrics.

    Returns:
      float32 logits ``[B, T, V]``; with a cache, ``(logits, cache)`` with the new tokens added.
    """
    x_BTD, cache = self._hidden_states(
      tokens,
      positions,
      segment_ids,
      attention_mask,
      dropout_rng=dropout_rng,
      cache=cache,
      layer_params=layer_params,
      moe_stats=moe_stats,
    )
    logits_BTV = self.logits(x_BTD)
    return logits_BTV if cache is None else (logits_BTV, cache)

  @with_matmul_precision
  def hidden_states(
    self,
    tokens,
    positions=None,
    segment_ids=None,
    attention_mask=None,
    *,
    dropout_rng=None,
    cache=None,
    layer_params=None,
    moe_stats=None,
  ):
    """The final-normed hidden states ``[B, T, D]`` (before the output projection); with a
    ``cache`` (as in ``__call__``), ``(hidden states, cache)``."""
    x_BTD, cache = self._hidden_states(
      tokens,
      positions,
      segment_ids,
      attention_mask,
      dropout_rng=dropout_rng,
      cache=cache,
      layer_params=layer_params,
      moe_stats=moe_stats,
    )
    return x_BTD if cache is None else (x_BTD, cache)

  @with_matmul_precision
  def attention_weights(
    self,
    tokens: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
  ) -> jax.Array:
    """Every layer's self-attention weights ``[L, B, N, T, S]`` (float32, S = T) for ``tokens``,
    with the masks and ALiBi bias of ``__call__`` (arguments as there; no dropout)."""
    x_BTD, block_kwargs, _, _ = self._block_inputs(tokens, positions, segment_ids, attention_mask)
    return self.blocks.attention_weights(x_BTD, **block_kwargs)[1]

  def _hidden_states(
    self,
    tokens,
    positions=None,
    segment_ids=None,
    attention_mask=None,
    *,
    dropout_rng=None,
    cache=None,
    layer_params=None,
    moe_stats=None,
  ):
    x_BTD, block_kwargs, blocks_rng, cache = self._block_inputs(
      tokens, positions, segment_ids, attention_mask, dropout_rng=dropout_rng, cache=cache
    )
    if moe_stats is not None:  # a dense model's stack takes no such argument
      block_kwargs["moe_stats"] = moe_stats
    x_BTD, cache = self.blocks(
      x_BTD, **block_kwargs, dropout_rng=blocks_rng, cache=cache, layer_params=layer_params
    )
    return self.final_norm(x_BTD), cache

  def _block_inputs(
    self,
    tokens,
    positions=None,
    segment_ids=None,
    attention_mask=None,
    *,
    dropout_rng=None,
    cache=None,
  ):
    """The embedded tokens ``[B, T, D]``, the blocks' mask and bias parts, their dropout key and
    the cache (``cache.positions`` give the positions when decoding)."""
    c = self.config
    check_tokens("tokens", tokens, c.vocab_size)
    for name, arr in (
      ("positions", positions),
      ("segment_ids", segment_ids),
      ("attention_mask", attention_mask),
    ):
      if arr is not None and jnp.ndim(arr) == 2:
        check_same_shape(name, arr, "tokens", tokens)
    t = tokens.shape[1]
    if cache is not None:
      if positions is not None or segment_ids is not None or attention_mask is not None:
        raise ValueError(
          "with a cache, positions/segment_ids/attention_mask must be None "
          "(positions come from the cache's lengths)"
        )
      positions = cache.positions(t)
    else:
      if c.position in ("learned", "sinusoidal"):
        check_length("tokens", t, c.max_len)
        check_positions("positions", positions, c.max_len)  # rows of a table: never clamped
      if positions is None:
        positions = jnp.arange(t)[None, :]
    if attention_mask is not None:
      attention_mask = jnp.broadcast_to(jnp.asarray(attention_mask).astype(bool), tokens.shape)
    embed_rng, blocks_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)

    x_BTD = self.embed(tokens)
    if c.embed_scale:  # Gemma: sqrt(d_model) rounded to the compute dtype, as transformers does
      x_BTD = x_BTD * jnp.asarray(c.d_model**0.5, x_BTD.dtype)
    if self.pos_embed is not None:
      x_BTD = x_BTD + self.pos_embed(positions)
    elif c.position == "sinusoidal":
      # Tokens at init_std (0.02) under a table of size ~1 reach the blocks as noise on the
      # positions, and the model never gets past the unigram loss: scale them up to the table's.
      x_BTD = x_BTD * jnp.asarray(c.d_model**0.5, x_BTD.dtype)
      x_BTD = x_BTD + jnp.take(
        ops.sinusoidal_positions(c.max_len, c.d_model), positions, axis=0, mode="clip"
      ).astype(x_BTD.dtype)
    x_BTD = ops.dropout(x_BTD, c.dropout_rate, embed_rng)

    # The mask by its parts; ALiBi as a function of positions (slopes as its parameters).
    alibi = c.position == "alibi"
    block_kwargs = dict(
      positions=positions,
      causal=True,
      kv_valid=attention_mask,
      segment_ids=segment_ids,
      window=c.sliding_window,
      bias_fn=ops.AlibiBias() if alibi else None,
      bias_params=jnp.asarray(ops.alibi_slopes(c.num_heads), jnp.float32) if alibi else None,
    )
    return x_BTD, block_kwargs, blocks_rng, cache

  @with_matmul_precision
  def classify(
    self,
    tokens: jax.Array,
    attention_mask: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
  ) -> jax.Array:
    """Classification logits ``[B, num_labels]`` (float32) from the final hidden state of each
    row's last real token (the only one that has seen the whole text under a causal mask).

    ``attention_mask``: ``[B, T]``, False for right padding (default: no padding).
    """
    if self.classifier is None:
      raise ValueError("this GPT has no classification head: set num_labels > 0 in its config")
    x_BTD = self.hidden_states(tokens, attention_mask=attention_mask, dropout_rng=dropout_rng)
    b, t = tokens.shape
    if attention_mask is None:
      last_B = jnp.full((b,), t - 1)
    else:
      valid_BT = jnp.broadcast_to(jnp.asarray(attention_mask).astype(bool), (b, t))
      last_B = jnp.maximum(jnp.sum(valid_BT, axis=1) - 1, 0)
    x_BD = jnp.take_along_axis(x_BTD, last_B[:, None, None], axis=1)[:, 0]
    return self.classifier(x_BD).astype(jnp.float32)

  @staticmethod
  def init_cache(config: GPTConfig, batch_size: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """An empty cache for ``max_len`` tokens per row for a model of ``config``: a ``KVCache`` of
    ``max_len`` slots, or a rolling one of ``sliding_window`` slots when the window is shorter;
    for linear attention a ``LinearCache``, whose size does not depend on ``max_len``. With
    ``layer_types``, each sliding layer's cache is rolling (W slots) and each full one has
    ``max_len``."""
    if config.attention_kind == "linear":
      return LinearCache.zeros(config.num_layers, batch_size, config.num_heads, config.head_size)
    if config.layer_types is not None:
      return KVCache.zeros(
        config.num_layers,
        batch_size,
        max_len,
        config.kv_heads,
        config.head_size,
        dtype,
        windows=config.layer_windows(),
      )
    return KVCache.zeros(
      config.num_layers,
      batch_size,
      max_len,
      config.kv_heads,
      config.head_size,
      dtype,
      window=config.sliding_window,
    )

  def split_layers(self) -> tuple[nnx.State, ...]:
    """The layers' parameters, one state per layer: ``layer_params`` of a decoding loop."""
    return self.blocks.split_layers()

  @with_matmul_precision
  def lm_loss(
    self,
    tokens: jax.Array,
    labels: jax.Array,
    weights: jax.Array,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    dropout_rng: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    moe_stats: list | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """The next-token loss without the ``[B, T, V]`` logits (``ops.linear_cross_entropy`` in the
    backend's layout).

    Args:
      tokens: ``[B, T]`` token ids; ``positions``, ``segment_ids``, ``dropout_rng`` as in
        ``__call__``.
      labels: ``[B, T]`` target ids.
      weights: ``[B, T]`` per-token loss weights (the loss mask).
      label_smoothing: as in ``ops.cross_entropy``.
      z_loss: as in ``ops.cross_entropy``.
      moe_stats: as in ``__call__``.

    Returns:
      ``(loss_sum, correct_sum)``: float32 scalars, the weighted sum of the token losses and of
      the tokens whose label has the largest logit.
    """
    x_BTD = self.hidden_states(
      tokens, positions, segment_ids, dropout_rng=dropout_rng, moe_stats=moe_stats
    )
    if self.config.final_softcap is not None:  # the fused loss takes no cap: through the logits
      logits_BTV = self.logits(x_BTD)
      loss, count = ops.cross_entropy(
        logits_BTV, labels, mask=weights, label_smoothing=label_smoothing, z_loss=z_loss
      )
      hits_BT = (jnp.argmax(logits_BTV, -1) == labels).astype(jnp.float32)
      return loss * count, jnp.sum(hits_BT * weights.astype(jnp.float32))
    return hidden_lm_loss(
      self, x_BTD, labels, weights, label_smoothing=label_smoothing, z_loss=z_loss
    )

  @with_matmul_precision
  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Output projection (tied to the embedding unless ``tie_embeddings=False``), float32, soft-
    capped by ``final_softcap`` where the config has one."""
    logits_BTV = self.embed.attend(x_BTD) if self.lm_head is None else self.lm_head(x_BTD)
    cap = self.config.final_softcap
    if cap is not None:
      return jnp.tanh(logits_BTV.astype(jnp.float32) / cap) * cap
    return logits_BTV.astype(jnp.float32)
