"""A language model's output projection and cross-entropy fused, chunk by chunk of tokens.

``linear_cross_entropy`` takes the hidden states ``x [N, D]`` and the output weight, and returns the
summed loss without ever holding the float32 ``[N, V]`` logits of the whole batch: a ``lax.scan``
over chunks of ``C`` rows projects one chunk to the vocabulary at a time (``[C, V]`` float32
logits), reduces it to its loss, and, when differentiated, turns it straight into that chunk's
gradients. The ``jax.custom_vjp``'s forward computes the gradients along with the loss, since the
loss is a scalar: the backward only scales them by the loss's cotangent, so nothing is recomputed
and nothing of size ``N x V`` is saved (only ``dx [N, D]`` and the float32 ``dW``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


# Default chunk: rows whose float32 logits take about this many bytes.
DEFAULT_CHUNK_BYTES = 256 << 20

W_LAYOUTS = ("VD", "DV")


class _Config(NamedTuple):
  """The static (non-differentiated, hashable) arguments of the custom VJP."""

  w_layout: str
  label_smoothing: float
  z_loss: float
  dtype: Any  # compute dtype of the products
  w_dtype: Any  # dtype of w's gradient
  # Forms a chunk's x^T [D, C] for the weight gradient's product, or None: the product contracts
  # x's rows itself (a backend's layout, e.g. the CPU backend's row-major copy).
  x_transposed: Any = None


def default_chunk_size(n: int, v: int) -> int:
  """Rows per chunk such that one chunk's float32 ``[C, V]`` logits are about 256 MiB, at most
  ``n`` (and at least 1)."""
  return max(1, min(n, DEFAULT_CHUNK_BYTES // (4 * v)))


def _logits(x_CD: jax.Array, w_lo: jax.Array, w_layout: str) -> jax.Array:
  """A chunk's ``[C, V]`` float32 logits: ``x @ W^T`` (W ``[V, D]``) or ``x @ W`` (``[D, V]``)."""
  contract = 1 if w_layout == "VD" else 0
  return jax.lax.dot_general(
    x_CD, w_lo, (((1,), (contract,)), ((), ())), preferred_element_type=jnp.float32
  )


def _chunk(cfg: _Config, x_CD, w_lo, labels_C, weights_C, *, grads: bool):
  """One chunk's ``(loss_sum, correct_sum)``, plus with ``grads`` its ``dx [C, D]`` (float32) and
  its weight gradient in ``[D, V]`` layout (float32), for an output cotangent of 1."""
  w_layout, eps, z, dtype = cfg.w_layout, cfg.label_smoothing, cfg.z_loss, cfg.dtype
  logits_CV = _logits(x_CD, w_lo, w_layout)
  v = logits_CV.shape[-1]
  max_C = jnp.max(logits_CV, axis=-1)
  exp_CV = jnp.exp(logits_CV - max_C[:, None])
  sum_C = jnp.sum(exp_CV, axis=-1)
  lse_C = max_C + jnp.log(sum_C)
  # A comparison with the vocabulary ids rather than a gather: a label outside [0, V) selects
  # nothing (its row's label logit is 0, finite), where an out-of-range gather would give NaN.
  onehot_CV = labels_C[:, None] == jax.lax.broadcasted_iota(labels_C.dtype, (1, v), 1)
  label_C = jnp.sum(jnp.where(onehot_CV, logits_CV, 0.0), axis=-1)
  nll_C = lse_C - label_C
  if eps:
    nll_C = (1.0 - eps) * nll_C + eps * (lse_C - jnp.mean(logits_CV, axis=-1))
  if z:
    nll_C = nll_C + z * jnp.square(lse_C)
  loss = jnp.sum(weights_C * nll_C)
  correct = jnp.sum(jnp.where(label_C >= max_C, weights_C, 0.0))
  if not grads:
    return loss, correct
  # d loss / d logits = w_n * ((1 - eps) (p - onehot) + eps (p - 1/V) + 2 z lse p).
  probs_CV = exp_CV * (1.0 / sum_C)[:, None]
  dlogits_CV = weights_C[:, None] * (
    (1.0 + 2.0 * z * lse_C)[:, None] * probs_CV - jnp.where(onehot_CV, 1.0 - eps, 0.0) - eps / v
  )
  dlogits_CV = dlogits_CV.astype(dtype)  # as autodiff of (x @ W^T).astype(float32) would
  if w_layout == "VD":  # [C, V] @ [V, D]
    dx_CD = jax.lax.dot_general(
      dlogits_CV, w_lo, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
  else:  # [C, V] @ [D, V]^T
    dx_CD = jax.lax.dot_general(
      dlogits_CV, w_lo, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
  # x^T @ dlogits, [D, C] @ [C, V], for either layout; the "VD" layout's transpose of the sum is
  # done once, in the backward.
  if cfg.x_transposed is not None:
    dw_DV = jax.lax.dot_general(
      cfg.x_transposed(x_CD),
      dlogits_CV,
      (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32,
    )
  else:
    dw_DV = jax.lax.dot_general(
      x_CD, dlogits_CV, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
  return loss, correct, dx_CD, dw_DV


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg, x_KCD, w, labels_KC, weights_KC):
  # The primal alone (a call that is not differentiated): losses only, no gradients.
  w_lo = w.astype(cfg.dtype)

  def step(carry, xs):
    loss, correct = _chunk(cfg, xs[0], w_lo, xs[1], xs[2], grads=False)
    return (carry[0] + loss, carry[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  (loss, correct), _ = jax.lax.scan(step, (zero, zero), (x_KCD, labels_KC, weights_KC))
  return loss, correct


def _fused_fwd(cfg, x_KCD, w, labels_KC, weights_KC):
  w_lo = w.astype(cfg.dtype)
  d, v = x_KCD.shape[-1], w.shape[0 if cfg.w_layout == "VD" else 1]

  def step(carry, xs):
    loss_acc, correct_acc, dw_acc = carry
    loss, correct, dx_CD, dw_DV = _chunk(cfg, xs[0], w_lo, xs[1], xs[2], grads=True)
    return (loss_acc + loss, correct_acc + correct, dw_acc + dw_DV), dx_CD.astype(x_KCD.dtype)

  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros((d, v), jnp.float32))
  (loss, correct, dw_DV), dx_KCD = jax.lax.scan(step, init, (x_KCD, labels_KC, weights_KC))
  return (loss, correct), (dx_KCD, dw_DV)


def _fused_bwd(cfg, res, cotangents):
  dx_KCD, dw_DV = res
  # No products here, so the forward's matmul precision (ops/precision.py) needs no carrying over.
  g = cotangents[0]  # correct_sum is not differentiated
  dw = dw_DV.T if cfg.w_layout == "VD" else dw_DV
  dx = (dx_KCD.astype(jnp.float32) * g).astype(dx_KCD.dtype)
  return dx, (dw * g).astype(cfg.w_dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def linear_cross_entropy(
  x_ND: jax.Array,
  w: jax.Array,
  labels_N: jax.Array,
  weights_N: jax.Array | None = None,
  *,
  w_layout: str = "VD",
  label_smoothing: float = 0.0,
  z_loss: float = 0.0,
  chunk_size: int | None = None,
  dtype=None,
  x_transposed: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Summed token cross-entropy of ``x`` projected to the vocabulary, chunk by chunk of rows.

  Equals ``ops.cross_entropy(logits, labels, mask=weights, ...)`` (its mean times its count) on
  the explicit ``logits = x @ W^T`` (or ``x @ W``), but never materialises the float32 ``[N, V]``
  logits: rows are projected ``chunk_size`` at a time in a ``lax.scan``. A custom VJP computes the
  gradients in the same pass as the loss (the output is a scalar), so the backward recomputes
  nothing and no ``[N, V]`` array is saved; a plain, non-differentiated call computes no gradients.

  Args:
    x_ND: ``[N, D]`` hidden states (flatten batch and time first).
    w: the output weight: ``[V, D]`` with ``w_layout="VD"`` (a tied embedding table), ``[D, V]``
      with ``"DV"`` (an untied head). Its gradient is accumulated in float32 across chunks and
      returned in ``w.dtype``.
    labels_N: integer ``[N]`` targets in ``[0, V)``. A row whose label is outside that range must
      have weight 0 (its loss is undefined, but finite).
    weights_N: optional ``[N]`` per-token weights (e.g. a 0/1 mask); default all ones. Treated as
      constants: their gradient is zero, as is that of ``labels_N``.
    w_layout: ``"VD"`` or ``"DV"``, as above.
    label_smoothing: ``eps`` in ``[0, 1)``: the per-token loss is
      ``(1 - eps) * nll + eps * (lse - mean(logits))``.
    z_loss: coefficient of the auxiliary ``lse^2`` term added to each token's loss.
    chunk_size: rows per chunk; default ``default_chunk_size(N, V)`` (float32 logits of about
      256 MiB per chunk). ``N`` need not be a multiple: the rows are padded with weight-0 rows,
      which change neither the sums nor the gradients.
    dtype: compute dtype of the products (default ``x_ND.dtype``): ``x`` and ``W`` are cast to it
      and multiplied with float32 accumulation; the softmax math is float32, and the backward's
      products take the logits' gradient cast to ``dtype``, as autodiff of
      ``(x @ W^T).astype(float32)`` would.
    x_transposed: how a chunk's ``x^T`` ``[D, C]`` is formed for the weight gradient's product
      (a hashable function, e.g. the CPU backend's row-major copy, which keeps a bfloat16 product
      on XLA:CPU's bf16 kernel); None: the product contracts ``x``'s rows itself.

  Returns:
    ``(loss_sum, correct_sum)``, float32 scalars: ``sum_n weights[n] * loss[n]``, with
    ``loss[n] = logsumexp(logits[n]) - logits[n, label[n]]`` (plus smoothing and z-loss), and
    ``sum_n weights[n] * (logits[n, label[n]] >= max(logits[n]))`` (not differentiated).
  """
  if x_ND.ndim != 2:
    raise ValueError(f"x_ND must be 2-D [N, D]; got x_ND.shape={x_ND.shape}")
  if w_layout not in W_LAYOUTS:
    raise ValueError(f"w_layout={w_layout!r} must be one of {', '.join(map(repr, W_LAYOUTS))}")
  n, d = x_ND.shape
  if w.ndim != 2 or w.shape[1 if w_layout == "VD" else 0] != d:
    raise ValueError(
      f"w.shape={w.shape} must be [{'V, D' if w_layout == 'VD' else 'D, V'}] with "
      f"D={d} of x_ND.shape={x_ND.shape} (w_layout={w_layout!r})"
    )
  if labels_N.shape != (n,):
    raise ValueError(
      f"labels_N.shape={labels_N.shape} must be [N]=({n},) of x_ND.shape={x_ND.shape}"
    )
  if not jnp.issubdtype(labels_N.dtype, jnp.integer):
    raise ValueError(f"labels_N must be integers; got dtype {labels_N.dtype}")
  if weights_N is not None and weights_N.shape != (n,):
    raise ValueError(
      f"weights_N.shape={weights_N.shape} must be [N]=({n},) of x_ND.shape={x_ND.shape}"
    )
  if not 0.0 <= label_smoothing < 1.0:
    raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1)")
  if chunk_size is not None and (int(chunk_size) != chunk_size or chunk_size < 1):
    raise ValueError(f"chunk_size={chunk_size} must be a positive integer")
  v = w.shape[0 if w_layout == "VD" else 1]
  dtype = x_ND.dtype if dtype is None else jnp.dtype(dtype)
  c = default_chunk_size(n, v) if chunk_size is None else max(1, min(int(chunk_size), n))
  k = -(-n // c)
  pad = k * c - n
  weights_N = jnp.ones((n,), jnp.float32) if weights_N is None else weights_N.astype(jnp.float32)
  # x is cast here, outside the custom VJP: the cast's own transpose returns dx in x's dtype.
  x_ND = x_ND.astype(dtype)
  labels_N = labels_N.astype(jnp.int32)
  if pad:  # padding rows: x = 0, label 0, weight 0
    x_ND = jnp.pad(x_ND, ((0, pad), (0, 0)))
    labels_N = jnp.pad(labels_N, (0, pad))
    weights_N = jnp.pad(weights_N, (0, pad))
  cfg = _Config(w_layout, float(label_smoothing), float(z_loss), dtype, w.dtype, x_transposed)
  return _fused(cfg, x_ND.reshape(k, c, d), w, labels_N.reshape(k, c), weights_N.reshape(k, c))
