"""A preallocated, static-shape key/value cache for decoding, and the calls that fill it.

Shapes never change while decoding, so one compiled step serves every position: the cache
(``layers.KVCache``) holds ``S`` slots per row, a row's tokens sit in slots ``0 .. lengths[b] - 1``
(slot = position), and a new token of row ``b`` is written at slot ``lengths[b]``. Slots past a
row's length may hold stale entries (padding of a shorter prompt, say); attention masks them by
position, so they never matter. Only the ``K`` key/value heads are stored (GQA/MQA caches are
``N / K`` times smaller). The model says what its cache looks like (``init_cache``) and which layers
decode (``split_layers``); an encoder-decoder's cache also carries the cross-attention keys/values
of the source, projected once (``with_encoder``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax import models
from transformer_jax.layers import KVCache

__all__ = ["KVCache", "extend", "init_cache", "split_layers", "with_encoder"]


def init_cache(
  config: models.ModelConfig, batch_size: int, max_len: int, dtype: str | jnp.dtype | None = None
) -> KVCache:
  """An empty self-attention cache of ``max_len`` slots per row (config's compute dtype by default).

  For a Seq2Seq config this is the decoder's cache; add the encoder side with ``with_encoder``.

  Raises:
    ValueError: if ``max_len`` is not positive or exceeds a learned/sinusoidal position table.
    TypeError: for a model without a decoder (BERT).
  """
  if max_len < 1:
    raise ValueError(f"max_len={max_len} must be >= 1")
  cls = models.model_class(config)
  if not hasattr(cls, "init_cache"):
    raise TypeError(f"no key/value cache for a {type(config).__name__}")
  if config.position in ("learned", "sinusoidal") and max_len > config.max_len:
    raise ValueError(f"max_len={max_len} exceeds the model's context max_len={config.max_len}")
  dtype = jnp.dtype(config.dtype if dtype is None else dtype)
  return cls.init_cache(config, batch_size, max_len, dtype)


def with_encoder(
  model, cache: KVCache, encoder_out_BSD: jax.Array, src_mask_BS: jax.Array | None = None
) -> KVCache:
  """``cache`` plus a Seq2Seq model's cross-attention keys/values of ``encoder_out`` (computed
  once)."""
  return cache.replace(cross=model.cross_cache(encoder_out_BSD, src_mask_BS))


def split_layers(model) -> tuple[nnx.State, ...]:
  """The decoding layers' parameters, one state per layer, for ``extend(..., layers=...)``.

  Call it once, outside a decoding loop (best in a ``jit`` of its own, as ``generate`` does: XLA
  then copies each slice with a plain memory copy): the loop body reads every layer's weights where
  they are. Without it each step slices them out of the layer-stacked arrays, i.e. copies all the
  weights of the model once per token (decoding one token is bound by reading the weights, so that
  copy costs about as much as the step itself).
  """
  return model.split_layers()


def extend(
  model,
  tokens_BT: jax.Array,
  cache: KVCache,
  num_valid: jax.Array | None = None,
  *,
  layers: tuple[nnx.State, ...] | None = None,
) -> tuple[jax.Array, KVCache]:
  """Runs ``T`` new tokens per row through the model with the cache: prefill (T = prompt) or a
  step (T = 1).

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
  lengths_B = cache.lengths
  if num_valid is not None:
    cache = cache.replace(new_valid=jnp.asarray(num_valid, jnp.int32))
  if cache.cross is None:
    logits_BTV, cache = model(tokens_BT, cache=cache, layer_params=layers)
  else:
    logits_BTV, cache = model.decode(tokens_BT, None, cache=cache, layer_params=layers)
  if num_valid is not None:
    cache = cache.replace(lengths=lengths_B + jnp.asarray(num_valid, jnp.int32), new_valid=None)
  return logits_BTV, cache


def prefill(
  model,
  prompt_BP: jax.Array,
  cache: KVCache,
  lengths_B: jax.Array,
  *,
  layers: tuple[nnx.State, ...] | None = None,
) -> tuple[jax.Array, KVCache]:
  """A GPT's prompt into the cache, and the logits ``[B, V]`` at each row's last prompt token only.

  The same numbers as ``extend`` followed by picking position ``lengths_B - 1``, without projecting
  every prompt position onto the vocabulary (``[B, P, V]``, most of a prompt's work).
  """
  before_B = cache.lengths
  lengths_B = jnp.asarray(lengths_B, jnp.int32)
  x_BPD, cache = model.hidden_states(
    prompt_BP, cache=cache.replace(new_valid=lengths_B), layer_params=layers
  )
  cache = cache.replace(lengths=before_B + lengths_B, new_valid=None)
  last_B1D = jnp.take_along_axis(x_BPD, (lengths_B - 1)[:, None, None], axis=1)
  return model.logits(last_B1D)[:, 0], cache
