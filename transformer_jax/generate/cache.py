"""A preallocated, static-shape key/value cache for decoder self-attention.

Shapes never change while decoding, so one compiled step serves every position: the cache holds
``S`` slots per row, a row's tokens sit in slots ``0 .. lengths[b] - 1`` (slot = position), and a new
token of row ``b`` is written at slot ``lengths[b]``. Slots past a row's length may hold stale
entries (padding of a shorter prompt, say); attention masks them by position, so they never matter.
Only the ``K`` key/value heads are stored (GQA/MQA caches are ``N / K`` times smaller).

For an encoder-decoder the cache also holds every decoder layer's cross-attention keys/values,
projected once from the encoder output (``with_encoder``), and the source padding mask.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.layers.attention import LayerCaches
from transformer_jax.models.config import GPTConfig, Seq2SeqConfig


@flax.struct.dataclass
class KVCache:
  """Self-attention keys/values of every layer plus each row's length.

  ``k``/``v`` (and ``cross``) are ``[L, B, S, K, H]`` arrays, or ``LayerCaches`` with that logical
  shape after ``per_layer``.
  """

  k: jax.Array | LayerCaches  # [L, B, S, K, H] keys, RoPE already applied
  v: jax.Array | LayerCaches  # [L, B, S, K, H] values
  lengths: jax.Array          # [B] int32: tokens in the cache = position of the row's next token
  cross: tuple[jax.Array, jax.Array] | None = None  # Seq2Seq: ([L, B, S_src, K, H],) * 2
  src_mask: jax.Array | None = None                  # Seq2Seq: [B, S_src] bool, False = padding

  @property
  def max_len(self) -> int:
    """S, the number of slots per row."""
    return self.k.shape[2]

  def as_layer_caches(self) -> dict:
    """The ``kv_cache`` pytree the models' layers take (``{"self": (k, v)}`` [+ ``"cross"``])."""
    if self.cross is None:
      return {"self": (self.k, self.v)}
    return {"self": (self.k, self.v), "cross": self.cross}


def per_layer(cache: KVCache) -> KVCache:
  """``cache`` with its arrays as ``LayerCaches``: one heads-major ``[B * K, S, H]`` array per layer.

  The same cache for ``extend`` (the same logits), in the layout a one-token step reads fastest on
  CPU; a decoding loop converts once, before it starts. ``LayerCaches.stacked()`` converts back.
  """
  def convert(x):
    return x if isinstance(x, LayerCaches) else LayerCaches.from_stacked(x)
  cross = None if cache.cross is None else tuple(convert(x) for x in cache.cross)
  return cache.replace(k=convert(cache.k), v=convert(cache.v), cross=cross)


def init_cache(config: GPTConfig | Seq2SeqConfig, batch_size: int, max_len: int,
               dtype: str | jnp.dtype | None = None) -> KVCache:
  """An empty self-attention cache of ``max_len`` slots per row (config's compute dtype by default).

  For a Seq2Seq config this is the decoder's cache; add the encoder side with ``with_encoder``.

  Raises:
    ValueError: if ``max_len`` is not positive or exceeds a learned/sinusoidal position table.
  """
  if max_len < 1:
    raise ValueError(f"max_len={max_len} must be >= 1")
  if config.position in ("learned", "sinusoidal") and max_len > config.max_len:
    raise ValueError(f"max_len={max_len} exceeds the model's context max_len={config.max_len}")
  dtype = jnp.dtype(config.dtype if dtype is None else dtype)
  match config:
    case GPTConfig():
      num_layers = config.num_layers
    case Seq2SeqConfig():
      num_layers = config.num_decoder_layers
    case _:
      raise TypeError(f"no key/value cache for a {type(config).__name__}")
  shape = (num_layers, batch_size, max_len, config.kv_heads, config.head_size)
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def with_encoder(model, cache: KVCache, encoder_out_BSD: jax.Array,
                 src_mask_BS: jax.Array | None = None) -> KVCache:
  """``cache`` plus a Seq2Seq model's cross-attention keys/values of ``encoder_out`` (computed once)."""
  b, s = encoder_out_BSD.shape[:2]
  src_mask_BS = jnp.ones((b, s), bool) if src_mask_BS is None else src_mask_BS.astype(bool)
  return cache.replace(cross=model.cross_kv(encoder_out_BSD), src_mask=src_mask_BS)


def split_layers(model) -> tuple[nnx.State, ...]:
  """The decoder layers' parameters, one state per layer, for ``extend(..., layers=...)``.

  Call it once, outside a decoding loop (best in a ``jit`` of its own, as ``generate`` does: XLA
  then copies each slice with a plain memory copy): the loop body reads every layer's weights where
  they are. Without it each step slices them out of the layer-stacked arrays, i.e. copies all the
  weights of the model once per token (decoding one token is bound by reading the weights, so that
  copy costs about as much as the step itself).
  """
  stack = model.decoder if isinstance(model.config, Seq2SeqConfig) else model.blocks
  return stack.split_layers()


def extend(model, tokens_BT: jax.Array, cache: KVCache,
           num_valid: jax.Array | None = None, *,
           layers: tuple[nnx.State, ...] | None = None) -> tuple[jax.Array, KVCache]:
  """Runs ``T`` new tokens per row through a GPT with the cache: prefill (T = prompt) or a step (T = 1).

  Args:
    model: a ``GPT`` module, or a ``Seq2Seq`` one with a ``with_encoder`` cache (decoder tokens).
    tokens_BT: ``[B, T]`` ids; row b's token t sits at position ``cache.lengths[b] + t``.
    cache: the cache; ``lengths[b] + T`` must not exceed ``cache.max_len``.
    num_valid: ``[B]`` how many of the T tokens are real (right padding); default all T. Padding
      tokens are written but lie past the row's new length, so later tokens overwrite them.
    layers: the model's ``split_layers`` (optional; the same numbers, faster inside a loop).

  Returns:
    float32 logits ``[B, T, V]`` (each equal to a full forward pass over the row so far) and the
    updated cache.
  """
  t = tokens_BT.shape[1]
  layer_caches = cache.as_layer_caches()
  if layers is not None:
    layer_caches["layers"] = layers
  if cache.cross is None:
    logits_BTV, layer_caches = model(tokens_BT, kv_cache=layer_caches, cache_index=cache.lengths)
  else:
    logits_BTV, layer_caches = model.decode(tokens_BT, None, cache.src_mask,
                                            kv_cache=layer_caches, cache_index=cache.lengths)
  k, v = layer_caches["self"]
  added = t if num_valid is None else jnp.asarray(num_valid, jnp.int32)
  return logits_BTV, cache.replace(k=k, v=v, lengths=cache.lengths + added)
