"""Block-sparse self-attention: a kernel whose cost follows the pattern (``ops.sparse_pattern``'s
``SparsePattern`` says which keys each query sees, in blocks of ``block`` positions).

The keys a query sees are the union of the pattern's parts, ANDed with ``causal``, ``kv_valid``
and segment ids; ``SparsePattern.mask`` materialises it as a dense ``[T, T]`` array (the
reference and the "xla" path). The "chunked" kernel never forms it, and visits only what the
pattern holds:

  * the whole key blocks of the layout (local, global, random), listed per query block, so empty
    blocks are skipped: FlashAttention-2's online softmax over them (``ops.chunked``'s block steps);
  * the summary positions, gathered once into a dense ``[B, P, K, H]`` array and visited in chunks
    of ``block`` keys (under ``causal`` only the chunks at or before the query block), each masked
    where the layout already holds its key;
  * the strided keys as one gathered ``[block, T / block]`` block per query block: row ``r`` of
    query block ``a`` meets column ``m``, the key at ``m * block + r``.

The parts' key sets are disjoint, so folding them into one online softmax gives exactly the
softmax over their union. The ``jax.custom_vjp`` saves ``q, k, v``, the output and the log-sum-exp;
the backward recomputes every part's scores (as ``ops.chunked`` does).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax.ops import chunked, precision
from transformer_jax.ops.attention import check_qkv, dot_product_attention
from transformer_jax.ops.masks import MASK_VALUE
from transformer_jax.ops.sparse_pattern import SparsePattern

__all__ = ["SparsePattern", "sparse_attention"]


@dataclasses.dataclass(frozen=True)
class _Plan:
  """The static shape of one call: ``b`` positions per block, ``nb`` blocks, ``maxc`` the most
  layout blocks of a query block, ``ns`` summary chunks of ``b`` keys, ``summary`` and
  ``strided`` as in the pattern, ``t`` the real length, ``causal`` and the logits ``scale``."""

  b: int
  nb: int
  maxc: int
  ns: int
  summary: int
  strided: bool
  t: int
  causal: bool
  scale: float


class _Aux(NamedTuple):
  """Non-differentiated arrays: ``idx`` ``[nb, maxc]`` / ``cnt`` ``[nb]`` the layout blocks of
  each query block, ``lay`` ``[nb, nb]`` the layout, ``ps`` ``[ns * b]`` the summary positions
  (padded with a position past the end), ``s_hi`` ``[nb]`` the summary chunks each query block
  visits, ``kv_valid`` ``[B, Tp]`` and ``seg`` ``[B, Tp]`` (or None), ``first_bias`` ``[nb]``
  the logits bias of key block 0 per query block (``random_first``; None: none)."""

  idx: jax.Array
  cnt: jax.Array
  lay: jax.Array
  ps: jax.Array
  s_hi: jax.Array
  kv_valid: jax.Array | None
  seg: jax.Array | None
  first_bias: jax.Array | None = None


def _static(plan: _Plan) -> chunked.Static:
  return chunked.Static(scale=plan.scale, causal=plan.causal, s_len=plan.t)


def _q_block(x, qi, b):
  return jax.lax.dynamic_slice_in_dim(x, qi * b, b, axis=1)


def _take(x, idx):
  return None if x is None else jnp.take(x, idx, axis=1)


def _layout_block(qi, ki, aux: _Aux, plan: _Plan) -> chunked.Block:
  b = plan.b
  q_pos = qi * b + jnp.arange(b, dtype=jnp.int32)
  seg = aux.seg
  bias = None
  if aux.first_bias is not None:
    bias = jnp.broadcast_to(jnp.where(ki == 0, aux.first_bias[qi], 0.0), (1, 1, 1, b))
  return chunked.Block(
    q_pos=q_pos[None],
    k_pos=ki * b + jnp.arange(b, dtype=jnp.int32),
    kv_valid=None if aux.kv_valid is None else _q_block(aux.kv_valid, ki, b),
    q_seg=None if seg is None else _q_block(seg, qi, b),
    kv_seg=None if seg is None else _q_block(seg, ki, b),
    bias=bias,
  )


def _summary_block(qi, si, aux: _Aux, plan: _Plan) -> chunked.Block:
  """Summary chunk ``si`` for query block ``qi``: its positions, masked where the layout already
  holds the key's block (that key is counted once, in the layout part)."""
  b = plan.b
  k_pos = jax.lax.dynamic_slice_in_dim(aux.ps, si * b, b)
  fresh = ~aux.lay[qi][jnp.clip(k_pos // b, 0, plan.nb - 1)]
  seg = aux.seg
  return chunked.Block(
    q_pos=(qi * b + jnp.arange(b, dtype=jnp.int32))[None],
    k_pos=k_pos,
    kv_valid=_take(aux.kv_valid, jnp.clip(k_pos, 0, plan.nb * b - 1)),
    q_seg=None if seg is None else _q_block(seg, qi, b),
    kv_seg=_take(seg, jnp.clip(k_pos, 0, plan.nb * b - 1)),
    mask=fresh[None, None, None, :],
  )


def _gather_summary(x, aux: _Aux, plan: _Plan):
  """``x`` ``[B, Tp, K, H]`` at the summary positions: ``[B, ns * b, K, H]``."""
  return jnp.take(x, jnp.clip(aux.ps, 0, plan.nb * plan.b - 1), axis=1)


def _diag_logits(q_blk, kb, qi, aux: _Aux, plan: _Plan):
  """The strided part of query block ``qi``: logits ``[B, K, G, b, nb]`` (row r, column m is the
  key at ``m * b + r``) and their validity ``[B|1, 1, 1, b, nb]``."""
  b, nb = plan.b, plan.nb
  logits = jnp.einsum("BrKGH,BmrKH->BKGrm", q_blk, kb, preferred_element_type=jnp.float32)
  logits = logits * jnp.float32(plan.scale)
  r, m = jnp.arange(b)[:, None], jnp.arange(nb)[None, :]
  k_pos = m * b + r
  valid = (k_pos < plan.t) & ~aux.lay[qi][None, :]
  if plan.summary:  # those keys are summary positions, counted in the summary part
    valid = valid & (r < b - plan.summary)
  if plan.causal:
    valid = valid & (k_pos <= qi * b + r)
  valid = valid[None]
  if aux.kv_valid is not None:
    valid = valid & aux.kv_valid.reshape(-1, nb, b).transpose(0, 2, 1)
  if aux.seg is not None:
    seg_Brm = aux.seg.reshape(-1, nb, b).transpose(0, 2, 1)
    valid = valid & (_q_block(aux.seg, qi, b)[:, :, None] == seg_Brm)
  valid = valid[:, None, None]
  return jnp.where(valid, logits, MASK_VALUE), valid


def _fold(state: chunked.SoftmaxState, logits, valid, pv_fn) -> chunked.SoftmaxState:
  """One more set of logits into an online softmax; ``pv_fn(p)`` gives ``[B, K, G, b, H]``."""
  new_max = jnp.maximum(state.max, jnp.max(logits, axis=-1))
  corr = jnp.exp(state.max - new_max)
  p = jnp.where(valid, jnp.exp(logits - new_max[..., None]), 0.0)
  return chunked.SoftmaxState(
    new_max, state.denom * corr + jnp.sum(p, axis=-1), state.numer * corr[..., None] + pv_fn(p)
  )


def _blocked(x, plan: _Plan):
  """``[B, Tp, K, H]`` as ``[B, nb, b, K, H]``."""
  return x.reshape(x.shape[0], plan.nb, plan.b, *x.shape[2:])


def _forward(plan: _Plan, q5, k, v, aux: _Aux):
  """Output ``[B, Tp, K, G, H]`` and log-sum-exp ``[nb, B, K, G, b]``."""
  bsz, tp, kh, g, h = q5.shape
  b, st = plan.b, _static(plan)
  ks = vs = None
  if plan.ns:
    ks, vs = _gather_summary(k, aux, plan), _gather_summary(v, aux, plan)
  kb, vb = _blocked(k, plan), _blocked(v, plan)

  def one_query_block(qi):
    q_blk = _q_block(q5, qi, b)

    def layout_step(m, state):
      ki = aux.idx[qi, m]
      return chunked.online_update(
        state, q_blk, _q_block(k, ki, b), _q_block(v, ki, b), _layout_block(qi, ki, aux, plan), st
      )

    def summary_step(si, state):
      return chunked.online_update(
        state,
        q_blk,
        _q_block(ks, si, b),
        _q_block(vs, si, b),
        _summary_block(qi, si, aux, plan),
        st,
      )

    state = chunked.initial_state(bsz, kh, g, b, h)
    state = jax.lax.fori_loop(0, aux.cnt[qi], layout_step, state)
    if plan.ns:
      state = jax.lax.fori_loop(0, aux.s_hi[qi], summary_step, state)
    if plan.strided:
      logits, valid = _diag_logits(q_blk, kb, qi, aux, plan)
      state = _fold(
        state,
        logits,
        valid,
        lambda p: jnp.einsum(
          "BKGrm,BmrKH->BKGrH", p.astype(v.dtype), vb, preferred_element_type=jnp.float32
        ),
      )
    out, lse = chunked.finish(state)
    return out.astype(q5.dtype), lse

  out_QBKGtH, lse_QBKGt = jax.lax.map(one_query_block, jnp.arange(plan.nb))
  return out_QBKGtH.transpose(1, 0, 4, 2, 3, 5).reshape(bsz, tp, kh, g, h), lse_QBKGt


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(plan: _Plan, matmul_precision: str | None, q5, k, v, aux: _Aux):
  return _forward(plan, q5, k, v, aux)[0]


def _attend_fwd(plan, matmul_precision, q5, k, v, aux):
  out, lse = _forward(plan, q5, k, v, aux)
  return out, (q5, k, v, aux, out, lse)


def _attend_bwd(plan, matmul_precision, res, do_BTKGH):
  with jax.default_matmul_precision(matmul_precision):  # the forward's (ops/precision.py)
    return _grads(plan, res, do_BTKGH)


def _grads(plan: _Plan, res, do_BTKGH):
  q5, k, v, aux, out, lse_QBKGt = res
  bsz, tp, kh, g, h = q5.shape
  b, nb, st = plan.b, plan.nb, _static(plan)
  f32 = jnp.float32
  delta_QBKGt = (
    chunked.output_delta(do_BTKGH, out).reshape(bsz, nb, b, kh, g).transpose(1, 0, 3, 4, 2)
  )
  ks = vs = None
  if plan.ns:
    ks, vs = _gather_summary(k, aux, plan), _gather_summary(v, aux, plan)
  kb, vb = _blocked(k, plan), _blocked(v, plan)

  def add(acc, x, i):
    return jax.lax.dynamic_update_slice_in_dim(acc, _q_block(acc, i, b) + x, i * b, axis=1)

  def one_query_block(carry, qi):
    q_blk, do_blk = _q_block(q5, qi, b), _q_block(do_BTKGH, qi, b)
    lse, delta = lse_QBKGt[qi], delta_QBKGt[qi]

    def layout_step(m, c):
      dq, dk, dv, dks, dvs = c
      ki = aux.idx[qi, m]
      dq_i, dk_i, dv_i, _ = chunked.block_grads(
        q_blk,
        _q_block(k, ki, b),
        _q_block(v, ki, b),
        do_blk,
        lse,
        delta,
        _layout_block(qi, ki, aux, plan),
        st,
      )
      return dq + dq_i, add(dk, dk_i, ki), add(dv, dv_i, ki), dks, dvs

    def summary_step(si, c):
      dq, dk, dv, dks, dvs = c
      dq_i, dk_i, dv_i, _ = chunked.block_grads(
        q_blk,
        _q_block(ks, si, b),
        _q_block(vs, si, b),
        do_blk,
        lse,
        delta,
        _summary_block(qi, si, aux, plan),
        st,
      )
      return dq + dq_i, dk, dv, add(dks, dk_i, si), add(dvs, dv_i, si)

    c = (jnp.zeros((bsz, b, kh, g, h), f32), *carry)
    c = jax.lax.fori_loop(0, aux.cnt[qi], layout_step, c)
    if plan.ns:
      c = jax.lax.fori_loop(0, aux.s_hi[qi], summary_step, c)
    dq, dk, dv, dks, dvs = c
    if plan.strided:
      logits, valid = _diag_logits(q_blk, kb, qi, aux, plan)
      p = jnp.where(valid, jnp.exp(logits - lse[..., None]), 0.0)
      do32 = do_blk.astype(f32)
      dp = jnp.einsum("BrKGH,BmrKH->BKGrm", do32, vb.astype(f32))
      ds = p * (dp - delta[..., None])
      dq = dq + jnp.einsum("BKGrm,BmrKH->BrKGH", ds, kb.astype(f32)) * plan.scale
      dkb = jnp.einsum("BKGrm,BrKGH->BmrKH", ds, q_blk.astype(f32)) * plan.scale
      dvb = jnp.einsum("BKGrm,BrKGH->BmrKH", p, do32)
      dk, dv = dk + dkb.reshape(dk.shape), dv + dvb.reshape(dv.shape)
    return (dk, dv, dks, dvs), dq

  def zeros(x):
    return None if x is None else jnp.zeros(x.shape, f32)

  init = (zeros(k), zeros(v), zeros(ks), zeros(vs))
  (dk, dv, dks, dvs), dq_QBtKGH = jax.lax.scan(one_query_block, init, jnp.arange(nb))
  if plan.ns:  # the summary positions are distinct: a scatter-add puts each back once
    pos = jnp.clip(aux.ps, 0, tp - 1)
    real = (aux.ps < tp)[None, :, None, None]
    dk = dk.at[:, pos].add(jnp.where(real, dks, 0.0))
    dv = dv.at[:, pos].add(jnp.where(real, dvs, 0.0))
  dq = dq_QBtKGH.transpose(1, 0, 2, 3, 4, 5).reshape(bsz, tp, kh, g, h)
  return dq.astype(q5.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)


def _tables(pattern: SparsePattern, t: int, causal: bool):
  """The static index tables of a call (NumPy): layout, its block lists, summary chunks."""
  b = pattern.block
  nb = pattern.num_blocks(t)
  lay = pattern.layout(nb, causal=causal)
  cnt = lay.sum(1).astype(np.int32)
  maxc = max(int(cnt.max()), 1)
  idx = np.zeros((nb, maxc), np.int32)
  for a in range(nb):
    cols = np.flatnonzero(lay[a])
    idx[a, : cols.size] = cols
  ps = pattern.summary_positions(t)
  ns = -(-ps.size // b)
  ps_pad = np.full(ns * b, nb * b + b, np.int32)  # past the end: masked by s_len and causal
  ps_pad[: ps.size] = ps
  if causal:  # the chunks whose first position a query of the block can see
    first = ps_pad[::b] if ns else np.zeros(0, np.int32)
    s_hi = np.array([(first <= a * b + b - 1).sum() for a in range(nb)], np.int32)
  else:
    s_hi = np.full(nb, ns, np.int32)
  return lay, idx, cnt, maxc, ps_pad, ns, s_hi


def sparse_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  pattern: SparsePattern,
  *,
  causal: bool = False,
  scale: float | None = None,
  kv_valid: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  implementation: Literal["chunked", "xla"] = "chunked",
) -> jax.Array:
  """Self-attention over the keys ``pattern`` gives each query (``softmax`` over them only).

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, T, K, H]``, ``N % K == 0``; the same length as the queries (self-attention:
      query ``i`` and key ``i`` sit at position ``i``).
    v: values ``[B, T, K, H]``.
    pattern: the ``SparsePattern``.
    causal: query ``i`` sees keys at positions ``<= i`` only (ANDed with the pattern).
    scale: logits scale; default ``1 / sqrt(H)``.
    kv_valid: ``[B, T]`` bool, False for padding keys.
    segment_ids: ``[B, T]`` int; queries see only keys of their own segment.
    implementation: ``"chunked"`` (the kernel of the module docstring: work in proportion to the
      keys seen) or ``"xla"`` (dense scores under ``pattern.mask`` and ``pattern.bias``: the
      reference). A length up to ``pattern.dense_up_to`` gets ordinary attention either way.

  Returns:
    ``[B, T, N, H]`` in q's dtype; a query that sees no key gives zeros.

  Raises:
    ValueError: for shapes that do not match, a key length other than the query length, or an
      unknown implementation.
  """
  check_qkv(q, k, v)
  bsz, t, n, h = q.shape
  if k.shape[1] != t:
    raise ValueError(
      f"sparse attention is self-attention: keys of length {k.shape[1]} must "
      f"match the queries' T={t}"
    )
  if not isinstance(pattern, SparsePattern):
    raise ValueError(f"pattern must be a SparsePattern; got {type(pattern).__name__}")
  for name, x in (("kv_valid", kv_valid), ("segment_ids", segment_ids)):
    if x is not None and x.shape != (bsz, t):
      raise ValueError(f"{name} must be [B, T] = {(bsz, t)}; got shape {x.shape}")
  scale = h**-0.5 if scale is None else float(scale)
  if implementation not in ("chunked", "xla"):
    raise ValueError(f"implementation={implementation!r} must be 'chunked' or 'xla'")
  if pattern.is_dense(t):
    return dot_product_attention(
      q,
      k,
      v,
      causal=causal,
      scale=scale,
      kv_valid=kv_valid,
      q_segment_ids=segment_ids,
      implementation="xla" if implementation == "xla" else None,
    )
  match implementation:
    case "xla":
      bias = pattern.bias(t, causal=causal)
      return dot_product_attention(
        q,
        k,
        v,
        mask=jnp.asarray(pattern.mask(t, causal=causal))[None, None],
        causal=causal,
        bias=None if bias is None else jnp.asarray(bias, jnp.float32)[None, None],
        scale=scale,
        kv_valid=kv_valid,
        q_segment_ids=segment_ids,
        implementation="xla",
      )
    case "chunked":
      pass
  kh = k.shape[2]
  lay, idx, cnt, maxc, ps, ns, s_hi = _tables(pattern, t, causal)
  b = pattern.block
  nb = lay.shape[0]
  tp = nb * b

  def pad(x, value):
    return (
      None
      if x is None
      else jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2), constant_values=value)
    )

  q5 = pad(q, 0).reshape(bsz, tp, kh, n // kh, h)
  first_bias = None
  if pattern.random_first and pattern.random_blocks:
    count = pattern.first_block_count(nb, causal=causal)
    first_bias = jnp.asarray(np.log(np.maximum(count, 1)), jnp.float32)
  aux = _Aux(
    jnp.asarray(idx),
    jnp.asarray(cnt),
    jnp.asarray(lay),
    jnp.asarray(ps),
    jnp.asarray(s_hi),
    pad(None if kv_valid is None else kv_valid.astype(bool), False),
    pad(segment_ids, -1),
    first_bias,
  )
  plan = _Plan(
    b=b,
    nb=nb,
    maxc=maxc,
    ns=ns,
    summary=pattern.summary,
    strided=pattern.strided,
    t=t,
    causal=causal,
    scale=scale,
  )
  out = _attend(plan, precision.current(), q5, pad(k, 0), pad(v, 0), aux)
  return out.reshape(bsz, tp, n, h)[:, :t]
