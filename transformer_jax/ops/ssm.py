"""Selective state-space scans: Mamba-1's selective scan (Gu and Dao, 2023) and Mamba-2's
state-space duality, SSD (Dao and Gu, 2024), with the causal depthwise convolution before them.

Letters (this module's own, beside ``ops.attention``'s legend): B batch, T length, E channels
(Mamba-1's expanded width ``d_inner``), S state size (``d_state``), N heads and H head dim of
Mamba-2 (``N * H = d_inner``), G groups sharing one B and C (``N % G == 0``), C channels of a
convolution, W its width, Q chunk length, Z number of chunks. The matrices ``B`` and ``C`` of the
papers keep their names (``B_BTS`` is the input matrix, ``[batch, length, state]``).

Mamba-1, per channel e and state s, with ``dt > 0`` and ``A < 0``:

    h_t[e, s] = exp(dt_t[e] A[e, s]) h_{t-1}[e, s] + dt_t[e] B_t[s] x_t[e]
    y_t[e]    = sum_s C_t[s] h_t[e, s] + D[e] x_t[e]

Mamba-2, per head n (group g = n // (N / G)), ``A`` one scalar per head:

    h_t[n] = exp(dt_t[n] A[n]) h_{t-1}[n] + dt_t[n] x_t[n] B_t[g]^T      (h [H, S])
    y_t[n] = h_t[n] C_t[g] + D[n] x_t[n]

Training runs in chunks of Q positions under one ``lax.scan`` that carries the state from chunk to
chunk; each chunk's body is rematerialised in the backward pass, so neither the forward nor the
gradient holds the ``[B, T, E, S]`` (or ``[B, T, N, H, S]``) states of the whole sequence: memory
is O(T E + (T / Q) E S + Q E S). Inside a chunk Mamba-1 runs an associative scan; Mamba-2 the SSD
four-term form (the intra-chunk quadratic, the chunk's state from its inputs, the state carried
across chunks, its contribution to each output). Decoding runs the recurrence one position at a
time (``selective_scan_step``, ``ssd_step``, ``causal_conv1d_step``).

Masks act in dt (log-decay) space: a position that is padding (``valid`` False) gets ``dt = 0``,
so its decay is ``exp(0) = 1`` and its input ``0``: it leaves the state exactly as it was, with
nothing decayed and undone. ``segment_ids`` (packed documents) restart the state where the id
changes: no output sees an input of another segment.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from transformer_jax.ops.norms import rms_norm


class SSMState(NamedTuple):
  """A mixer's decoding state: the last ``W - 1`` convolution inputs ``conv [B, W - 1, C]`` and
  the scan's state ``ssm`` (Mamba-1 ``[B, E, S]``, Mamba-2 ``[B, N, H, S]``), float32."""

  conv: jax.Array
  ssm: jax.Array


# --- masks -------------------------------------------------------------------------------------


def _check_mask(name: str, mask, b: int, t: int):
  if mask is not None and tuple(mask.shape) != (b, t):
    raise ValueError(f"{name} must be [B, T] = {(b, t)}; got shape {tuple(mask.shape)}")


def segment_index(segment_ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """``[B, T]`` int32 count of segment changes up to each position: 0 for the first segment (the
  one an initial state belongs to), +1 at every position whose id differs from the one before."""
  if segment_ids is None:
    return jnp.zeros((b, t), jnp.int32)
  ids = jnp.asarray(segment_ids)
  change_BT = jnp.concatenate([jnp.zeros((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
  return jnp.cumsum(change_BT.astype(jnp.int32), axis=1)


def _last_valid_end(valid_BT: jax.Array | None, b: int, t: int) -> jax.Array:
  """``[B]`` one past each row's last valid position (T without a mask; 0 for an empty row)."""
  if valid_BT is None:
    return jnp.full((b,), t, jnp.int32)
  pos_BT = jnp.arange(1, t + 1, dtype=jnp.int32)[None, :]
  return jnp.max(jnp.where(valid_BT, pos_BT, 0), axis=1)


# --- the causal depthwise convolution ----------------------------------------------------------


def causal_conv1d(
  x_BTC: jax.Array,
  w_WC: jax.Array,
  bias_C: jax.Array | None = None,
  *,
  state_BWC: jax.Array | None = None,
  valid: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  return_state: bool = False,
):
  """Causal depthwise convolution: ``y_t[c] = bias[c] + sum_j w[j, c] x_{t - W + 1 + j}[c]``.

  ``w[W - 1]`` weighs the current input (PyTorch's ``Conv1d(groups=C, padding=W - 1)`` cropped to
  T, with its ``[C, 1, W]`` weight as ``w[j, c] = weight[c, 0, j]``).

  Args:
    x_BTC: ``[B, T, C]`` inputs.
    w_WC: ``[W, C]`` taps.
    bias_C: ``[C]`` or None.
    state_BWC: ``[B, W - 1, C]`` the inputs before position 0 (a decoding state); default zeros.
    valid: ``[B, T]`` bool, False for padding: its inputs count as zeros, and the returned state
      holds the ``W - 1`` inputs up to each row's last valid position.
    segment_ids: ``[B, T]`` ints: no output sees an input of another segment (the state belongs
      to the first segment).
    return_state: also return the state after the inputs.

  Returns:
    ``[B, T, C]`` (float32 accumulation, in x's dtype); with ``return_state``, ``(y, state)``.
  """
  b, t, c = x_BTC.shape
  w = w_WC.shape[0]
  if w_WC.shape != (w, c):
    raise ValueError(f"w must be [W, C] with C={c}; got shape {tuple(w_WC.shape)}")
  _check_mask("valid", valid, b, t)
  _check_mask("segment_ids", segment_ids, b, t)
  x32 = x_BTC.astype(jnp.float32)
  if valid is not None:
    x32 = jnp.where(jnp.asarray(valid, bool)[..., None], x32, 0.0)
  prev = (
    jnp.zeros((b, w - 1, c), jnp.float32) if state_BWC is None else state_BWC.astype(jnp.float32)
  )
  full = jnp.concatenate([prev, x32], axis=1)  # [B, W - 1 + T, C]
  seg = None
  if segment_ids is not None:  # the state's entries belong to segment 0
    seg = jnp.concatenate(
      [jnp.zeros((b, w - 1), jnp.int32), segment_index(segment_ids, b, t)], axis=1
    )
  w32 = w_WC.astype(jnp.float32)
  y = jnp.zeros((b, t, c), jnp.float32)
  for j in range(w):  # W is small (4): one shifted product per tap
    tap = full[:, j : j + t] * w32[j]
    if seg is not None:
      tap = jnp.where((seg[:, j : j + t] == seg[:, w - 1 :])[..., None], tap, 0.0)
    y = y + tap
  if bias_C is not None:
    y = y + bias_C.astype(jnp.float32)
  y = y.astype(x_BTC.dtype)
  if not return_state:
    return y
  end_B = _last_valid_end(None if valid is None else jnp.asarray(valid, bool), b, t)
  idx_BW = end_B[:, None] + jnp.arange(w - 1, dtype=jnp.int32)[None, :]
  return y, jnp.take_along_axis(full, idx_BW[..., None], axis=1)


def causal_conv1d_step(
  state_BWC: jax.Array, x_BC: jax.Array, w_WC: jax.Array, bias_C: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """One position of ``causal_conv1d``: ``(y [B, C] in x's dtype, the new state [B, W - 1, C])``."""
  window = jnp.concatenate(
    [state_BWC.astype(jnp.float32), x_BC.astype(jnp.float32)[:, None]], axis=1
  )  # [B, W, C]
  y = jnp.einsum("bwc,wc->bc", window, w_WC.astype(jnp.float32))
  if bias_C is not None:
    y = y + bias_C.astype(jnp.float32)
  return y.astype(x_BC.dtype), window[:, 1:]


# --- shared chunking ---------------------------------------------------------------------------


def _chunked(a, q: int, pad: int, fill=0):
  """``[B, T, ...] -> [Z, B, Q, ...]`` (chunks lead, for the scan), padded at the end."""
  if pad:
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)
  b, tp = a.shape[:2]
  return jnp.swapaxes(a.reshape(b, tp // q, q, *a.shape[2:]), 0, 1)


def _unchunked(a, t: int):
  """``[Z, B, Q, ...] -> [B, T, ...]``."""
  a = jnp.swapaxes(a, 0, 1)
  return a.reshape(a.shape[0], -1, *a.shape[3:])[:, :t]


def _check_chunk(chunk_size):
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")


def _masked_dt(dt, valid, b, t):
  dt = dt.astype(jnp.float32)
  if valid is None:
    return dt
  keep = jnp.asarray(valid, bool).reshape(b, t, *([1] * (dt.ndim - 2)))
  return jnp.where(keep, dt, 0.0)


# --- Mamba-1 -----------------------------------------------------------------------------------


def _combine(left, right):
  """The selective scan's associative operator on ``(decay, added)`` pairs: applying ``left``
  then ``right`` to a state ``h`` gives ``a_r (a_l h + u_l) + u_r``."""
  a_l, u_l = left
  a_r, u_r = right
  return a_l * a_r, a_r * u_l + u_r


SCAN_METHODS = ("associative", "sequential")


def choose_scan_method(platform: str) -> str:
  """``selective_scan``'s ``method`` for a platform: ``"sequential"`` on a CPU (the associative
  scan's extra work costs more there than its depth saves: about 3x slower in a training step
  at B=16, T=128, E=256, S=16), ``"associative"`` on GPUs and TPUs."""
  return "sequential" if platform == "cpu" else "associative"


def selective_scan(
  x: jax.Array,
  dt: jax.Array,
  A: jax.Array,
  B: jax.Array,
  C: jax.Array,
  D: jax.Array | None = None,
  *,
  chunk_size: int = 64,
  initial_state: jax.Array | None = None,
  return_state: bool = False,
  valid: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
  method: str = "associative",
):
  """Mamba-1's selective scan (module docstring), in chunks of ``chunk_size`` positions.

  Args:
    x: ``[B, T, E]`` inputs.
    dt: ``[B, T, E]`` time steps, > 0 (after the softplus).
    A: ``[E, S]`` the state matrix's diagonal, < 0 (``-exp(A_log)``).
    B: ``[B, T, S]`` input matrix; C: ``[B, T, S]`` output matrix.
    D: ``[E]`` skip weight, or None.
    chunk_size: positions per chunk (T need not be a multiple).
    initial_state: ``[B, E, S]`` the state before position 0; default zeros.
    return_state: also return the state after the last position.
    valid: ``[B, T]`` bool; False positions leave the state unchanged (their outputs are still
      computed from it).
    segment_ids: ``[B, T]`` ints; the state restarts from zero where the id changes.
    method: inside a chunk, ``"associative"`` (``lax.associative_scan``: log-depth, for
      accelerators) or ``"sequential"`` (a ``lax.scan`` over its positions: about 3x less work,
      faster on a CPU). The same numbers up to rounding.

  Returns:
    ``y [B, T, E]`` float32; with ``return_state``, ``(y, state [B, E, S] float32)``.
  """
  b, t, e = x.shape
  s = A.shape[-1]
  if dt.shape != x.shape or A.shape != (e, s) or B.shape != (b, t, s) or C.shape != (b, t, s):
    raise ValueError(
      f"selective_scan shapes: x {x.shape} and dt {dt.shape} [B, T, E], A "
      f"{A.shape} [E, S], B {B.shape} and C {C.shape} [B, T, S]"
    )
  _check_chunk(chunk_size)
  _check_mask("valid", valid, b, t)
  _check_mask("segment_ids", segment_ids, b, t)
  if method not in SCAN_METHODS:
    raise ValueError(f"method={method!r} must be one of {', '.join(map(repr, SCAN_METHODS))}")
  q = min(chunk_size, t)
  pad = (-t) % q
  x32, dt32 = x.astype(jnp.float32), _masked_dt(dt, valid, b, t)
  seg_BT = segment_index(segment_ids, b, t)
  restart_BT = jnp.concatenate([jnp.zeros((b, 1), bool), seg_BT[:, 1:] != seg_BT[:, :-1]], axis=1)
  # Padding at the end: dt = 0 keeps the state, so the final state is that of position T - 1.
  chunks = [
    _chunked(a, q, pad)
    for a in (x32, dt32, B.astype(jnp.float32), C.astype(jnp.float32), restart_BT)
  ]
  A32 = A.astype(jnp.float32)
  h0 = (
    jnp.zeros((b, e, s), jnp.float32)
    if initial_state is None
    else initial_state.astype(jnp.float32)
  )

  def position(h_BES, xs):
    x_BE, dt_BE, B_BS, C_BS, restart_B = xs
    decay_BES = jnp.where(restart_B[:, None, None], 0.0, jnp.exp(dt_BE[..., None] * A32))
    h_BES = decay_BES * h_BES + (dt_BE * x_BE)[..., None] * B_BS[:, None, :]
    return h_BES, jnp.einsum("bes,bs->be", h_BES, C_BS)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def chunk(h_BES, xs):
    if method == "sequential":
      h_BES, y_QBE = jax.lax.scan(position, h_BES, tuple(jnp.swapaxes(a, 0, 1) for a in xs))
      return h_BES, jnp.swapaxes(y_QBE, 0, 1)
    x_BQE, dt_BQE, B_BQS, C_BQS, restart_BQ = xs
    decay_BQES = jnp.exp(dt_BQE[..., None] * A32)
    decay_BQES = jnp.where(restart_BQ[..., None, None], 0.0, decay_BQES)
    added_BQES = (dt_BQE * x_BQE)[..., None] * B_BQS[:, :, None, :]
    decay_BQES, added_BQES = jax.lax.associative_scan(_combine, (decay_BQES, added_BQES), axis=1)
    h_BQES = decay_BQES * h_BES[:, None] + added_BQES
    y_BQE = jnp.einsum("bqes,bqs->bqe", h_BQES, C_BQS)
    return h_BQES[:, -1], y_BQE

  h_end, y = jax.lax.scan(chunk, h0, tuple(chunks))
  y_BTE = _unchunked(y, t)
  if D is not None:
    y_BTE = y_BTE + x32 * D.astype(jnp.float32)
  return (y_BTE, h_end) if return_state else y_BTE


def selective_scan_step(
  state: jax.Array,
  x: jax.Array,
  dt: jax.Array,
  A: jax.Array,
  B: jax.Array,
  C: jax.Array,
  D: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """One position of ``selective_scan``: ``state [B, E, S]``, ``x``/``dt`` ``[B, E]``, ``B``/``C``
  ``[B, S]``; returns ``(y [B, E] float32, the new state)``."""
  dt32, x32 = dt.astype(jnp.float32), x.astype(jnp.float32)
  h = (
    jnp.exp(dt32[..., None] * A.astype(jnp.float32)) * state.astype(jnp.float32)
    + (dt32 * x32)[..., None] * B.astype(jnp.float32)[:, None, :]
  )
  y = jnp.einsum("bes,bs->be", h, C.astype(jnp.float32))
  if D is not None:
    y = y + x32 * D.astype(jnp.float32)
  return y, h


# --- Mamba-2 (SSD) -----------------------------------------------------------------------------


def _clamped_dt(dt, time_step_limit):
  lo, hi = time_step_limit
  if not lo <= hi:
    raise ValueError(f"time_step_limit={tuple(time_step_limit)!r} must have low <= high")
  return jnp.clip(dt.astype(jnp.float32), lo, hi)


def ssd(
  x: jax.Array,
  dt: jax.Array,
  A: jax.Array,
  B: jax.Array,
  C: jax.Array,
  D: jax.Array | None = None,
  *,
  chunk_size: int = 256,
  time_step_limit: tuple[float, float] = (0.0, float("inf")),
  initial_state: jax.Array | None = None,
  return_state: bool = False,
  valid: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
):
  """Mamba-2's scan (module docstring) in the chunked state-space-duality form.

  Within a chunk of Q positions, with ``a_t = dt_t A`` and ``cum_l = sum_{j <= l} a_j``:

    1. intra-chunk: ``y_l += sum_{s <= l} exp(cum_l - cum_s) (C_l . B_s) dt_s x_s``;
    2. the chunk's own state: ``sum_s exp(cum_{Q-1} - cum_s) dt_s x_s B_s^T``;
    3. the carried state: ``h_out = exp(cum_{Q-1}) h_in + (2)``;
    4. the carried state's output: ``y_l += exp(cum_l) h_in C_l``.

  Decay differences are masked before ``exp`` (never ``exp`` of a positive number).

  Args:
    x: ``[B, T, N, H]`` inputs.
    dt: ``[B, T, N]`` time steps, > 0 (after the softplus); clamped to ``time_step_limit``.
    A: ``[N]`` one decay rate per head, < 0.
    B: ``[B, T, G, S]`` input matrix; C: ``[B, T, G, S]`` output matrix (head n reads group
      ``n // (N / G)``).
    D: ``[N]`` skip weight, or None.
    chunk_size: Q (T need not be a multiple).
    time_step_limit: ``(low, high)`` bounds of dt.
    initial_state: ``[B, N, H, S]``; default zeros.
    return_state: also return the state after the last position.
    valid: ``[B, T]`` bool; False positions leave the state unchanged (dt = 0 after clamping).
    segment_ids: ``[B, T]`` ints; the state restarts from zero where the id changes.

  Returns:
    ``y [B, T, N, H]`` float32; with ``return_state``, ``(y, state [B, N, H, S] float32)``.
  """
  b, t, n, h = x.shape
  g, s = B.shape[2], B.shape[3]
  if (
    dt.shape != (b, t, n)
    or A.shape != (n,)
    or B.shape != (b, t, g, s)
    or C.shape != (b, t, g, s)
    or n % g
  ):
    raise ValueError(
      f"ssd shapes: x {x.shape} [B, T, N, H], dt {dt.shape} [B, T, N], A "
      f"{A.shape} [N], B {B.shape} and C {C.shape} [B, T, G, S] with N % G == 0"
    )
  _check_chunk(chunk_size)
  _check_mask("valid", valid, b, t)
  _check_mask("segment_ids", segment_ids, b, t)
  q = min(chunk_size, t)
  pad = (-t) % q
  dt32 = _masked_dt(_clamped_dt(dt, time_step_limit), valid, b, t)
  seg_BT = segment_index(segment_ids, b, t)
  # Padding at the end: dt = 0 (no decay, no input) and the last real position's segment.
  chunks = [
    _chunked(a, q, pad)
    for a in (x.astype(jnp.float32), dt32, B.astype(jnp.float32), C.astype(jnp.float32))
  ]
  seg_chunks = _chunked(jnp.pad(seg_BT, ((0, 0), (0, pad)), mode="edge"), q, 0)
  # The segment each chunk's incoming state belongs to: that of the position before the chunk.
  seg_in_ZB = jnp.concatenate([jnp.zeros((1, b), jnp.int32), seg_chunks[:-1, :, -1]], axis=0)
  A32 = A.astype(jnp.float32)
  rep = n // g
  causal_QQ = jnp.tril(jnp.ones((q, q), bool))
  h0 = (
    jnp.zeros((b, n, h, s), jnp.float32)
    if initial_state is None
    else initial_state.astype(jnp.float32)
  )

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def chunk(h_BNHS, xs):
    x_BQNH, dt_BQN, B_BQGS, C_BQGS, seg_BQ, seg_in_B = xs
    B_BQNS = jnp.repeat(B_BQGS, rep, axis=2)
    C_BQNS = jnp.repeat(C_BQGS, rep, axis=2)
    cum_BNQ = jnp.cumsum(jnp.swapaxes(dt_BQN * A32, 1, 2), axis=-1)  # <= 0, decreasing
    u_BQNH = x_BQNH * dt_BQN[..., None]
    # 1. intra-chunk: decay from s to l within one segment, causal.
    same_BQQ = (seg_BQ[:, :, None] == seg_BQ[:, None, :]) & causal_QQ
    diff_BNQQ = jnp.where(
      same_BQQ[:, None], cum_BNQ[..., :, None] - cum_BNQ[..., None, :], -jnp.inf
    )
    # Positions l (output) and m (input) of the chunk; s the state.
    scores_BNQQ = jnp.einsum("blns,bmns->bnlm", C_BQNS, B_BQNS) * jnp.exp(diff_BNQQ)
    y_BQNH = jnp.einsum("bnlm,bmnh->blnh", scores_BNQQ, u_BQNH)
    # 4. the incoming state, decayed to each position of its own segment.
    into_BQ = seg_BQ == seg_in_B[:, None]
    into_BNQ = jnp.where(into_BQ[:, None], jnp.exp(cum_BNQ), 0.0)
    y_BQNH = (
      y_BQNH
      + jnp.einsum("blns,bnhs->blnh", C_BQNS, h_BNHS) * jnp.swapaxes(into_BNQ, 1, 2)[..., None]
    )
    # 2. the chunk's own state: inputs of the last position's segment, decayed to the end.
    last_BN1 = cum_BNQ[..., -1:]
    out_of_BQ = seg_BQ == seg_BQ[:, -1:]
    out_of_BNQ = jnp.where(out_of_BQ[:, None], jnp.exp(last_BN1 - cum_BNQ), 0.0)
    own_BNHS = jnp.einsum("bnq,bqnh,bqns->bnhs", out_of_BNQ, u_BQNH, B_BQNS)
    # 3. the carried state goes through when no segment starts inside the chunk.
    across_BN = jnp.where(into_BQ[:, -1:], jnp.exp(last_BN1[..., 0]), 0.0)
    h_next = h_BNHS * across_BN[..., None, None] + own_BNHS
    return h_next, y_BQNH

  h_end, y = jax.lax.scan(chunk, h0, (*chunks, seg_chunks, seg_in_ZB))
  y_BTNH = _unchunked(y, t)
  if D is not None:
    y_BTNH = y_BTNH + x.astype(jnp.float32) * D.astype(jnp.float32)[:, None]
  return (y_BTNH, h_end) if return_state else y_BTNH


def ssd_step(
  state: jax.Array,
  x: jax.Array,
  dt: jax.Array,
  A: jax.Array,
  B: jax.Array,
  C: jax.Array,
  D: jax.Array | None = None,
  *,
  time_step_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[jax.Array, jax.Array]:
  """One position of ``ssd``: ``state [B, N, H, S]``, ``x [B, N, H]``, ``dt [B, N]``, ``B``/``C``
  ``[B, G, S]``; returns ``(y [B, N, H] float32, the new state)``."""
  n, g = x.shape[1], B.shape[1]
  dt32 = _clamped_dt(dt, time_step_limit)
  B_BNS = jnp.repeat(B.astype(jnp.float32), n // g, axis=1)
  C_BNS = jnp.repeat(C.astype(jnp.float32), n // g, axis=1)
  x32 = x.astype(jnp.float32)
  decay_BN = jnp.exp(dt32 * A.astype(jnp.float32))
  h = (
    state.astype(jnp.float32) * decay_BN[..., None, None]
    + (x32 * dt32[..., None])[..., None] * B_BNS[:, :, None, :]
  )
  y = jnp.einsum("bnhs,bns->bnh", h, C_BNS)
  if D is not None:
    y = y + x32 * D.astype(jnp.float32)[:, None]
  return y, h


def gated_rms_norm(
  y: jax.Array, z: jax.Array, scale: jax.Array, *, groups: int = 1, eps: float = 1e-5
) -> jax.Array:
  """Mamba-2's gated RMS group norm: ``y * silu(z)`` normalised over each of ``groups`` equal
  slices of its last axis, times ``scale``.

  Args:
    y: ``[..., E]`` the scan's output; z: ``[..., E]`` the gate.
    scale: ``[E]``.
    groups: G; ``E % G == 0``.

  Returns:
    ``[..., E]`` float32.
  """
  e = y.shape[-1]
  if e % groups:
    raise ValueError(f"groups={groups} does not divide the width {e}")
  gated = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
  grouped = rms_norm(gated.reshape(*gated.shape[:-1], groups, e // groups), None, eps)
  return grouped.reshape(gated.shape) * scale.astype(jnp.float32)
