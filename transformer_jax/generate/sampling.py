"""Choosing the next token from logits: greedy, temperature, top-k and top-p (nucleus)
truncation."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from transformer_jax import ops

_NEG_INF = -jnp.inf


def truncate_logits(
  logits_BV: jax.Array, *, top_k: int | None = None, top_p: float | None = None
) -> jax.Array:
  """Logits with every token outside the top-k and outside the top-p nucleus set to -inf.

  top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (the most
  likely token is always kept). Both are applied when both are given (top-k first).
  """
  logits_BV = logits_BV.astype(jnp.float32)
  if top_k is not None and top_k < logits_BV.shape[-1]:
    kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, _NEG_INF, logits_BV)
  if top_p is not None and top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    # A sorted token is kept when the mass strictly before it is below top_p.
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    keep_BV = mass_before_BV < top_p
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, _NEG_INF, logits_BV)
  return logits_BV


def apply_repetition_penalty(logits_BV: jax.Array, seen_BV: jax.Array, penalty: float) -> jax.Array:
  """CTRL's repetition penalty (Keskar et al.): logits of tokens already seen are divided by
  ``penalty`` when positive and multiplied by it when negative (``penalty > 1`` discourages
  them)."""
  logits_BV = logits_BV.astype(jnp.float32)
  penalised = jnp.where(logits_BV > 0, logits_BV / penalty, logits_BV * penalty)
  return jnp.where(seen_BV, penalised, logits_BV)


def next_token(
  logits_BV: jax.Array,
  key: jax.Array | None,
  *,
  temperature: float,
  top_k: int | None = None,
  top_p: float | None = None,
) -> jax.Array:
  """``[B]`` int32: argmax when ``temperature == 0``, else a sample from the truncated softmax."""
  if temperature == 0.0:
    return ops.argmax(logits_BV, axis=-1)
  logits_BV = truncate_logits(logits_BV / jnp.float32(temperature), top_k=top_k, top_p=top_p)
  return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)
