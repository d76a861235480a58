"""Memory-efficient attention: FlashAttention-2's algorithm in ``lax`` loops, with its own backward.

The queries are cut into blocks of ``block_q`` rows and the keys/values into blocks of ``block_k``.
For each query block a loop runs over the key/value blocks it can see, computing one block of
scores at a time and folding it into an online float32 softmax (running max, denominator and
numerator). Only ``[B, N, block_q, block_k]`` scores exist at any moment, so memory is linear in
the length. The ``jax.custom_vjp`` saves ``q, k, v``, the output and the per-row log-sum-exp;
the backward recomputes each block's scores from them, so no ``[T, S]`` array is ever stored.

The mask is never materialised either: causal, sliding window, key padding and segment ids are
evaluated per block from positions and ids, and a position bias (``bias_fn``) is evaluated per
block from positions. Under ``causal`` (and ``window``) the loop over key blocks runs only over
the blocks a query block can see, so causal attention does about half the work. A dense ``mask``
or ``bias``, if given, is sliced per block (and the bias's gradient accumulated per block).

``block_scores``, ``online_update`` and ``block_grads`` are the per-block steps; ring attention
(``parallel/ring.py``) runs the same steps over the blocks that travel around its ring.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.ops import precision
from transformer_jax.ops.masks import MASK_VALUE, sum_to

# Default block sizes: each block's matmuls big enough to fill a GPU or TPU. A backend passes its
# own (the CPU backend's are smaller: ``backends.cpu.backend.CPU_BLOCK``).
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


def default_block_sizes() -> tuple[int, int]:
  """``(block_q, block_k)`` where the caller gives none: ``DEFAULT_BLOCK_Q`` and
  ``DEFAULT_BLOCK_K``."""
  return DEFAULT_BLOCK_Q, DEFAULT_BLOCK_K


@dataclasses.dataclass(frozen=True)
class Static:
  """The parts of the attention that are Python values: hashable, the non-differentiated
  arguments of the kernel's ``custom_vjp`` (and of ring attention's)."""

  scale: float
  causal: bool = False
  window: int | None = None
  s_len: int | None = None  # keys at positions >= s_len are padding added by the kernel
  bias_fn: Any = None
  dropout_rate: float = 0.0
  softcap: float | None = None  # logits -> softcap * tanh(logits / softcap), before bias and mask


@dataclasses.dataclass(frozen=True)
class Tiling:
  """The "chunked" kernel's block sizes: ``bq`` query rows and ``bk`` keys per block (the padded
  lengths are whole numbers of blocks)."""

  bq: int
  bk: int


class Block(NamedTuple):
  """What one (query block, key block) pair needs besides q, k and v; None = absent part.

  ``q_pos`` ``[B|1, t]`` and ``k_pos`` ``[s]`` int32 positions; ``kv_valid`` ``[B, s]`` bool;
  ``q_seg`` ``[B, t]`` / ``kv_seg`` ``[B, s]`` int segment ids; ``mask`` / ``bias`` dense slices
  ``[B|1, N|1, t|1, s|1]``; ``bias_params`` the parameters of ``Static.bias_fn``; ``keep``
  ``[B, N, t, s]`` bool dropout mask.
  """

  q_pos: jax.Array
  k_pos: jax.Array
  kv_valid: jax.Array | None = None
  q_seg: jax.Array | None = None
  kv_seg: jax.Array | None = None
  mask: jax.Array | None = None
  bias: jax.Array | None = None
  bias_params: Any = None
  keep: jax.Array | None = None


def _kg(x: jax.Array, kh: int) -> jax.Array:
  """``[B|1, N|1, t, s]`` -> ``[B|1, K|1, G|1, t, s]`` to meet scores laid out ``BKGts``."""
  if x.shape[1] == 1:
    return x[:, :, None]
  return x.reshape(x.shape[0], kh, x.shape[1] // kh, *x.shape[2:])


def block_valid(blk: Block, st: Static, kh: int) -> jax.Array | None:
  """Boolean ``[B|1, K|1, G|1, t, s]`` of the entries to attend to (None: all of them)."""
  q_pos, k_pos = blk.q_pos[:, :, None], blk.k_pos[None, None, :]
  valid_BTS = None

  def conj(a, b):
    return b if a is None else a & b

  if st.causal:
    valid_BTS = conj(valid_BTS, k_pos <= q_pos)
  if st.window is not None:
    valid_BTS = conj(valid_BTS, jnp.abs(q_pos - k_pos) < st.window)
  if st.s_len is not None:
    valid_BTS = conj(valid_BTS, k_pos < st.s_len)
  if blk.kv_valid is not None:
    valid_BTS = conj(valid_BTS, blk.kv_valid[:, None, :])
  if blk.q_seg is not None:
    valid_BTS = conj(valid_BTS, blk.q_seg[:, :, None] == blk.kv_seg[:, None, :])
  valid = None if valid_BTS is None else valid_BTS[:, None, None]
  if blk.mask is not None:
    valid = conj(valid, _kg(blk.mask, kh))
  return valid


def block_bias(blk: Block, st: Static, kh: int, bias_params: Any = None) -> jax.Array | None:
  """Float32 ``[B|1, K|1, G|1, t, s]`` additive bias of the block (None: no bias)."""
  bias = None
  if blk.bias is not None:
    bias = _kg(blk.bias.astype(jnp.float32), kh)
  if st.bias_fn is not None:
    params = blk.bias_params if bias_params is None else bias_params
    fn_bias = _kg(st.bias_fn(params, blk.q_pos, blk.k_pos).astype(jnp.float32), kh)
    bias = fn_bias if bias is None else bias + fn_bias
  return bias


def block_scores(
  q_BtKGH: jax.Array, k_BsKH: jax.Array, blk: Block, st: Static
) -> tuple[jax.Array, jax.Array | None]:
  """Masked float32 logits ``[B, K, G, t, s]`` of one block, and its validity (or None)."""
  return _scores(q_BtKGH, k_BsKH, blk, st)[:2]


def _scores(q_BtKGH, k_BsKH, blk: Block, st: Static):
  """``block_scores`` and the soft-cap's derivative ``1 - tanh^2`` (None without a soft-cap)."""
  kh = k_BsKH.shape[2]
  logits = jnp.einsum("BTKGH,BSKH->BKGTS", q_BtKGH, k_BsKH, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(st.scale)
  dcap = None
  if st.softcap is not None:
    capped = jnp.tanh(logits / jnp.float32(st.softcap))
    logits, dcap = capped * jnp.float32(st.softcap), 1.0 - jnp.square(capped)
  bias = block_bias(blk, st, kh)
  if bias is not None:
    logits = logits + bias
  valid = block_valid(blk, st, kh)
  if valid is not None:
    logits = jnp.where(valid, logits, MASK_VALUE)
  return logits, valid, dcap


def _probs(logits, valid, shift):
  """``exp(logits - shift)`` with masked entries exactly 0."""
  p = jnp.exp(logits - shift[..., None])
  return p if valid is None else jnp.where(valid, p, 0.0)


def _dropped(p_BKGts, keep_BNts, rate):
  if keep_BNts is None:
    return p_BKGts
  return jnp.where(_kg(keep_BNts, p_BKGts.shape[1]), p_BKGts / (1.0 - rate), 0.0)


class SoftmaxState(NamedTuple):
  """Online-softmax statistics of a query block: max and denominator ``[B, K, G, t]`` and the
  numerator ``[B, K, G, t, H]``, float32."""

  max: jax.Array
  denom: jax.Array
  numer: jax.Array


def initial_state(b: int, kh: int, g: int, t: int, h: int) -> SoftmaxState:
  return SoftmaxState(
    jnp.full((b, kh, g, t), MASK_VALUE, jnp.float32),
    jnp.zeros((b, kh, g, t), jnp.float32),
    jnp.zeros((b, kh, g, t, h), jnp.float32),
  )


def online_update(
  state: SoftmaxState,
  q_BtKGH: jax.Array,
  k_BsKH: jax.Array,
  v_BsKH: jax.Array,
  blk: Block,
  st: Static,
) -> SoftmaxState:
  """Folds one key/value block into a query block's online softmax (the forward block step)."""
  logits, valid = block_scores(q_BtKGH, k_BsKH, blk, st)
  new_max = jnp.maximum(state.max, jnp.max(logits, axis=-1))
  corr = jnp.exp(state.max - new_max)
  p = _probs(logits, valid, new_max)
  denom = state.denom * corr + jnp.sum(p, axis=-1)
  p = _dropped(p, blk.keep, st.dropout_rate)
  pv = jnp.einsum(
    "BKGTS,BSKH->BKGTH", p.astype(v_BsKH.dtype), v_BsKH, preferred_element_type=jnp.float32
  )
  return SoftmaxState(new_max, denom, state.numer * corr[..., None] + pv)


def finish(state: SoftmaxState) -> tuple[jax.Array, jax.Array]:
  """Output ``[B, K, G, t, H]`` float32 and log-sum-exp ``[B, K, G, t]`` of a finished query block.

  A row with no valid key has a zero denominator: it gives zeros, and a log-sum-exp of 0 (any
  finite value does: every entry of the row is masked, so the backward never uses it)."""
  empty = state.denom == 0.0
  out = state.numer / jnp.where(empty, 1.0, state.denom)[..., None]
  lse = jnp.where(empty, 0.0, state.max + jnp.log(jnp.where(empty, 1.0, state.denom)))
  return out, lse


def output_delta(
  do: jax.Array, out: jax.Array, dtype=jnp.float32, keepdims: bool = False
) -> jax.Array:
  """``delta_i = sum_h dO_ih O_ih`` (``= sum_j P_ij dP_ij``) in ``dtype``: the row term of the
  softmax's backward, over the last (head) dim of the output ``out`` and its cotangent ``do``."""
  return jnp.sum(do.astype(dtype) * out.astype(dtype), axis=-1, keepdims=keepdims)


def block_grads(q_BtKGH, k_BsKH, v_BsKH, do_BtKGH, lse_BKGt, delta_BKGt, blk: Block, st: Static):
  """Gradients of one block (the backward block step), recomputing its scores from the lse.

  Returns ``(dq [B,t,K,G,H], dk [B,s,K,H], dv [B,s,K,H], ds [B,K,G,t,s])`` float32, where ``ds``
  is the gradient of the (scaled, soft-capped, biased) logits: the gradient of an additive bias."""
  logits, valid, dcap = _scores(q_BtKGH, k_BsKH, blk, st)
  p = _probs(logits, valid, lse_BKGt)
  pd = _dropped(p, blk.keep, st.dropout_rate)
  dt = jnp.float32
  dv = jnp.einsum("BKGTS,BTKGH->BSKH", pd, do_BtKGH.astype(dt))
  dp = jnp.einsum("BTKGH,BSKH->BKGTS", do_BtKGH.astype(dt), v_BsKH.astype(dt))
  dp = _dropped(dp, blk.keep, st.dropout_rate)
  ds = p * (dp - delta_BKGt[..., None])
  ds_raw = ds if dcap is None else ds * dcap  # through the soft-cap to the scaled products
  dq = jnp.einsum("BKGTS,BSKH->BTKGH", ds_raw, k_BsKH.astype(dt)) * st.scale
  dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds_raw, q_BtKGH.astype(dt)) * st.scale
  return dq, dk, dv, ds


def bias_params_grad(blk: Block, st: Static, ds_BKGts: jax.Array) -> Any:
  """Gradient wrt ``bias_params`` of the block's ``bias_fn`` bias, given its cotangent."""

  def fn(params):
    return st.bias_fn(params, blk.q_pos, blk.k_pos).astype(jnp.float32)

  bias, vjp = jax.vjp(fn, blk.bias_params)
  b, kh, g, t, s = ds_BKGts.shape
  return vjp(sum_to(ds_BKGts.reshape(b, kh * g, t, s), bias.shape))[0]


def _pad_axis(x, axis, size, value=0, edge=False):
  if x is None or size == x.shape[axis] or x.shape[axis] == 1 and not edge:
    return x  # absent, already whole blocks, or broadcast along this axis
  extra = size - x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  if edge:
    return jnp.pad(x, widths, mode="edge")
  return jnp.pad(x, widths, constant_values=value)


def _dense_4d(x, name, b, n, t, s):
  """A dense mask or bias as ``[B|1, N|1, T|1, S|1]``."""
  if x is None:
    return None
  if x.ndim > 4:
    raise ValueError(f"{name} must broadcast to [B, N, T, S] = {(b, n, t, s)}; got {x.shape}")
  x = x.reshape((1,) * (4 - x.ndim) + x.shape)
  if any(d not in (1, full) for d, full in zip(x.shape, (b, n, t, s))):
    raise ValueError(f"{name} must broadcast to [B, N, T, S] = {(b, n, t, s)}; got {x.shape}")
  return x


class _Aux(NamedTuple):
  """The kernel's non-differentiated arrays, padded to whole blocks (None = absent): the dense
  ``mask`` ``[B|1, N|1, T|1, S|1]``, ``kv_valid`` ``[B, S]``, segment ids ``q_seg`` ``[B, T]`` and
  ``kv_seg`` ``[B, S]``, the query positions ``q_pos`` ``[B|1, T]`` and the dropout key ``rng``."""

  mask: jax.Array | None
  kv_valid: jax.Array | None
  q_seg: jax.Array | None
  kv_seg: jax.Array | None
  q_pos: jax.Array
  rng: jax.Array | None


def _dense_slice(x, qi, ki, tiles: Tiling):
  """``(starts, sizes)`` of block ``(qi, ki)`` in a dense ``[B|1, N|1, T|1, S|1]`` array."""
  bq, bk = tiles.bq, tiles.bk
  starts = (0, 0, qi * bq if x.shape[2] > 1 else 0, ki * bk if x.shape[3] > 1 else 0)
  sizes = (x.shape[0], x.shape[1], bq if x.shape[2] > 1 else 1, bk if x.shape[3] > 1 else 1)
  return starts, sizes


def _block(qi, ki, bias, params, aux: _Aux, st: Static, tiles: Tiling, b: int, n: int) -> Block:
  """What block ``(qi, ki)`` needs: its slices of ``aux`` and ``bias``, and its dropout mask."""
  mask, kvv, qs, ks, qp, rng = aux
  bq, bk = tiles.bq, tiles.bk

  def sl(x, i, size):
    return None if x is None else jax.lax.dynamic_slice_in_dim(x, i * size, size, axis=1)

  def dense(x):
    return None if x is None else jax.lax.dynamic_slice(x, *_dense_slice(x, qi, ki, tiles))

  keep = None
  if rng is not None:
    key = jax.random.fold_in(jax.random.fold_in(rng, qi), ki)
    keep = jax.random.bernoulli(key, 1.0 - st.dropout_rate, (b, n, bq, bk))
  return Block(
    q_pos=sl(qp, qi, bq),
    k_pos=ki * bk + jnp.arange(bk, dtype=jnp.int32),
    kv_valid=sl(kvv, ki, bk),
    q_seg=sl(qs, qi, bq),
    kv_seg=sl(ks, ki, bk),
    mask=dense(mask),
    bias=dense(bias),
    bias_params=params,
    keep=keep,
  )


def _key_range(q_pos_blk, st: Static, bk: int, nk: int):
  """The key blocks ``[lo, hi)`` a query block can see under causal / window."""
  lo, hi = jnp.int32(0), jnp.int32(nk)
  top, bottom = jnp.max(q_pos_blk), jnp.min(q_pos_blk)
  if st.causal:
    hi = jnp.clip(top // bk + 1, 0, nk)
  if st.window is not None:
    lo = jnp.clip((bottom - st.window + 1) // bk, 0, nk)
    if not st.causal:
      hi = jnp.clip((top + st.window - 1) // bk + 1, 0, nk)
  return lo, hi


def _kv_block(x, ki, bk: int):
  return jax.lax.dynamic_slice_in_dim(x, ki * bk, bk, axis=1)


def _forward(st: Static, tiles: Tiling, q5, k, v, bias, params, aux):
  """Output ``[B, T, K, G, H]`` and log-sum-exp ``[nq, B, K, G, bq]`` of the padded inputs."""
  b, tp, kh, g, h = q5.shape
  bq, bk = tiles.bq, tiles.bk
  nq, nk = tp // bq, k.shape[1] // bk

  def one_query_block(qi):
    q_blk = jax.lax.dynamic_slice_in_dim(q5, qi * bq, bq, axis=1)
    lo, hi = _key_range(jax.lax.dynamic_slice_in_dim(aux.q_pos, qi * bq, bq, axis=1), st, bk, nk)

    def step(ki, state):
      blk = _block(qi, ki, bias, params, aux, st, tiles, b, kh * g)
      return online_update(state, q_blk, _kv_block(k, ki, bk), _kv_block(v, ki, bk), blk, st)

    out, lse = finish(jax.lax.fori_loop(lo, hi, step, initial_state(b, kh, g, bq, h)))
    return out.astype(q5.dtype), lse

  out_QBKGtH, lse_QBKGt = jax.lax.map(one_query_block, jnp.arange(nq))
  out_BTKGH = out_QBKGtH.transpose(1, 0, 4, 2, 3, 5).reshape(b, tp, kh, g, h)
  return out_BTKGH, lse_QBKGt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(st: Static, tiles: Tiling, matmul_precision: str | None, q5, k, v, bias, params, aux):
  """The kernel on padded inputs (``q5`` ``[B, T, K, G, H]``, ``k``/``v`` ``[B, S, K, H]``):
  ``[B, T, K, G, H]``; its backward recomputes each block's scores from the saved lse."""
  return _forward(st, tiles, q5, k, v, bias, params, aux)[0]


def _attend_fwd(st, tiles, matmul_precision, q5, k, v, bias, params, aux):
  out, lse = _forward(st, tiles, q5, k, v, bias, params, aux)
  return out, (q5, k, v, bias, params, aux, out, lse)


def _attend_bwd(st, tiles, matmul_precision, res, do_BTKGH):
  with jax.default_matmul_precision(matmul_precision):  # the forward's (ops/precision.py)
    return _attend_grads(st, tiles, res, do_BTKGH)


def _attend_grads(st: Static, tiles: Tiling, res, do_BTKGH):
  q5, k, v, bias, params, aux, out, lse_QBKGt = res
  b, tp, kh, g, h = q5.shape
  n = kh * g
  bq, bk = tiles.bq, tiles.bk
  nq = tp // bq
  delta_BTKG = output_delta(do_BTKGH, out)
  delta_QBKGt = delta_BTKG.reshape(b, nq, bq, kh, g).transpose(1, 0, 3, 4, 2)

  def one_query_block(carry, qi):
    q_blk = jax.lax.dynamic_slice_in_dim(q5, qi * bq, bq, axis=1)
    do_blk = jax.lax.dynamic_slice_in_dim(do_BTKGH, qi * bq, bq, axis=1)
    lse, delta = lse_QBKGt[qi], delta_QBKGt[qi]
    lo, hi = _key_range(
      jax.lax.dynamic_slice_in_dim(aux.q_pos, qi * bq, bq, axis=1), st, bk, k.shape[1] // bk
    )

    def step(ki, c):
      dq, dk, dv, dbias, dparams = c
      blk = _block(qi, ki, bias, params, aux, st, tiles, b, n)
      dq_i, dk_i, dv_i, ds = block_grads(
        q_blk, _kv_block(k, ki, bk), _kv_block(v, ki, bk), do_blk, lse, delta, blk, st
      )

      def add(acc, x):
        return jax.lax.dynamic_update_slice_in_dim(acc, _kv_block(acc, ki, bk) + x, ki * bk, axis=1)

      dk, dv = add(dk, dk_i), add(dv, dv_i)
      ds_BNts = ds.reshape(b, n, bq, bk)
      if dbias is not None:
        starts, sizes = _dense_slice(dbias, qi, ki, tiles)
        dbias = jax.lax.dynamic_update_slice(
          dbias, jax.lax.dynamic_slice(dbias, starts, sizes) + sum_to(ds_BNts, sizes), starts
        )
      if st.bias_fn is not None:
        dparams = jax.tree.map(jnp.add, dparams, bias_params_grad(blk, st, ds))
      return dq + dq_i, dk, dv, dbias, dparams

    dq0 = jnp.zeros((b, bq, kh, g, h), jnp.float32)
    dq, *carry = jax.lax.fori_loop(lo, hi, step, (dq0, *carry))
    return tuple(carry), dq

  def zeros32(x):
    return jnp.zeros(x.shape, jnp.float32)

  init = (
    zeros32(k),
    zeros32(v),
    None if bias is None else zeros32(bias),
    None if st.bias_fn is None else jax.tree.map(jnp.zeros_like, params),
  )
  (dk, dv, dbias, dparams), dq_QBtKGH = jax.lax.scan(one_query_block, init, jnp.arange(nq))
  dq = dq_QBtKGH.transpose(1, 0, 2, 3, 4, 5).reshape(b, tp, kh, g, h)

  def cast(d, x):
    return None if d is None else d.astype(x.dtype)

  return (cast(dq, q5), cast(dk, k), cast(dv, v), cast(dbias, bias), dparams, None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def chunked_attention(
  q,
  k,
  v,
  *,
  q_pos,
  scale,
  causal=False,
  window=None,
  bias=None,
  mask=None,
  bias_fn=None,
  bias_params=None,
  kv_valid=None,
  q_segment_ids=None,
  kv_segment_ids=None,
  dropout_rate=0.0,
  dropout_rng=None,
  block_q=None,
  block_k=None,
  softcap=None,
):
  """The "chunked" kernel (see the module docstring); arguments as ``ops.dot_product_attention``,
  already checked, with ``q_pos`` the ``[B|1, T]`` int32 query positions. ``block_q`` and
  ``block_k`` are the largest block sizes; the blocks used are ``ceil(T / ceil(T / block_q))``
  rows (and the same for keys; None: ``default_block_sizes()``), and the dropout mask of block
  ``(i, j)`` is drawn from ``fold_in(fold_in(dropout_rng, i), j)``.

  Returns:
    ``[B, T, N, H]`` in q's dtype.

  Raises:
    ValueError: for block sizes below 1, or a dense mask or bias that does not broadcast to
      ``[B, N, T, S]``.
  """
  default_q, default_k = default_block_sizes()
  block_q = default_q if block_q is None else block_q
  block_k = default_k if block_k is None else block_k
  if block_q < 1 or block_k < 1:
    raise ValueError(f"block_q={block_q} and block_k={block_k} must be >= 1")
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  g = n // kh
  # As few blocks as block_q / block_k allow, evened out so that padding stays under one row per
  # block (T = 768 with block_q = 512 gives two blocks of 384, not 512 + 256 padded to 1024).
  nq, nk = -(-t // min(block_q, t)), -(-s // min(block_k, s))
  bq, bk = -(-t // nq), -(-s // nk)
  tp, sp = nq * bq, nk * bk
  drop = dropout_rate > 0.0 and dropout_rng is not None
  st = Static(
    scale=scale,
    causal=causal,
    window=window,
    s_len=s if sp != s else None,
    bias_fn=bias_fn,
    dropout_rate=dropout_rate if drop else 0.0,
    softcap=softcap,
  )

  # Pad the lengths to whole blocks; padded keys are masked (s_len), padded query rows dropped.
  q5 = _pad_axis(q, 1, tp).reshape(b, tp, kh, g, h)
  k, v = _pad_axis(k, 1, sp), _pad_axis(v, 1, sp)
  q_pos = _pad_axis(q_pos, 1, tp, edge=True)
  if kv_valid is not None:
    kv_valid = _pad_axis(kv_valid.astype(bool), 1, sp, False)
  if q_segment_ids is not None:
    kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
    q_segment_ids = _pad_axis(q_segment_ids, 1, tp, edge=True)
    kv_segment_ids = _pad_axis(kv_segment_ids, 1, sp, -1)
  mask = _dense_4d(mask, "mask", b, n, t, s)
  bias = _dense_4d(bias, "bias", b, n, t, s)
  if mask is not None:
    mask = _pad_axis(_pad_axis(mask, 2, tp, False), 3, sp, False)
  if bias is not None:
    bias = _pad_axis(_pad_axis(bias, 2, tp), 3, sp)
  aux = _Aux(mask, kv_valid, q_segment_ids, kv_segment_ids, q_pos, dropout_rng if drop else None)
  # The backward is traced after the forward's precision scope has closed (ops/precision.py).
  out_BTKGH = _attend(st, Tiling(bq, bk), precision.current(), q5, k, v, bias, bias_params, aux)
  return out_BTKGH.reshape(b, tp, n, h)[:, :t]
