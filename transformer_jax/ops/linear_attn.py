"""Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"), optionally with a
per-head decay (RetNet's gamma, Sun et al., 2023).

With the feature map ``phi(x) = elu(x) + 1`` (positive), causal attention becomes

    out_i = phi(q_i) S_i / (phi(q_i) . z_i),   S_i = g S_{i-1} + phi(k_i) v_i^T,
                                               z_i = g z_{i-1} + phi(k_i),

a recurrence with an O(1) state per head (``S [H, H]`` and ``z [H]``), g = 1 without decay.
Training uses the chunked-parallel form: within a chunk of ``C`` positions the quadratic masked
form, across chunks the carried state, so a sequence costs O(T C H + T H^2) instead of O(T^2 H).
Decoding runs the recurrence (``linear_attention_step``). Non-causal attention sums over all
positions (no decay).

Letters as in ``ops.attention``: B batch, T length, N query heads, K key/value heads, G = N // K,
H head dim (queries and keys), E value head dim, C chunk length.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Added to the normaliser: phi(q) . z > 0 always, but it can underflow for long decayed sums.
EPS = 1e-6


class LinearState(NamedTuple):
  """The recurrent state of one layer: ``s [B, N, H, E]`` (sum of ``phi(k) v^T``) and ``z [B, N,
  H]`` (sum of ``phi(k)``), float32, decayed by each head's gamma at every position."""

  s: jax.Array
  z: jax.Array


def feature_map(x: jax.Array) -> jax.Array:
  """``elu(x) + 1``, in float32: positive, so every normaliser is."""
  return jax.nn.elu(x.astype(jnp.float32)) + 1.0


def zero_state(
  batch: int, num_heads: int, head_dim: int, value_dim: int | None = None
) -> LinearState:
  """An empty ``LinearState`` (no position seen yet)."""
  e = head_dim if value_dim is None else value_dim
  return LinearState(
    jnp.zeros((batch, num_heads, head_dim, e), jnp.float32),
    jnp.zeros((batch, num_heads, head_dim), jnp.float32),
  )


def _decay_per_head(decay, n: int) -> jax.Array | None:
  if decay is None:
    return None
  if not isinstance(decay, jax.core.Tracer):
    values = np.asarray(decay, np.float64)
    if not np.all((values > 0.0) & (values <= 1.0)):  # NaN fails too
      raise ValueError(f"decay={decay!r} must lie in (0, 1] (one gamma, or one per query head)")
  gamma = jnp.asarray(decay, jnp.float32)
  if gamma.ndim == 0:
    gamma = jnp.full((n,), gamma)
  if gamma.shape != (n,):
    raise ValueError(
      f"decay must be a scalar or [N]=({n},) per query head; got shape {gamma.shape}"
    )
  return gamma


def _check(q, k, v, chunk_size, decay, causal, kv_valid, segment_ids):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
      f"q, k and v must be 4-D [B, T, N|K, H]; got q.shape={q.shape}, "
      f"k.shape={k.shape}, v.shape={v.shape}"
    )
  (b, t, n, h), (bk, tk, kh, hk) = q.shape, k.shape
  if (bk, tk, hk) != (b, t, h) or v.shape[:3] != k.shape[:3]:
    raise ValueError(
      f"q.shape={q.shape}, k.shape={k.shape} and v.shape={v.shape} must share B "
      "and T; q and k share H; k and v share K"
    )
  if n % kh:
    raise ValueError(f"query heads N={n} must be a multiple of key/value heads K={kh}")
  if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size={chunk_size!r} must be a positive integer")
  if decay is not None and not causal:
    raise ValueError("decay needs causal=True (a decayed sum runs forward in time)")
  if segment_ids is not None and not causal:
    raise ValueError(
      "segment_ids needs causal=True (a document's state starts at its first position)"
    )
  for name, x in (("kv_valid", kv_valid), ("segment_ids", segment_ids)):
    if x is not None and tuple(jnp.shape(x)) != (b, t):
      raise ValueError(f"{name} must be [B, T] = {(b, t)}; got shape {tuple(jnp.shape(x))}")


def linear_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  *,
  causal: bool = True,
  chunk_size: int = 64,
  decay=None,
  initial_state: LinearState | None = None,
  return_state: bool = False,
  kv_valid: jax.Array | None = None,
  segment_ids: jax.Array | None = None,
):
  """Linear attention with the ``elu + 1`` feature map and its normaliser.

  Args:
    q: ``[B, T, N, H]`` queries.
    k: ``[B, T, K, H]`` keys, ``N % K == 0`` (each key/value head serves G = N // K query heads).
    v: ``[B, T, K, E]`` values.
    causal: position ``i`` sees positions ``<= i`` (the recurrent form); False: all positions.
    chunk_size: positions per chunk of the causal chunked-parallel form (``T`` need not be a
      multiple: the last chunk is padded with positions that contribute nothing).
    decay: RetNet's gamma in ``(0, 1]``, a scalar or one per query head ``[N]``: the state is
      multiplied by it at every (valid) position. None: no decay. Causal only.
    initial_state: the state before the first position (``LinearState``, e.g. after a prompt);
      default empty. Causal only.
    return_state: also return the state after the last position.
    kv_valid: ``[B, T]`` bool, False for padding positions: they neither add to the sums nor
      decay them, so each row's outputs at its valid positions and its state are those of its
      valid positions alone, wherever the padding is (their own outputs are computed but
      meaningless).
    segment_ids: ``[B, T]`` ints, causal only: packed documents. A position whose id differs
      from the previous position's starts a document: the state is emptied before it, so each
      document sees only itself (a document is a run of equal ids; the first position continues
      ``initial_state``).

  Returns:
    ``[B, T, N, E]`` in q's dtype (with ``return_state``, ``(out, LinearState)``).

  Raises:
    ValueError: inconsistent shapes, a bad ``chunk_size`` or a decay outside (0, 1], or a decay,
      state or ``segment_ids`` with ``causal=False``.

  Decays are applied as ``gamma ** n`` for counts ``n >= 0`` of valid positions, never divided
  out again, so no factor exceeds 1: a tiny gamma underflows to 0 (the old state is forgotten),
  never to an overflow or 0/0.
  """
  _check(q, k, v, chunk_size, decay, causal, kv_valid, segment_ids)
  b, t, n, h = q.shape
  kh, e = k.shape[2], v.shape[3]
  g = n // kh
  gamma_N = _decay_per_head(decay, n)
  phi_q = feature_map(q).reshape(b, t, kh, g, h)
  phi_k, v32 = feature_map(k), v.astype(jnp.float32)
  if kv_valid is not None:
    phi_k = phi_k * jnp.asarray(kv_valid, jnp.float32)[:, :, None, None]
  if not causal:
    if initial_state is not None or return_state:
      raise ValueError("initial_state and return_state need causal=True")
    s_BKHE = jnp.einsum("btkh,btke->bkhe", phi_k, v32)
    z_BKH = jnp.sum(phi_k, axis=1)
    num = jnp.einsum("btkgh,bkhe->btkge", phi_q, s_BKHE)
    den = jnp.einsum("btkgh,bkh->btkg", phi_q, z_BKH)
    return (num / (den[..., None] + EPS)).reshape(b, t, n, e).astype(q.dtype)

  c = min(chunk_size, t)
  pad = (-t) % c
  # Per position: valid (adds and decays) and document start (empties the state before it).
  # Rows share one [1, T] pattern when neither is given.
  valid_BT = jnp.ones((1, t), bool) if kv_valid is None else jnp.asarray(kv_valid, bool)
  if segment_ids is None:
    start_BT = jnp.zeros((1, t), bool)
  else:
    seg = jnp.asarray(segment_ids)
    start_BT = jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  if pad:  # padded positions are invalid: phi(0) != 0, so their features are zeroed too
    phi_q = jnp.pad(phi_q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    phi_k = jnp.pad(phi_k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v32 = jnp.pad(v32, ((0, 0), (0, pad), (0, 0), (0, 0)))
    valid_BT = jnp.pad(valid_BT, ((0, 0), (0, pad)))
    start_BT = jnp.pad(start_BT, ((0, 0), (0, pad)))
  phi_k = phi_k * valid_BT.astype(jnp.float32)[:, :, None, None]
  nc = (t + pad) // c
  # Chunks lead, for the scan: [nC, B, C, ...] ([nC, 1, C] for patterns shared by the rows).
  q_chunks = phi_q.reshape(b, nc, c, kh, g, h).swapaxes(0, 1)
  k_chunks = phi_k.reshape(b, nc, c, kh, h).swapaxes(0, 1)
  v_chunks = v32.reshape(b, nc, c, kh, e).swapaxes(0, 1)
  valid_chunks = valid_BT.reshape(-1, nc, c).swapaxes(0, 1)
  start_chunks = start_BT.reshape(-1, nc, c).swapaxes(0, 1)

  pos = jnp.arange(c)
  causal_CC = pos[:, None] >= pos[None, :]
  log_g = None if gamma_N is None else jnp.log(gamma_N).reshape(kh, g)

  def factors(valid_BC, start_BC):
    """A chunk's decay-and-reset factors, all in [0, 1]: ``within [B, K, G, C, C]`` from key j
    to query i, ``into [B, C, K, G]`` from the carried state to query i, ``out_of [B, C, K, G]``
    from key j to the chunk's end, ``across [B, K, G]`` over the whole chunk."""
    count_BC = jnp.cumsum(valid_BC.astype(jnp.int32), axis=1)  # valid positions up to i
    doc_BC = jnp.cumsum(start_BC.astype(jnp.int32), axis=1)  # documents started up to i
    same_BCC = causal_CC[None] & (doc_BC[:, :, None] == doc_BC[:, None, :])
    fresh_BC = doc_BC == 0  # still the carried document
    last_same_BC = doc_BC == doc_BC[:, -1:]
    if log_g is None:
      within = jnp.broadcast_to(same_BCC[:, None, None], (same_BCC.shape[0], kh, g, c, c))
      into = jnp.broadcast_to(fresh_BC[:, :, None, None], (fresh_BC.shape[0], c, kh, g))
      out_of = jnp.broadcast_to(last_same_BC[:, :, None, None], into.shape)
      across = jnp.broadcast_to(fresh_BC[:, -1, None, None], (fresh_BC.shape[0], kh, g))
      return (
        within.astype(jnp.float32),
        into.astype(jnp.float32),
        out_of.astype(jnp.float32),
        across.astype(jnp.float32),
      )
    # gamma ** count with count >= 0 (masked entries get count 0 and then the mask's 0).
    gap_BCC = jnp.where(same_BCC, count_BC[:, :, None] - count_BC[:, None, :], 0)
    within = same_BCC[:, None, None] * jnp.exp(
      log_g[None, :, :, None, None] * gap_BCC[:, None, None].astype(jnp.float32)
    )
    into = fresh_BC[:, :, None, None] * jnp.exp(
      log_g[None, None] * count_BC[:, :, None, None].astype(jnp.float32)
    )
    to_end_BC = (count_BC[:, -1:] - count_BC).astype(jnp.float32)
    out_of = last_same_BC[:, :, None, None] * jnp.exp(
      log_g[None, None] * to_end_BC[..., None, None]
    )
    across = fresh_BC[:, -1, None, None] * jnp.exp(
      log_g[None] * count_BC[:, -1, None, None].astype(jnp.float32)
    )
    return within, into, out_of, across

  state = zero_state(b, n, h, e) if initial_state is None else initial_state
  s0 = state.s.reshape(b, kh, g, h, e)
  z0 = state.z.reshape(b, kh, g, h)

  def chunk(carry, xs):
    s_BKGHE, z_BKGH = carry
    q_c, k_c, v_c, valid_c, start_c = xs  # [B, C, K, G, H], [B, C, K, H], [B, C, K, E], ...
    within_BKGCC, into_BCKG, out_of_BCKG, across_BKG = factors(valid_c, start_c)
    scores = jnp.einsum("bikgh,bjkh->bkgij", q_c, k_c) * within_BKGCC
    num = jnp.einsum("bkgij,bjke->bikge", scores, v_c)
    den = jnp.sum(scores, axis=-1).transpose(0, 3, 1, 2)  # [B, C, K, G]
    num = num + jnp.einsum("bikgh,bkghe->bikge", q_c, s_BKGHE) * into_BCKG[..., None]
    den = den + jnp.einsum("bikgh,bkgh->bikg", q_c, z_BKGH) * into_BCKG
    weighted_k = k_c[:, :, :, None, :] * out_of_BCKG[..., None]  # [B, C, K, G, H]
    s_next = s_BKGHE * across_BKG[:, :, :, None, None] + jnp.einsum(
      "bjkgh,bjke->bkghe", weighted_k, v_c
    )
    z_next = z_BKGH * across_BKG[:, :, :, None] + jnp.sum(weighted_k, axis=1)
    return (s_next, z_next), num / (den[..., None] + EPS)

  (s_end, z_end), out = jax.lax.scan(
    chunk, (s0, z0), (q_chunks, k_chunks, v_chunks, valid_chunks, start_chunks)
  )
  out_BTNE = out.swapaxes(0, 1).reshape(b, nc * c, n, e)[:, :t].astype(q.dtype)
  if return_state:
    return out_BTNE, LinearState(s_end.reshape(b, n, h, e), z_end.reshape(b, n, h))
  return out_BTNE


def linear_attention_step(
  state: LinearState, q: jax.Array, k: jax.Array, v: jax.Array, *, decay=None
) -> tuple[jax.Array, LinearState]:
  """One decoding step of causal linear attention: the recurrence on one new position.

  Args:
    state: the ``LinearState`` after the previous positions.
    q: ``[B, 1, N, H]``; k ``[B, 1, K, H]``; v ``[B, 1, K, E]`` (the new position).
    decay: as in ``linear_attention``.

  Returns:
    ``(out [B, 1, N, E] in q's dtype, the state with the new position added)``.
  """
  b, one, n, h = q.shape
  if one != 1 or k.shape[1] != 1 or v.shape[1] != 1:
    raise ValueError(
      f"a step takes one position: q.shape={q.shape}, k.shape={k.shape}, v.shape={v.shape}"
    )
  g = n // k.shape[2]
  gamma_N = _decay_per_head(decay, n)
  phi_k = jnp.repeat(feature_map(k[:, 0]), g, axis=1)  # [B, N, H]
  v_NE = jnp.repeat(v[:, 0].astype(jnp.float32), g, axis=1)  # [B, N, E]
  s, z = state.s, state.z
  if gamma_N is not None:
    s, z = s * gamma_N[None, :, None, None], z * gamma_N[None, :, None]
  s = s + phi_k[..., :, None] * v_NE[..., None, :]
  z = z + phi_k
  phi_q = feature_map(q[:, 0])  # [B, N, H]
  num = jnp.einsum("bnh,bnhe->bne", phi_q, s)
  den = jnp.einsum("bnh,bnh->bn", phi_q, z)
  out = (num / (den[..., None] + EPS))[:, None].astype(q.dtype)
  return out, LinearState(s, z)
