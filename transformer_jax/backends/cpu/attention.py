"""The dense attention core for bfloat16 on a CPU with bf16 units: every product on XLA:CPU's
bfloat16 kernel.

The math is ``ops.attention``'s heads-major core (the same forward, and its backward written out
with FlashAttention's formulas on the dense weights); only the layouts differ. XLA:CPU's bfloat16
kernel takes a batched product only with a row-major left operand contracted along its last dim
and a float32 result (``matmul``). The heads-major operands are transposes of ``[B, T, N, H]``
that XLA makes free with a permuted layout, and two of the six products (``p^T dO``, ``dS^T q``)
contract their left operand's rows: XLA upcasts those to float32. Here ``R = B * K`` is merged
into one batch dim, every operand is a row-major copy (``matmul.transposed``, and the reshapes
that merge ``B`` and ``K``), and the four products with a head-dim side (``p v``, ``dv``, ``dq``,
``dk``) are computed transposed (``v^T p^T`` and so on), the faster form of the kernel. The
weights are kept in bfloat16, the dtype the products take.

The CPU backend (``CpuBackend.dense_core``) gives this core to the dense kernel where
``rowmajor_core_takes`` the inputs. Letters as in ``ops/attention.py``; ``R = B * K`` and
``M = G * T`` query rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.backends.cpu import matmul
from transformer_jax.ops import residuals
from transformer_jax.ops.chunked import output_delta
from transformer_jax.ops.masks import MASK_VALUE, sum_to


def rowmajor_core_takes(q, k, v, *, bf16_units: bool) -> bool:
  """Whether the row-major core takes these inputs: ``q``, ``k`` and ``v`` are bfloat16, the CPU
  has bfloat16 units (``bf16_units``: its products run natively), and the query rows
  ``M = G * T`` and the key length ``S`` each have a ``matmul.small_factor`` (which the row-major
  copies split by). Reads shapes and dtypes only."""
  t, s = q.shape[1], k.shape[1]
  m = t * (q.shape[2] // k.shape[2])
  return (
    q.dtype == k.dtype == v.dtype == jnp.bfloat16
    and bf16_units
    and all(matmul.small_factor(d) is not None for d in (m, s))
  )


def rowmajor_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  bias: jax.Array | None,
  mask: jax.Array | None,
  scale: float,
) -> jax.Array:
  """``softmax(scale * q k^T + bias, masked) v`` through the row-major core.

  Args:
    q: ``[B, T, N, H]`` bfloat16 queries.
    k: ``[B, S, K, H]`` bfloat16 keys.
    v: ``[B, S, K, H]`` bfloat16 values.
    bias: float32, broadcastable to ``[B, N, T, S]``, or None.
    mask: boolean (True = attend), broadcastable to ``[B, N, T, S]``, or None.
    scale: the logits' scale.

  Returns:
    ``[B, T, N, H]`` bfloat16; a query row whose every key is masked gives zeros.
  """
  b, t, n, h = q.shape
  kh = k.shape[2]
  # Merging B and K in the reshape makes each operand a row-major copy.
  q_RMH = q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4).reshape(b * kh, -1, h)
  k_RSH, v_RSH = (x.transpose(0, 2, 1, 3).reshape(b * kh, -1, h) for x in (k, v))
  out_RMH = _rowmajor_core(q_RMH, k_RSH, v_RSH, bias, mask, float(scale), b, t)
  return out_RMH.reshape(b, kh, n // kh, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _products(eq: str, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.einsum(eq, x, y, preferred_element_type=jnp.float32)


def _softmax(logits_BNTS: jax.Array, bias: jax.Array | None, mask: jax.Array | None) -> jax.Array:
  """``softmax(logits + bias)`` over the keys with masked weights exactly 0 (and a row with no key
  all 0). The mask is added as a bias of 0 or ``MASK_VALUE`` rather than selected: the same
  weights, and XLA:CPU fuses the add into YNNPACK's softmax."""
  if bias is not None:
    logits_BNTS = logits_BNTS + bias.astype(logits_BNTS.dtype)
  if mask is not None:
    logits_BNTS = logits_BNTS + jnp.where(mask, 0.0, MASK_VALUE).astype(logits_BNTS.dtype)
  weights_BNTS = jax.nn.softmax(logits_BNTS, axis=-1)
  return weights_BNTS if mask is None else jnp.where(mask, weights_BNTS, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _rowmajor_core(q_RMH, k_RSH, v_RSH, bias, mask, scale: float, b: int, t: int):
  """Softmax attention on ``[R, M, H]`` queries and ``[R, S, H]`` keys/values (``R = B * K``);
  ``bias``/``mask`` broadcast to ``[B, N, T, S]``."""
  return _rowmajor_core_fwd(q_RMH, k_RSH, v_RSH, bias, mask, scale, b, t)[0]


def _rowmajor_core_fwd(q_RMH, k_RSH, v_RSH, bias, mask, scale, b, t):
  r, m, _ = q_RMH.shape
  s = k_RSH.shape[1]
  if math.frexp(scale)[0] == 0.5:  # a power of two (1 / sqrt(64)): exact on q, no pass of its own
    logits_RMS = _products("RMH,RSH->RMS", q_RMH * jnp.asarray(scale, q_RMH.dtype), k_RSH)
  else:
    logits_RMS = _products("RMH,RSH->RMS", q_RMH, k_RSH) * jnp.float32(scale)
  p_RMS = _softmax(logits_RMS.reshape(b, -1, t, s), bias, mask)
  p_RMS = p_RMS.reshape(r, m, s).astype(q_RMH.dtype)
  out_RHM = _products("RHS,RMS->RHM", matmul.transposed(v_RSH), p_RMS)
  out_RMH = matmul.transposed(out_RHM.astype(q_RMH.dtype))
  saved = tuple(residuals.packed(x) for x in (q_RMH, k_RSH, v_RSH, p_RMS, out_RMH))
  return out_RMH, (*saved, bias, mask)


def _rowmajor_core_bwd(scale, b, t, res, dout_RMH):
  *saved, bias, mask = res
  q_RMH, k_RSH, v_RSH, p_RMS, out_RMH = (residuals.unpacked(x) for x in saved)
  s = k_RSH.shape[1]
  dv_RHS = _products("RHM,RMS->RHS", matmul.transposed(dout_RMH), p_RMS)
  dp_RMS = _products("RMH,RSH->RMS", dout_RMH, v_RSH)
  delta_RM1 = output_delta(dout_RMH, out_RMH, keepdims=True)
  ds_RMS = p_RMS.astype(jnp.float32) * (dp_RMS - delta_RM1)  # masked entries have p = 0
  dbias = (
    None if bias is None else sum_to(ds_RMS.reshape(b, -1, t, s), bias.shape).astype(bias.dtype)
  )
  # The scale goes on the two small products' results: on dS, XLA:CPU would materialize a
  # [R, M, S] array of it for YNNPACK's fusion.
  ds_RMS = ds_RMS.astype(q_RMH.dtype)
  dq_RHM = _products("RHS,RMS->RHM", matmul.transposed(k_RSH), ds_RMS) * jnp.float32(scale)
  dk_RHS = _products("RHM,RMS->RHS", matmul.transposed(q_RMH), ds_RMS) * jnp.float32(scale)
  dmask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)

  def back(x_RAB, like):
    return matmul.transposed(x_RAB.astype(like.dtype))

  return back(dq_RHM, q_RMH), back(dk_RHS, k_RSH), back(dv_RHS, v_RSH), dbias, dmask


_rowmajor_core.defvjp(_rowmajor_core_fwd, _rowmajor_core_bwd)
