"""Losses, computed in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    mask: jax.Array | None = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """Mean token cross-entropy over unmasked positions.

  Args:
    logits: ``[..., V]``, any float dtype (upcast to float32).
    labels: integer ``[...]`` in ``[0, V)``. Positions whose label is outside that range must be
      masked out (their loss is undefined).
    mask: optional ``[...]`` bool/0-1 weights; default all ones.
    label_smoothing: ``eps``: the target is ``(1 - eps) * onehot + eps / V``.
    z_loss: coefficient of the auxiliary ``logsumexp(logits)^2`` term (PaLM), which keeps the
      softmax normaliser near 1.

  Returns:
    ``(loss, count)``: the mean over unmasked tokens (0 when there are none) and the number of
    unmasked tokens, both float32 scalars.
  """
  if logits.shape[:-1] != labels.shape:
    raise ValueError(
        f"logits.shape={logits.shape} must be labels.shape={labels.shape} plus a vocabulary axis")
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  label_logits = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
  nll = lse - label_logits
  if label_smoothing:
    smooth = lse - jnp.mean(logits, axis=-1)  # cross-entropy against the uniform distribution
    nll = (1.0 - label_smoothing) * nll + label_smoothing * smooth
  if z_loss:
    nll = nll + z_loss * jnp.square(lse)
  weights = jnp.ones_like(nll) if mask is None else mask.astype(jnp.float32)
  count = jnp.sum(weights)
  loss = jnp.sum(nll * weights) / jnp.maximum(count, 1.0)
  return loss, count
