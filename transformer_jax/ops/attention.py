"""Scaled dot-product attention as a pure function.

Letter legend (as in ``jax.nn.dot_product_attention``), used for every shape suffix in this package:

  B batch, T query length, S key/value length, N query heads, K key/value heads,
  G = N // K query heads per key/value head, H head dim, D model width, F feed-forward width,
  V vocabulary, L layers.

Implementations (``implementation=``):

  ``"xla"``      dense ``[B, N, T, S]`` scores, weights and their gradients: O(T * S) memory; any
                 backend; the reference, and the only one with ``return_weights``. Its core is
                 heads-major, or the ``dense_core`` a backend gives (the CPU backend's row-major
                 core for bfloat16).
  ``"chunked"``  ``ops.chunked``: FlashAttention-2's blocks and online softmax in ``lax`` loops
                 with its own backward: O(T + S) memory (plus one block of scores); any backend;
                 masks and position biases by parts, causal / window blocks skipped.
  ``None``       ``"xla"`` while the float32 scores fit ``ops.dispatch.DENSE_MAX_BYTES``, else
                 ``"chunked"``.

The platforms' own kernels (cuDNN's fused attention, Pallas splash attention, ring attention over a
mesh) and the table that chooses among all of them for a platform are the backend's:
``transformer_jax.backends.current().attention(q, k, v, ...)`` chooses and calls
(``ops.choose_implementation`` holds the rules).

Masks are boolean with ``True`` meaning *attend*. Additive biases (ALiBi, T5 relative bias) go in
``bias``. Softmax runs in float32 whatever the input dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.ops import dispatch, precision, residuals
from transformer_jax.ops.chunked import chunked_attention, output_delta
from transformer_jax.ops.masks import MASK_VALUE, and_masks, segment_mask, sum_to


# A bias function: ``bias_fn(bias_params, q_pos_BT, k_pos_S) -> [B|1, N|1, T, S]`` float32 additive
# logits bias (``ops.AlibiBias``, ``ops.RelativeBias``). Kernels that work block by block call it on
# each block's positions, so a position bias never needs a dense ``[T, S]`` array.
BiasFn = Callable[[Any, jax.Array, jax.Array], jax.Array]

# A dense core: ``core(q [B, T, N, H], k [B, S, K, H], v, *, bias, mask, scale) -> [B, T, N, H]``,
# softmax attention on the whole score matrix with masked weights exactly 0 (a backend's form of
# the "xla" kernel's core, e.g. the CPU backend's row-major one for bfloat16).
DenseCore = Callable[..., jax.Array]


def check_qkv(q, k, v) -> None:
  """Raises ``ValueError`` naming the shapes unless q is ``[B, T, N, H]`` and k, v are one
  ``[B, S, K, H]`` shape with ``N % K == 0`` (every attention kernel's inputs)."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
      f"q, k and v must be 4-D [B, T|S, N|K, H]; got q.shape={q.shape}, k.shape={k.shape}, "
      f"v.shape={v.shape}"
    )
  if k.shape != v.shape:
    raise ValueError(f"k.shape={k.shape} and v.shape={v.shape} must be equal")
  (b, _, n, h), (bk, _, kh, hk) = q.shape, k.shape
  if b != bk or h != hk:
    raise ValueError(f"q.shape={q.shape} and k.shape={k.shape} must share batch B and head dim H")
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}")


def check_call(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  mask: jax.Array | None = None,
  window: int | None = None,
  kv_valid: jax.Array | None = None,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
) -> None:
  """Raises ``ValueError`` naming the problem unless the inputs of an attention call are
  consistent: q, k, v as ``check_qkv`` asks and floating-point, a boolean ``mask``, and the mask
  parts' shapes (``window >= 1``, ``kv_valid`` ``[B, S]``, segment ids ``[B, T]`` / ``[B, S]``)."""
  _check_inputs(q, k, v, mask)
  b, t, _, _ = q.shape
  _check_parts(
    b,
    t,
    k.shape[1],
    window=window,
    kv_valid=kv_valid,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
  )


def _check_inputs(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> None:
  check_qkv(q, k, v)
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise ValueError(f"{name} must be a floating-point array; got dtype {x.dtype}")
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(
      f"mask must be boolean (True = attend); got dtype {mask.dtype}. An additive float mask "
      "belongs in `bias`"
    )


def query_positions(q_positions: jax.Array | None, b: int, t: int, s: int) -> jax.Array:
  """``[B|1, T]`` int32 position of each query; by default aligned to the end of the keys."""
  if q_positions is None:
    return (jnp.arange(t, dtype=jnp.int32) + (s - t))[None]
  q_positions = jnp.asarray(q_positions)
  if q_positions.ndim == 1:
    q_positions = q_positions[None]
  if q_positions.ndim != 2 or q_positions.shape[1] != t or q_positions.shape[0] not in (1, b):
    raise ValueError(f"q_positions must be [B, T] or [T] with T={t}; got shape {q_positions.shape}")
  return q_positions.astype(jnp.int32)


def parts_mask(
  q_pos_BT: jax.Array,
  s: int,
  *,
  causal: bool,
  window: int | None,
  kv_valid: jax.Array | None,
  q_segment_ids: jax.Array | None,
  kv_segment_ids: jax.Array | None,
) -> jax.Array | None:
  """The dense ``[B|1, 1, T, S]`` mask of the parts (None when there are none)."""
  k_pos_S = jnp.arange(s, dtype=jnp.int32)
  masks = []
  if causal:
    masks.append((k_pos_S[None, None, :] <= q_pos_BT[:, :, None])[:, None])
  if window is not None:
    masks.append((jnp.abs(q_pos_BT[:, :, None] - k_pos_S[None, None, :]) < window)[:, None])
  if kv_valid is not None:
    masks.append(kv_valid.astype(bool)[:, None, None, :])
  if q_segment_ids is not None:
    masks.append(segment_mask(q_segment_ids, kv_segment_ids))
  return and_masks(*masks)


def _check_parts(b: int, t: int, s: int, *, window, kv_valid, q_segment_ids, kv_segment_ids):
  if window is not None and window < 1:
    raise ValueError(f"window={window} must be >= 1")
  if kv_valid is not None and kv_valid.shape != (b, s):
    raise ValueError(f"kv_valid must be [B, S] = {(b, s)}; got shape {kv_valid.shape}")
  if q_segment_ids is not None:
    if q_segment_ids.shape != (b, t):
      raise ValueError(f"q_segment_ids must be [B, T] = {(b, t)}; got shape {q_segment_ids.shape}")
    if kv_segment_ids is None and t != s:
      raise ValueError(f"kv_segment_ids [B, S] is needed when T={t} != S={s}")
    if kv_segment_ids is not None and kv_segment_ids.shape != (b, s):
      raise ValueError(
        f"kv_segment_ids must be [B, S] = {(b, s)}; got shape {kv_segment_ids.shape}"
      )
  elif kv_segment_ids is not None:
    raise ValueError("kv_segment_ids needs q_segment_ids")


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
  implementation: Literal["xla", "chunked"] | None = None,
  kv_valid: jax.Array | None = None,
  q_segment_ids: jax.Array | None = None,
  kv_segment_ids: jax.Array | None = None,
  window: int | None = None,
  q_positions: jax.Array | None = None,
  bias_fn: BiasFn | None = None,
  bias_params: Any = None,
  block_q: int | None = None,
  block_k: int | None = None,
  dense_core: DenseCore | None = None,
  softcap: float | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """softmax(cap(scale * q k^T) + bias, masked) v, with multi-, multi-query and grouped-query
  heads; ``cap`` is the identity, or with ``softcap`` c, ``c * tanh(x / c)`` (Gemma 2).

  The mask may be given densely (``mask``) and/or by its parts (``causal``, ``window``,
  ``kv_valid``, segment ids); the parts are ANDed. Key ``j`` sits at position ``j``; query ``i`` at
  ``q_positions[b, i]``, by default ``S - T + i`` (aligned to the end of the keys, which is what a
  key/value cache needs).

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]`` with ``N % K == 0`` (K == N: MHA, K == 1: MQA, else GQA).
    v: values ``[B, S, K, H]``.
    bias: additive logits bias broadcastable to ``[B, N, T, S]``.
    mask: boolean, broadcastable to ``[B, N, T, S]``; True = attend.
    causal: query at position ``p`` sees keys at positions ``<= p``.
    scale: logits scale; default ``1 / sqrt(H)``.
    dropout_rate: dropout on the attention weights (needs ``dropout_rng``).
    dropout_rng: PRNG key for attention dropout; ``None`` disables dropout.
    return_weights: also return the attention weights ``[B, N, T, S]`` (float32; "xla" only).
    implementation: ``"xla"`` (dense ``[B, N, T, S]`` scores), ``"chunked"`` (memory-efficient,
      key/value blocks with an online softmax), or ``None``: ``"xla"`` while the float32 scores
      fit ``ops.dispatch.DENSE_MAX_BYTES`` (or the weights are asked for), else ``"chunked"``.
      A platform's fused kernels ("cudnn", "splash") are its backend's
      (``transformer_jax.backends``).
    kv_valid: ``[B, S]`` bool, False for padding keys.
    q_segment_ids: ``[B, T]`` int; queries see only keys of the same segment (packed sequences).
    kv_segment_ids: ``[B, S]`` int (default ``q_segment_ids``, which needs ``T == S``).
    window: sliding window: only keys with ``|q_pos - k_pos| < window``.
    q_positions: ``[B, T]`` or ``[T]`` int positions of the queries.
    bias_fn: additive bias as a function of positions (``ops.AlibiBias``, ``ops.RelativeBias``):
      ``bias_fn(bias_params, q_pos_BT, k_pos_S) -> [B|1, N|1, T, S]``.
    bias_params: the (differentiable) parameters of ``bias_fn``.
    block_q: the most query rows per block of the "chunked" kernel (default
      ``ops.chunked.DEFAULT_BLOCK_Q``; a backend passes its own, 128 on CPU; the blocks are
      evened out: ``ceil(T / ceil(T / block_q))``).
    block_k: the most keys per block of the "chunked" kernel (default ``DEFAULT_BLOCK_K``).
    dense_core: the core of the "xla" kernel without dropout or weights (see ``DenseCore``;
      default the heads-major core). Unused with a ``softcap``: the heads-major core takes it.
    softcap: the attention logits' soft-cap c > 0 (Gemma 2's ``attn_logit_softcapping``): the
      scaled logits become ``c * tanh(logits / c)`` before the bias and the mask.

  Returns:
    ``[B, T, N, H]`` in q's dtype (and the weights if asked). A query row whose every key is
    masked yields zeros, not NaN.

  Raises:
    ValueError: on inconsistent shapes, a non-boolean mask, non-float q/k/v or an unknown
      implementation.
  """
  _check_inputs(q, k, v, mask)
  if softcap is not None and not softcap > 0:
    raise ValueError(f"softcap={softcap!r} must be a positive number (or None)")
  b, t, _, _ = q.shape
  s = k.shape[1]
  _check_parts(
    b,
    t,
    s,
    window=window,
    kv_valid=kv_valid,
    q_segment_ids=q_segment_ids,
    kv_segment_ids=kv_segment_ids,
  )
  if implementation is None:
    implementation = "xla" if return_weights else dispatch.dense_or_chunked(q, k)
  q_pos_BT = query_positions(q_positions, b, t, s)
  h = q.shape[-1]
  match implementation:
    case "xla":
      parts = parts_mask(
        q_pos_BT,
        s,
        causal=causal,
        window=window,
        kv_valid=kv_valid,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
      )
      mask = and_masks(mask, parts)
      if bias_fn is not None:
        block_bias = bias_fn(bias_params, q_pos_BT, jnp.arange(s, dtype=jnp.int32))
        bias = block_bias if bias is None else bias + block_bias
      return _xla_attention(
        q,
        k,
        v,
        bias=bias,
        mask=mask,
        scale=scale,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        return_weights=return_weights,
        dense_core=dense_core,
        softcap=softcap,
      )
    case "chunked":
      if return_weights:
        raise ValueError(
          "return_weights=True needs the dense weights: use implementation='xla' (the chunked "
          "kernel never forms them)"
        )
      return chunked_attention(
        q,
        k,
        v,
        q_pos=q_pos_BT,
        scale=h**-0.5 if scale is None else scale,
        causal=causal,
        window=window,
        bias=bias,
        mask=mask,
        bias_fn=bias_fn,
        bias_params=bias_params,
        kv_valid=kv_valid,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        block_q=block_q,
        block_k=block_k,
        softcap=softcap,
      )
    case "cudnn" | "splash":
      raise ValueError(
        f"implementation={implementation!r} is a platform's kernel: call it through its "
        "backend, transformer_jax.backends.current().attention(..., "
        f"implementation={implementation!r})"
      )
    case _:
      raise ValueError(f"implementation={implementation!r} must be None, 'xla' or 'chunked'")


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _dense_core(
  q_BKMH,
  k_BKSH,
  v_BKSH,
  bias,
  mask,
  scale: float,
  t: int,
  matmul_precision: str | None,
  softcap: float | None = None,
):
  """Softmax attention on heads-major operands: ``M = G * T`` query rows per key/value head.

  Every dot is a plain batched matrix product over ``(B, K)``, with no layout copies inside, and
  the backward is written out (FlashAttention's formulas on the dense weights, ``dS = P * (dP -
  rowsum(dO * O))``): it reads the saved weights once instead of replaying softmax's pieces
  (experiments/PERFORMANCE.md, "Dense attention core"). ``bias``/``mask`` broadcast to
  ``[B, N, T, S]``; masked weights are exactly 0 and a fully masked row gives zeros. A
  ``softcap`` c maps the scaled logits to ``c * tanh(logits / c)``; its backward recomputes the
  logits (one more product) rather than keep a second ``[B, N, T, S]`` array.
  """
  return _dense_core_fwd(q_BKMH, k_BKSH, v_BKSH, bias, mask, scale, t, matmul_precision, softcap)[0]


def _capped(logits, softcap):
  """``softcap * tanh(logits / softcap)`` (the identity for None), in the logits' dtype."""
  if softcap is None:
    return logits
  c = jnp.asarray(softcap, logits.dtype)
  return jnp.tanh(logits / c) * c


def _acc_dtype(x: jax.Array) -> jnp.dtype:
  """Accumulation and softmax dtype: float32, or float64 for float64 inputs."""
  return jnp.promote_types(x.dtype, jnp.float32)


def _bnts(x_BKMS: jax.Array, t: int) -> jax.Array:
  """``[B, K, G*T, S]`` viewed as ``[B, N, T, S]``: a free reshape, K and G being adjacent."""
  b, kh, m, s = x_BKMS.shape
  return x_BKMS.reshape(b, kh * (m // t), t, s)


def _masked_softmax(
  logits_BNTS: jax.Array, bias: jax.Array | None, mask: jax.Array | None
) -> jax.Array:
  """``softmax(logits + bias)`` over the keys, in the logits' dtype; masked weights are exactly 0,
  and so is a row whose every key is masked (softmax alone would make it uniform)."""
  if bias is not None:
    logits_BNTS = logits_BNTS + bias.astype(logits_BNTS.dtype)
  if mask is not None:
    logits_BNTS = jnp.where(mask, logits_BNTS, MASK_VALUE)
  weights_BNTS = jax.nn.softmax(logits_BNTS, axis=-1)
  return weights_BNTS if mask is None else jnp.where(mask, weights_BNTS, 0.0)


def _dense_core_fwd(q_BKMH, k_BKSH, v_BKSH, bias, mask, scale, t, matmul_precision, softcap):
  b, kh, m, _ = q_BKMH.shape
  s = k_BKSH.shape[2]
  acc = _acc_dtype(q_BKMH)
  logits_BKMS = jnp.einsum("BKMH,BKSH->BKMS", q_BKMH, k_BKSH, preferred_element_type=acc)
  logits_BNTS = _capped(_bnts(logits_BKMS, t) * jnp.asarray(scale, acc), softcap)
  weights_BNTS = _masked_softmax(logits_BNTS, bias, mask)
  p_BKMS = weights_BNTS.reshape(b, kh, m, s)
  out_BKMH = jnp.einsum(
    "BKMS,BKSH->BKMH", p_BKMS.astype(v_BKSH.dtype), v_BKSH, preferred_element_type=acc
  ).astype(q_BKMH.dtype)
  saved = tuple(residuals.packed(x) for x in (q_BKMH, k_BKSH, v_BKSH, p_BKMS, out_BKMH))
  return out_BKMH, (*saved, bias, mask)


def _dense_core_bwd(scale, t, matmul_precision, softcap, res, dout_BKMH):
  with jax.default_matmul_precision(matmul_precision):  # the forward's (ops/precision.py)
    return _dense_core_grads(scale, t, res, dout_BKMH, softcap)


def _dense_core_grads(scale, t, res, dout_BKMH, softcap=None):
  *saved, bias, mask = res
  q_BKMH, k_BKSH, v_BKSH, p_BKMS, out_BKMH = (residuals.unpacked(x) for x in saved)
  acc = _acc_dtype(q_BKMH)
  dv_BKSH = jnp.einsum(
    "BKMS,BKMH->BKSH", p_BKMS.astype(dout_BKMH.dtype), dout_BKMH, preferred_element_type=acc
  )
  dp_BKMS = jnp.einsum("BKMH,BKSH->BKMS", dout_BKMH, v_BKSH, preferred_element_type=acc)
  delta_BKM1 = output_delta(dout_BKMH, out_BKMH, acc, keepdims=True)
  ds_BKMS = p_BKMS * (dp_BKMS - delta_BKM1)  # d(logits); masked entries have p = 0
  dbias = None if bias is None else sum_to(_bnts(ds_BKMS, t), bias.shape).astype(bias.dtype)
  if softcap is not None:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
    raw_BKMS = jnp.einsum("BKMH,BKSH->BKMS", q_BKMH, k_BKSH, preferred_element_type=acc)
    ds_BKMS = ds_BKMS * (1.0 - jnp.square(jnp.tanh(raw_BKMS * jnp.asarray(scale / softcap, acc))))
  ds_BKMS = (ds_BKMS * jnp.asarray(scale, acc)).astype(q_BKMH.dtype)
  dq_BKMH = jnp.einsum("BKMS,BKSH->BKMH", ds_BKMS, k_BKSH, preferred_element_type=acc)
  dk_BKSH = jnp.einsum("BKMS,BKMH->BKSH", ds_BKMS, q_BKMH, preferred_element_type=acc)
  dmask = None if mask is None else np.zeros(mask.shape, jax.dtypes.float0)
  return (
    dq_BKMH.astype(q_BKMH.dtype),
    dk_BKSH.astype(k_BKSH.dtype),
    dv_BKSH.astype(v_BKSH.dtype),
    dbias,
    dmask,
  )


_dense_core.defvjp(_dense_core_fwd, _dense_core_bwd)


def dense_attention(q, k, v, *, bias, mask, scale, softcap=None):
  """The heads-major dense core on ``[B, T, N, H]`` inputs (a ``DenseCore``; it alone takes a
  ``softcap``)."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  q_BKMH = q.reshape(b, t, kh, n // kh, h).transpose(0, 2, 3, 1, 4).reshape(b, kh, -1, h)
  k_BKSH, v_BKSH = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
  cap = None if softcap is None else float(softcap)
  out_BKMH = _dense_core(
    q_BKMH, k_BKSH, v_BKSH, bias, mask, float(scale), t, precision.current(), cap
  )
  return out_BKMH.reshape(b, kh, n // kh, t, h).transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


def _xla_attention(
  q, k, v, *, bias, mask, scale, dropout_rate, dropout_rng, return_weights, dense_core, softcap
):
  """The dense kernel: the whole ``[B, N, T, S]`` score matrix at once."""
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  scale = h**-0.5 if scale is None else scale
  if not return_weights and not (dropout_rate > 0.0 and dropout_rng is not None):
    if softcap is not None:
      return dense_attention(q, k, v, bias=bias, mask=mask, scale=scale, softcap=softcap)
    core = dense_attention if dense_core is None else dense_core
    return core(q, k, v, bias=bias, mask=mask, scale=scale)

  q_BTKGH = q.reshape(b, t, kh, g, h)
  logits_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k, preferred_element_type=jnp.float32)
  logits_BNTS = _capped(logits_BKGTS.reshape(b, n, t, s) * jnp.float32(scale), softcap)
  weights_BNTS = _masked_softmax(logits_BNTS, bias, mask)

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
