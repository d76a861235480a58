"""Mamba language models (Mamba-1, Mamba-2) and hybrid stacks of Mamba and attention layers: token
embedding, a ``MixerStack``, a final RMSNorm and the (tied or untied) vocabulary projection. The
same entry points as ``GPT`` (training, the fused loss, decoding with a cache)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from transformer_jax import backends, ops
from transformer_jax.layers import Embed, KVCache, MixerStack, Norm, Projection, SSMCache
from transformer_jax.models.common import (
  check_length,
  check_same_shape,
  check_tokens,
  hidden_lm_loss,
  with_matmul_precision,
)
from transformer_jax.models.config import MambaConfig, unrolls_layers
from transformer_jax.parallel import axes as ax


class Mamba(nnx.Module):
  """``Mamba(config, rngs=nnx.Rngs(0))(tokens) -> logits [B, T, V]``."""

  def __init__(
    self,
    config: MambaConfig,
    *,
    rngs: nnx.Rngs,
    mesh: Mesh | None = None,
    backend: backends.Backend | None = None,
  ):
    """``mesh``: the device mesh the model runs on (activation shardings); None on one device.
    ``backend``: the kernels its layers call (default ``backends.current()``)."""
    self.config = c = config
    self.backend = backend = backend or backends.current()
    dtype, param_dtype = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
    self.embed = Embed(
      c.vocab_size,
      c.d_model,
      init_std=c.init_std,
      dtype=dtype,
      param_dtype=param_dtype,
      rngs=rngs,
      backend=backend,
    )
    self.blocks = MixerStack(
      c.block_config(),
      c.layer_kinds,
      remat=c.remat,
      unroll=unrolls_layers(c, backend),
      rngs=rngs,
      mesh=mesh,
      backend=backend,
    )
    self.final_norm = Norm(
      c.d_model, kind="rmsnorm", eps=c.norm_eps, param_dtype=param_dtype, rngs=rngs
    )
    self.lm_head = (
      None
      if c.tie_embeddings
      else Projection(
        "BTD,DV->BTV",
        (c.d_model, c.vocab_size),
        (ax.EMBED, ax.VOCAB),
        init_std=c.init_std,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
        backend=backend,
      )
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
    cache: SSMCache | None = None,
    layer_params: tuple[nnx.State, ...] | None = None,
  ):
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` ids in ``[0, vocab_size)`` (an eager call refuses others).
      positions: ``[B, T]`` positions of the attention layers (rotary; default ``0..T-1``).
        The Mamba layers read order from the sequence itself.
      segment_ids: ``[B, T]`` packed documents: each Mamba layer's state restarts where the id
        changes, and attention stays within a document.
      attention_mask: ``[B, T]`` bool/0-1, False for padding (left or right): padding leaves
        every Mamba state as it was and is no attention key.
      dropout_rng: a PRNG key turns residual dropout on.
      cache: decoding (see ``transformer_jax.generate``): an ``SSMCache`` from ``init_cache``;
        its state continues from the row's earlier tokens. ``positions``, ``segment_ids`` and
        ``attention_mask`` must then be None.
      layer_params: with a cache, ``split_layers()`` (the same numbers, faster in a loop).

    Returns:
      float32 logits ``[B, T, V]``; with a cache, ``(logits, cache)``.
    """
    x_BTD, cache = self._hidden_states(
      tokens,
      positions,
      segment_ids,
      attention_mask,
      dropout_rng=dropout_rng,
      cache=cache,
      layer_params=layer_params,
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
  ):
    """The final-normed hidden states ``[B, T, D]``; with a ``cache``, ``(states, cache)``."""
    x_BTD, cache = self._hidden_states(
      tokens,
      positions,
      segment_ids,
      attention_mask,
      dropout_rng=dropout_rng,
      cache=cache,
      layer_params=layer_params,
    )
    return x_BTD if cache is None else (x_BTD, cache)

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
  ):
    c = self.config
    check_tokens("tokens", tokens, c.vocab_size)
    for name, arr in (
      ("positions", positions),
      ("segment_ids", segment_ids),
      ("attention_mask", attention_mask),
    ):
      if arr is not None and jnp.ndim(arr) == 2:
        check_same_shape(name, arr, "tokens", tokens)
    if cache is not None:
      if positions is not None or segment_ids is not None or attention_mask is not None:
        raise ValueError(
          "with a cache, positions/segment_ids/attention_mask must be None "
          "(the state carries the row's earlier tokens)"
        )
    else:
      check_length("tokens", tokens.shape[1], c.max_len)
    valid = None
    if attention_mask is not None:
      valid = jnp.broadcast_to(jnp.asarray(attention_mask).astype(bool), tokens.shape)
    embed_rng, blocks_rng = (None, None) if dropout_rng is None else jax.random.split(dropout_rng)
    x_BTD = ops.dropout(self.embed(tokens), c.dropout_rate, embed_rng)
    x_BTD, cache = self.blocks(
      x_BTD,
      valid=valid,
      segment_ids=segment_ids,
      positions=positions,
      dropout_rng=blocks_rng,
      cache=cache,
      layer_params=layer_params,
    )
    return self.final_norm(x_BTD), cache

  @with_matmul_precision
  def logits(self, x_BTD: jax.Array) -> jax.Array:
    """Output projection (tied to the embedding unless ``tie_embeddings=False``), float32."""
    logits_BTV = self.embed.attend(x_BTD) if self.lm_head is None else self.lm_head(x_BTD)
    return logits_BTV.astype(jnp.float32)

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
  ) -> tuple[jax.Array, jax.Array]:
    """The next-token loss without the ``[B, T, V]`` logits, as ``GPT.lm_loss``: ``(loss_sum,
    correct_sum)``, float32 scalars weighted by ``weights [B, T]``."""
    x_BTD = self.hidden_states(tokens, positions, segment_ids, dropout_rng=dropout_rng)
    return hidden_lm_loss(
      self, x_BTD, labels, weights, label_smoothing=label_smoothing, z_loss=z_loss
    )

  @staticmethod
  def init_cache(config: MambaConfig, batch_size: int, max_len: int, dtype: jnp.dtype) -> SSMCache:
    """An empty decoding state: per Mamba layer a convolution state ``[B, W - 1, C]`` and a scan
    state, whose size does not depend on ``max_len``; a hybrid's attention layers add a
    ``KVCache`` of ``max_len`` slots."""
    kinds = config.layer_kinds
    attention = kinds.count("attention")
    kv = (
      KVCache.zeros(attention, batch_size, max_len, config.kv_heads, config.head_size, dtype)
      if attention
      else None
    )
    return SSMCache.zeros(config.mamba_kind(), kinds.count("mamba"), batch_size, kv)

  def split_layers(self) -> tuple[nnx.State, ...]:
    """Every layer's parameters, in layer order: ``layer_params`` of a decoding loop."""
    return self.blocks.split_layers()
