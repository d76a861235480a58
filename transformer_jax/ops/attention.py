"""Scaled dot-product attention as a pure function.

Letter legend (as in ``jax.nn.dot_product_attention``), used for every shape suffix in this package:

  B batch, T query length, S key/value length, N query heads, K key/value heads,
  G = N // K query heads per key/value head, H head dim, D model width, F feed-forward width,
  V vocabulary, L layers.

Masks are boolean with ``True`` meaning *attend*. Additive biases (ALiBi, T5 relative bias) go in
``bias``. Softmax runs in float32 whatever the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax.ops.masks import and_masks, causal_mask

# A large finite negative rather than -inf: exp() of it is exactly 0, and a row whose every entry is
# masked still gives finite numbers (we zero such rows explicitly afterwards).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        f"q, k and v must be 4-D [B, T|S, N|K, H]; got q.shape={q.shape}, k.shape={k.shape}, "
        f"v.shape={v.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
  (b, _, n, h), (bk, _, kh, hk) = q.shape, k.shape
  if b != bk or h != hk:
    raise ValueError(
        f"q.shape={q.shape} and k.shape={k.shape} must share batch B and head dim H")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}")


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    causal: bool = False,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    return_weights: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """softmax(scale * q k^T + bias, masked) v, with multi-, multi-query and grouped-query heads.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]`` with ``N % K == 0`` (K == N: MHA, K == 1: MQA, else GQA).
    v: values ``[B, S, K, H]``.
    bias: additive logits bias broadcastable to ``[B, N, T, S]``.
    mask: boolean, broadcastable to ``[B, N, T, S]``; True = attend.
    causal: also apply a causal mask. Queries are aligned to the *end* of the keys (query ``i`` sits
      at key position ``S - T + i``), which is what a key/value cache needs.
    scale: logits scale; default ``1 / sqrt(H)``.
    dropout_rate: dropout on the attention weights (needs ``dropout_rng``).
    dropout_rng: PRNG key for attention dropout; ``None`` disables dropout.
    return_weights: also return the attention weights ``[B, N, T, S]`` (float32).

  Returns:
    ``[B, T, N, H]`` in q's dtype (and the weights if asked). A query row whose every key is
    masked yields zeros, not NaN.

  Raises:
    ValueError: on inconsistent shapes.
  """
  _check_shapes(q, k, v)
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  scale = h**-0.5 if scale is None else scale

  q_BTKGH = q.reshape(b, t, kh, g, h)
  logits_BKGTS = jnp.einsum(
      "BTKGH,BSKH->BKGTS", q_BTKGH, k, preferred_element_type=jnp.float32)
  logits_BNTS = logits_BKGTS.reshape(b, n, t, s) * jnp.float32(scale)
  if bias is not None:
    logits_BNTS = logits_BNTS + bias.astype(jnp.float32)

  if causal:
    mask = and_masks(mask, causal_mask(t, s))
  if mask is not None:
    mask = jnp.broadcast_to(mask, logits_BNTS.shape)
    logits_BNTS = jnp.where(mask, logits_BNTS, _MASK_VALUE)
  weights_BNTS = jax.nn.softmax(logits_BNTS, axis=-1)
  if mask is not None:
    # A fully masked row would be uniform after softmax; zero it (and every masked entry).
    weights_BNTS = jnp.where(mask, weights_BNTS, 0.0)

  probs_BNTS = weights_BNTS
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, probs_BNTS.shape)
    probs_BNTS = jnp.where(keep, probs_BNTS / (1.0 - dropout_rate), 0.0)

  probs_BKGTS = probs_BNTS.astype(v.dtype).reshape(b, kh, g, t, s)
  out_BTKGH = jnp.einsum("BKGTS,BSKH->BTKGH", probs_BKGTS, v)
  out_BTNH = out_BTKGH.reshape(b, t, n, h)
  if return_weights:
    return out_BTNH, weights_BNTS
  return out_BTNH
