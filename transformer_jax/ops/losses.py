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
      f"logits.shape={logits.shape} must be labels.shape={labels.shape} plus a vocabulary axis"
    )
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
  lse, label_logits = _lse_and_label(logits, labels.astype(jnp.int32))
  nll = lse - label_logits
  if label_smoothing:
    # cross-entropy against the uniform distribution
    smooth = lse - jnp.mean(logits.astype(jnp.float32), axis=-1)
    nll = (1.0 - label_smoothing) * nll + label_smoothing * smooth
  if z_loss:
    nll = nll + z_loss * jnp.square(lse)
  weights = jnp.ones_like(nll) if mask is None else mask.astype(jnp.float32)
  count = jnp.sum(weights)
  loss = jnp.sum(nll * weights) / jnp.maximum(count, 1.0)
  return loss, count


@jax.custom_vjp
def _lse_and_label(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(logsumexp(logits), logits[label])`` over the last axis, in float32 (``[...]`` each).

  The backward is written out: ``d logits = softmax * d_lse + onehot(label) * d_label``, one
  elementwise expression in ``logits``' own dtype. Autodiff would scatter ``d_label`` into a zero
  float32 ``[..., V]`` array: the float32 gradient is then written out in full before anything
  else reads it, where this is one pass from the logits to their gradient
  (experiments/PERFORMANCE.md, "Cross-entropy gradient").
  """
  return _lse_and_label_fwd(logits, labels)[0]


def _lse_and_label_fwd(logits, labels):
  x = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(x, axis=-1)
  label = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
  return (lse, label), (logits, labels, lse)


def _lse_and_label_bwd(res, g):
  logits, labels, lse = res
  g_lse, g_label = g
  x = logits.astype(jnp.float32)
  onehot = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) == labels[..., None]
  d = jnp.exp(x - lse[..., None]) * g_lse[..., None] + jnp.where(onehot, g_label[..., None], 0.0)
  return d.astype(logits.dtype), None


_lse_and_label.defvjp(_lse_and_label_fwd, _lse_and_label_bwd)
