"""``ops.linear_attention`` against an O(T^2) masked reference in float64 (forward and gradients),
its recurrence against its chunked-parallel form, causality, and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from transformer_jax.ops import linear_attn as la


def reference(q, k, v, *, causal=True, decay=None):
  """``softmax``-free attention with ``phi = elu + 1``, written as the masked quadratic form:
  ``out_i = sum_j w_ij v_j / sum_j w_ij`` with ``w_ij = gamma^(i-j) phi(q_i) . phi(k_j)`` for
  ``j <= i`` (all ``j`` when not causal). Runs in whatever precision its inputs have."""
  b, t, n, h = q.shape
  g = n // k.shape[2]
  phi = lambda x: jax.nn.elu(x) + 1.0  # noqa: E731
  kk, vv = jnp.repeat(phi(k), g, axis=2), jnp.repeat(v, g, axis=2)
  w = jnp.einsum("bins,bjns->bnij", phi(q), kk)
  if causal:
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    if decay is None:
      mask = (j <= i).astype(w.dtype)[None, None]
    else:
      gamma = jnp.broadcast_to(jnp.asarray(decay, w.dtype), (n,))
      mask = jnp.where(j <= i, gamma[:, None, None] ** jnp.maximum(i - j, 0), 0.0)[None]
    w = w * mask
  num = jnp.einsum("bnij,bjne->bine", w, vv)
  return num / (jnp.sum(w, axis=-1).transpose(0, 2, 1)[..., None] + la.EPS)


def inputs(seed, b=2, t=37, n=4, kh=2, h=8, e=6):
  rng = np.random.default_rng(seed)
  shapes = ((b, t, n, h), (b, t, kh, h), (b, t, kh, e), (b, t, n, e))
  return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def value_and_grads(fn, q, k, v, w):
  """``fn``'s output and the gradients of ``sum(fn * w)``, as one compiled program (op by op,
  JAX would compile each operation of the forward and backward passes on its own)."""

  @jax.jit
  def both(q, k, v, w):
    def loss(q, k, v):
      return jnp.sum(fn(q, k, v) * w)

    return fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  return both(q, k, v, w)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / np.abs(want).max()


# ``la.linear_attention`` as one compiled program per shape and options, not each operation on
# its own; ``decay`` is traced, as an array (a list of per-head gammas is no static argument).
_LINEAR = jax.jit(la.linear_attention, static_argnames=("causal", "chunk_size", "return_state"))


def linear(q, k, v, *, decay=None, **kw):
  return _LINEAR(q, k, v, decay=None if decay is None else np.asarray(decay, np.float32), **kw)


CASES = [
  dict(causal=True, chunk_size=8),
  dict(causal=True, chunk_size=64),
  dict(causal=True, chunk_size=5, decay=0.9),
  dict(causal=True, chunk_size=8, decay=[0.99, 0.9, 0.8, 0.5]),
  dict(causal=False, chunk_size=8),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_float32_matches_the_float64_quadratic_reference(case):
  q, k, v, w = inputs(0)
  ref_kw = {key: case[key] for key in ("causal", "decay") if key in case}
  out, grads = value_and_grads(lambda *a: la.linear_attention(*a, **case), q, k, v, w)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, w)]
    if ref_kw.get("decay") is not None:
      ref_kw["decay"] = jnp.asarray(ref_kw["decay"], jnp.float64)
    ref, ref_grads = value_and_grads(lambda *a: reference(*a, **ref_kw), *args64)
    ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
  assert out.dtype == jnp.float32 and out.shape == (2, 37, 4, 6)
  assert rel_err(out, ref) < 1e-5
  for name, g, r in zip("qkv", grads, ref_grads):
    assert rel_err(g, r) < 1e-5, name


@pytest.mark.slow
@pytest.mark.parametrize("decay", [None, 0.95])
def test_recurrence_equals_the_parallel_form_token_for_token(decay):
  q, k, v, _ = inputs(1, t=20)
  parallel, final = linear(q, k, v, chunk_size=8, decay=decay, return_state=True)
  state = la.zero_state(2, 4, 8, 6)
  step = jax.jit(lambda s, q, k, v: la.linear_attention_step(s, q, k, v, decay=decay))
  for i in range(20):
    out, state = step(state, q[:, i : i + 1], k[:, i : i + 1], v[:, i : i + 1])
    np.testing.assert_allclose(
      np.asarray(out[:, 0]), np.asarray(parallel[:, i]), rtol=1e-5, atol=1e-6
    )
  np.testing.assert_allclose(np.asarray(state.s), np.asarray(final.s), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(state.z), np.asarray(final.z), rtol=1e-5, atol=1e-5)
  # A prefix's state carries the rest: two calls equal one.
  head, mid = linear(q[:, :13], k[:, :13], v[:, :13], chunk_size=4, decay=decay, return_state=True)
  tail = linear(q[:, 13:], k[:, 13:], v[:, 13:], chunk_size=4, decay=decay, initial_state=mid)
  np.testing.assert_allclose(
    np.asarray(jnp.concatenate([head, tail], 1)), np.asarray(parallel), rtol=1e-5, atol=1e-6
  )


@pytest.mark.slow
def test_no_position_sees_a_later_one():
  q, k, v, _ = inputs(2, b=1, t=16)
  jac = jax.jacrev(lambda k, v: linear(q, k, v, chunk_size=4, decay=0.9), argnums=(0, 1))(k, v)
  for d in jac:  # [B, T, N, E, B, S, K, *]: output t against input s
    d = np.abs(np.asarray(d)).sum(axis=(0, 2, 3, 4, 6, 7))
    assert np.all(np.triu(d, 1) == 0) and np.all(np.diag(d) > 0)


def test_the_state_does_not_grow_with_the_length():
  state = la.zero_state(3, 4, 8, 6)
  q, k, v, _ = inputs(3, b=3, t=1)
  for _ in range(3):
    _, state = la.linear_attention_step(state, q, k, v, decay=0.9)
  assert state.s.shape == (3, 4, 8, 6) and state.z.shape == (3, 4, 8)


def test_errors_name_the_problem():
  q, k, v, _ = inputs(4, t=8)
  with pytest.raises(ValueError, match="chunk_size=0"):
    la.linear_attention(q, k, v, chunk_size=0)
  with pytest.raises(ValueError, match="decay needs causal=True"):
    la.linear_attention(q, k, v, causal=False, decay=0.9)
  with pytest.raises(ValueError, match=r"decay must be a scalar or \[N\]=\(4,\)"):
    la.linear_attention(q, k, v, decay=[0.9, 0.8])
  with pytest.raises(ValueError, match="query heads N=4 must be a multiple of key/value heads K=3"):
    la.linear_attention(q, np.zeros((2, 8, 3, 8), np.float32), np.zeros((2, 8, 3, 6), np.float32))
  with pytest.raises(ValueError, match="a step takes one position"):
    la.linear_attention_step(la.zero_state(2, 4, 8, 6), q, k, v)


def masked_reference(q, k, v, *, decay=None, valid=None, segments=None):
  """The causal quadratic form in float64 NumPy with padding and documents: ``w_ij`` as in
  ``reference`` times ``[j valid]`` and ``[no document starts in (j, i]]``, the decay counted
  over the valid positions in ``(j, i]`` only. Returns ``(out [B, T, N, E], s [B, N, H, E],
  z [B, N, H])``, the state after the last position."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, n, _ = q.shape
  g = n // k.shape[2]
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))  # noqa: E731
  kk, vv = np.repeat(phi(k), g, axis=2), np.repeat(v, g, axis=2)
  valid = np.ones((b, t), bool) if valid is None else np.asarray(valid, bool)
  segments = np.zeros((b, t), np.int64) if segments is None else np.asarray(segments)
  starts = np.concatenate(
    [np.zeros((b, 1), int), np.cumsum(segments[:, 1:] != segments[:, :-1], axis=1)], axis=1
  )
  count = np.cumsum(valid, axis=1)  # valid up to i
  log_g = np.zeros(n) if decay is None else np.log(np.broadcast_to(np.asarray(decay, float), (n,)))
  # Query "T" is one past the end: the state.
  i = np.arange(t + 1)[:, None]
  j = np.arange(t)[None, :]
  count_i = np.concatenate([count, count[:, -1:]], axis=1)
  starts_i = np.concatenate([starts, starts[:, -1:]], axis=1)
  same = (starts_i[:, :, None] == starts[:, None, :]) & (j <= i)[None] & valid[:, None, :]
  gap = np.where(same, count_i[:, :, None] - count[:, None, :], 0)  # [B, T + 1, T]
  mask = same[:, None] * np.exp(log_g[None, :, None, None] * gap[:, None])  # [B, N, T + 1, T]
  w = np.einsum("bins,bjns->bnij", phi(q), kk) * mask[:, :, :t]
  out = np.einsum("bnij,bjne->bine", w, vv) / (w.sum(-1).transpose(0, 2, 1)[..., None] + la.EPS)
  s = np.einsum("bnj,bjnh,bjne->bnhe", mask[:, :, t], kk, vv)
  z = np.einsum("bnj,bjnh->bnh", mask[:, :, t], kk)
  return out, s, z


def _close(got, want, tol=1e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), "non-finite"
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("decay", [0.2, 0.1, 1e-3, [0.9, 0.2, 1e-3, 1.0]])
def test_the_padded_last_chunk_never_decays_the_state(decay):
  # T = 65 with chunks of 64: 63 padding positions after the last one.
  q, k, v, _ = inputs(5, b=1, t=65)
  out, state = linear(q, k, v, chunk_size=64, decay=decay, return_state=True)
  want, s, z = masked_reference(q, k, v, decay=decay)
  _close(out, want)
  _close(state.s, s)
  _close(state.z, z)


@pytest.mark.parametrize(
  "decay,t,lengths", [(0.5, 200, (2, 200)), ([1 - 2.0**-5] * 4, 3000, (3, 40))]
)
def test_padding_positions_neither_add_nor_decay(decay, t, lengths):
  """Ragged rows (right padding) and a left-padded row in ``t`` columns: each row's outputs at
  its real positions and its state are those of its real tokens alone (RetNet's slowest decay
  over 2997 padding positions is exp(95): the state must never be decayed and multiplied back)."""
  q, k, v, _ = inputs(6, b=3, t=t)
  valid = np.zeros((3, t), bool)
  valid[0, : lengths[0]] = valid[1, : lengths[1]] = True
  valid[2, t - lengths[0] :] = True
  out, state = linear(q, k, v, chunk_size=64, decay=decay, return_state=True, kv_valid=valid)
  for b in range(3):
    keep = valid[b]
    want, s, z = masked_reference(
      q[b : b + 1, keep], k[b : b + 1, keep], v[b : b + 1, keep], decay=decay
    )
    _close(np.asarray(out)[b, keep], want[0])
    _close(state.s[b], s[0])
    _close(state.z[b], z[0])


def test_a_long_sequence_with_a_tiny_decay_stays_finite():
  # Every decay over a chunk underflows to 0 (1e-3 ** 64); nothing divides by it.
  q, k, v, _ = inputs(7, b=1, t=1000)
  out, state = linear(q, k, v, chunk_size=64, decay=1e-3, return_state=True)
  want, s, z = masked_reference(q, k, v, decay=1e-3)
  _close(out, want)
  _close(state.s, s)
  _close(state.z, z)


@pytest.mark.parametrize("decay", [None, 0.8])
def test_packed_documents_reset_the_state(decay):
  """``segment_ids``: each document sees only itself, as if alone, across chunk boundaries."""
  q, k, v, _ = inputs(8, b=2, t=30)
  segments = np.zeros((2, 30), np.int32)
  segments[0, 7:], segments[0, 19:] = 1, 2  # documents of 7, 12 and 11 positions
  segments[1, 29:] = 5  # one of 29, then one of 1
  out, state = linear(q, k, v, chunk_size=8, decay=decay, return_state=True, segment_ids=segments)
  want, s, z = masked_reference(q, k, v, decay=decay, segments=segments)
  _close(out, want)
  _close(state.s, s)
  _close(state.z, z)
  alone = linear(q[:1, 7:19], k[:1, 7:19], v[:1, 7:19], chunk_size=8, decay=decay)
  _close(np.asarray(out)[0, 7:19], alone[0])


def test_padding_and_documents_together_match_the_reference():
  q, k, v, _ = inputs(9, b=2, t=21)
  valid = np.ones((2, 21), bool)
  valid[0, :4] = valid[1, 15:] = False  # left padding; right padding
  segments = np.where(np.arange(21) < 10, 1, 2)[None].repeat(2, 0)
  out, state = linear(
    q,
    k,
    v,
    chunk_size=4,
    decay=[0.9, 0.5, 0.99, 0.7],
    return_state=True,
    kv_valid=valid,
    segment_ids=segments,
  )
  want, s, z = masked_reference(
    q, k, v, decay=[0.9, 0.5, 0.99, 0.7], valid=valid, segments=segments
  )
  _close(np.asarray(out)[valid], want[valid])
  _close(state.s, s)
  _close(state.z, z)


def test_bad_decays_and_segments_are_refused_by_name():
  q, k, v, _ = inputs(10, t=8)
  for bad in (0.0, -0.5, 1.5, float("nan")):
    with pytest.raises(ValueError, match=rf"decay={bad} .*\(0, 1\]"):
      la.linear_attention(q, k, v, decay=bad)
  with pytest.raises(ValueError, match="segment_ids needs causal=True"):
    la.linear_attention(q, k, v, causal=False, segment_ids=np.zeros((2, 8), np.int32))
  with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\] = \(2, 8\)"):
    la.linear_attention(q, k, v, segment_ids=np.zeros((8,), np.int32))
