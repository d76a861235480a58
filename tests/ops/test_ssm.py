"""``ops.selective_scan`` (Mamba-1), ``ops.ssd`` (Mamba-2) and ``ops.causal_conv1d`` against a
float64 step-by-step recurrence written here (forward and gradients), their one-step forms against
their chunked forms, causality, lengths that are not a multiple of the chunk, ragged rows and
packed segments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import ops
from transformer_jax.ops import ssm


# --- float64 references: one position at a time -------------------------------------------------


def _recurrence(update, readout, h0, per_position, valid, seg):
  """Runs ``h = update(h, inputs_t)``, ``y_t = readout(h, inputs_t)`` over the positions
  (``lax.scan``, one position at a time). Padding (``valid`` False) keeps the state as it was;
  where ``seg`` changes the state is zeroed before the position."""
  t = per_position[0].shape[1]
  b = per_position[0].shape[0]
  valid = np.ones((b, t), bool) if valid is None else np.asarray(valid)
  seg = np.zeros((b, t), np.int32) if seg is None else np.asarray(seg)
  restart = np.concatenate([np.zeros((b, 1), bool), seg[:, 1:] != seg[:, :-1]], 1)

  def body(h, xs):
    keep, restart_t, *inputs = xs
    h = jnp.where(restart_t.reshape((b,) + (1,) * (h.ndim - 1)), 0.0, h)
    h = jnp.where(keep.reshape((b,) + (1,) * (h.ndim - 1)), update(h, *inputs), h)
    return h, readout(h, *inputs)

  xs = [jnp.swapaxes(jnp.asarray(a), 0, 1) for a in (valid, restart, *per_position)]
  h, ys = jax.lax.scan(body, h0, xs)
  return jnp.swapaxes(ys, 0, 1), h


def ref_selective(x, dt, A, B, C, D, h0=None, valid=None, seg=None):
  """Mamba-1, one position at a time: ``[B, T, E]`` outputs and the final state."""
  b, _, e = x.shape
  h0 = jnp.zeros((b, e, A.shape[1]), x.dtype) if h0 is None else h0

  def update(h, x_t, dt_t, B_t, C_t):
    return jnp.exp(dt_t[..., None] * A) * h + (dt_t * x_t)[..., None] * B_t[:, None, :]

  def readout(h, x_t, dt_t, B_t, C_t):
    return jnp.einsum("bes,bs->be", h, C_t) + D * x_t

  return _recurrence(update, readout, h0, (x, dt, B, C), valid, seg)


def ref_ssd(x, dt, A, B, C, D, h0=None, valid=None, seg=None, limit=(0.0, np.inf)):
  """Mamba-2, one position at a time (scalar decay per head, B/C shared by a group's heads)."""
  b, _, n, hd = x.shape
  g = B.shape[2]
  h0 = jnp.zeros((b, n, hd, B.shape[3]), x.dtype) if h0 is None else h0

  def update(h, x_t, dt_t, B_t, C_t):
    dt_t = jnp.clip(dt_t, *limit)
    B_t = jnp.repeat(B_t, n // g, axis=1)  # [B, N, S]
    return (
      jnp.exp(dt_t * A)[..., None, None] * h
      + (dt_t[..., None] * x_t)[..., None] * B_t[:, :, None, :]
    )

  def readout(h, x_t, dt_t, B_t, C_t):
    return jnp.einsum("bnhs,bns->bnh", h, jnp.repeat(C_t, n // g, axis=1)) + D[:, None] * x_t

  return _recurrence(update, readout, h0, (x, dt, B, C), valid, seg)


def ref_conv(x, w, bias, state=None, seg=None):
  b, t, c = x.shape
  width = w.shape[0]
  prev = jnp.zeros((b, width - 1, c), x.dtype) if state is None else state
  full = jnp.concatenate([prev, x], 1)
  segf = None if seg is None else jnp.concatenate([jnp.repeat(seg[:, :1], width - 1, 1), seg], 1)
  ys = []
  for i in range(t):
    acc = bias
    for j in range(width):
      term = full[:, i + j] * w[j]
      if segf is not None:
        term = jnp.where((segf[:, i + j] == seg[:, i])[:, None], term, 0.0)
      acc = acc + term
    ys.append(acc)
  return jnp.stack(ys, 1)


# --- inputs ------------------------------------------------------------------------------------


# The scans as compiled programs (one per shape and options), not each operation on its own.
SCAN = jax.jit(ops.selective_scan, static_argnames=("chunk_size", "return_state", "method"))
SSD = jax.jit(ops.ssd, static_argnames=("chunk_size", "time_step_limit", "return_state"))


def m1_inputs(seed, b=2, t=37, e=6, s=5):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  x, B, C = f(b, t, e), f(b, t, s), f(b, t, s)
  dt = np.log1p(np.exp(f(b, t, e) - 1.0)).astype(np.float32)  # softplus: ~0.1 .. 2
  A = -np.exp(0.5 * f(e, s)).astype(np.float32)
  D = f(e)
  return [x, dt, A, B, C, D]


def m2_inputs(seed, b=2, t=37, n=4, hd=3, g=2, s=5):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  x, B, C = f(b, t, n, hd), f(b, t, g, s), f(b, t, g, s)
  dt = np.log1p(np.exp(f(b, t, n) - 1.0)).astype(np.float32)
  A = -np.exp(0.5 * f(n)).astype(np.float32)
  D = f(n)
  return [x, dt, A, B, C, D]


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.abs(got - want).max() / np.abs(want).max()


def value_and_grads(fn, args, w):
  """``fn``'s outputs ``(y, h)`` and the gradients of ``sum(y * w) + sum(h)`` with respect to every
  argument, as one compiled program (op by op, JAX would compile each operation of the scan's
  forward and backward passes on its own)."""

  @jax.jit
  def both(args, w):
    def loss(*a):
      y, h = fn(*a)
      return jnp.sum(y * w) + jnp.sum(h)

    return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)

  return both(list(args), w)


def check_against_reference(op, ref, args, names, **extra):
  """``op`` (float32) and ``ref`` (float64) agree within 1e-5 in outputs, final states and the
  gradients of a weighted sum of both with respect to every argument."""
  rng = np.random.default_rng(99)
  w = rng.standard_normal(np.shape(args[0])).astype(np.float32)  # outputs have x's shape
  (y, h), grads = value_and_grads(op, args, w)
  with jax.enable_x64(True):
    args64 = [jnp.asarray(a, jnp.float64) for a in args]
    extra64 = {k: (jnp.asarray(v, jnp.float64) if k == "h0" else v) for k, v in extra.items()}
    (ry, rh), rgrads = value_and_grads(
      lambda *a: ref(*a, **extra64), args64, jnp.asarray(w, jnp.float64)
    )
    ry, rh, rgrads = np.asarray(ry), np.asarray(rh), [np.asarray(g) for g in rgrads]
  assert y.dtype == jnp.float32
  assert rel_err(y, ry) < 1e-5
  assert rel_err(h, rh) < 1e-5
  for name, got, want in zip(names, grads, rgrads):
    assert rel_err(got, want) < 1e-5, name


# --- Mamba-1 -----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
  "chunk,method",
  [(8, "associative"), (5, "associative"), (64, "associative"), (5, "sequential")],
  ids=["chunk8", "chunk5-ragged-tail", "one-chunk", "sequential"],
)
def test_selective_scan_matches_the_float64_recurrence(chunk, method):
  args = m1_inputs(0)

  def op(*a):
    return ops.selective_scan(*a, chunk_size=chunk, return_state=True, method=method)

  check_against_reference(op, ref_selective, args, ("x", "dt", "A", "B", "C", "D"))


def test_selective_scan_with_initial_state_padding_and_segments_matches_the_recurrence():
  x, dt, A, B, C, D = m1_inputs(1, t=29)
  h0 = np.random.default_rng(1).standard_normal((2, 6, 5)).astype(np.float32)
  valid = np.ones((2, 29), bool)
  valid[0, 20:] = False
  valid[1, :3] = False
  seg = np.zeros((2, 29), np.int32)
  seg[0, 9:] = 1
  seg[1, 4:17] = 3
  seg[1, 17:] = 4

  def op(*a):
    return ops.selective_scan(
      *a[:6],
      chunk_size=6,
      initial_state=a[6],
      return_state=True,
      valid=valid,
      segment_ids=seg,
      method="sequential",
    )

  ref = lambda *a: ref_selective(*a[:6], h0=a[6], valid=valid, seg=seg)  # noqa: E731
  check_against_reference(op, ref, [x, dt, A, B, C, D, h0], ("x", "dt", "A", "B", "C", "D", "h0"))


def test_selective_scan_step_equals_the_chunked_form():
  x, dt, A, B, C, D = m1_inputs(2, t=19)
  full, final = SCAN(x, dt, A, B, C, D, chunk_size=4, return_state=True)
  step = jax.jit(ops.selective_scan_step)
  h = jnp.zeros((2, 6, 5), jnp.float32)
  for i in range(19):
    y, h = step(h, x[:, i], dt[:, i], A, B[:, i], C[:, i], D)
    np.testing.assert_allclose(y, full[:, i], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h, final, rtol=1e-5, atol=1e-6)
  # A prefix's state carries the rest: two calls equal one.
  head, mid = SCAN(
    x[:, :11], dt[:, :11], A, B[:, :11], C[:, :11], D, chunk_size=3, return_state=True
  )
  tail = SCAN(x[:, 11:], dt[:, 11:], A, B[:, 11:], C[:, 11:], D, chunk_size=3, initial_state=mid)
  np.testing.assert_allclose(jnp.concatenate([head, tail], 1), full, rtol=1e-5, atol=1e-5)


# --- Mamba-2 -----------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [8, 5, 64], ids=["chunk8", "chunk5-ragged-tail", "one-chunk"])
def test_ssd_matches_the_float64_recurrence(chunk):
  args = m2_inputs(3)
  op = lambda *a: ops.ssd(*a, chunk_size=chunk, return_state=True)  # noqa: E731
  check_against_reference(op, ref_ssd, args, ("x", "dt", "A", "B", "C", "D"))


@pytest.mark.slow
def test_ssd_clamps_dt_to_the_time_step_limit():
  args = m2_inputs(4, t=21)
  limit = (0.2, 0.9)

  def op(*a):
    return ops.ssd(*a, chunk_size=8, time_step_limit=limit, return_state=True)

  check_against_reference(op, ref_ssd, args, ("x", "dt", "A", "B", "C", "D"), limit=limit)
  # The clamp matters: without it the outputs differ.
  assert rel_err(ops.ssd(*args, chunk_size=8), op(*args)[0]) > 1e-2


def test_ssd_with_initial_state_padding_and_segments_matches_the_recurrence():
  x, dt, A, B, C, D = m2_inputs(5, t=29)
  h0 = np.random.default_rng(5).standard_normal((2, 4, 3, 5)).astype(np.float32)
  valid = np.ones((2, 29), bool)
  valid[0, 22:] = False
  valid[1, :5] = False
  seg = np.zeros((2, 29), np.int32)
  seg[0, 7:] = 2
  seg[0, 8:] = 5  # a one-position segment
  seg[1, 12:] = 1

  def op(*a):
    return ops.ssd(
      *a[:6], chunk_size=6, initial_state=a[6], return_state=True, valid=valid, segment_ids=seg
    )

  ref = lambda *a: ref_ssd(*a[:6], h0=a[6], valid=valid, seg=seg)  # noqa: E731
  check_against_reference(op, ref, [x, dt, A, B, C, D, h0], ("x", "dt", "A", "B", "C", "D", "h0"))


@pytest.mark.slow
def test_ssd_step_equals_the_chunked_form():
  x, dt, A, B, C, D = m2_inputs(6, t=19)
  limit = (0.0, 1.5)
  full, final = SSD(x, dt, A, B, C, D, chunk_size=4, return_state=True, time_step_limit=limit)
  step = jax.jit(lambda *a: ops.ssd_step(*a, time_step_limit=limit))
  h = jnp.zeros((2, 4, 3, 5), jnp.float32)
  for i in range(19):
    y, h = step(h, x[:, i], dt[:, i], A, B[:, i], C[:, i], D)
    np.testing.assert_allclose(y, full[:, i], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h, final, rtol=1e-5, atol=1e-6)
  head, mid = SSD(
    x[:, :11],
    dt[:, :11],
    A,
    B[:, :11],
    C[:, :11],
    D,
    chunk_size=3,
    return_state=True,
    time_step_limit=limit,
  )
  tail = SSD(
    x[:, 11:],
    dt[:, 11:],
    A,
    B[:, 11:],
    C[:, 11:],
    D,
    chunk_size=3,
    initial_state=mid,
    time_step_limit=limit,
  )
  np.testing.assert_allclose(jnp.concatenate([head, tail], 1), full, rtol=1e-5, atol=1e-5)


# --- both scans: causality, ragged rows, memory --------------------------------------------------

# Compiled whole: op by op, JAX would compile each operation of a scan's call on its own.
SCANS = {
  "selective_scan": (
    m1_inputs,
    jax.jit(
      lambda *a, **k: ops.selective_scan(*a, chunk_size=4, **k), static_argnames="return_state"
    ),
  ),
  "ssd": (
    m2_inputs,
    jax.jit(lambda *a, **k: ops.ssd(*a, chunk_size=4, **k), static_argnames="return_state"),
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCANS)
def test_no_output_depends_on_a_later_position(name):
  make, op = SCANS[name]
  x, dt, A, B, C, D = make(7, b=1, t=12)
  jac = jax.jacrev(lambda x, dt, B, C: op(x, dt, A, B, C, D), argnums=(0, 1, 2, 3))(x, dt, B, C)
  out_nd = x.ndim  # the output has x's shape
  for d in jac:  # [1, T, ..., 1, T', ...]: output position t against input position t'
    d = np.abs(np.asarray(d))
    m = d.sum(axis=tuple(i for i in range(d.ndim) if i not in (1, out_nd + 1)))
    assert np.all(np.triu(m, 1) == 0)
    assert np.all(np.diag(m) > 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCANS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_never_changes_a_rows_result(name, side):
  """Rows of lengths 13, 6 and 9 in one padded batch (garbage in the padding) give each row's
  outputs and final state as that row alone."""
  make, op = SCANS[name]
  x, dt, A, B, C, D = make(8, b=3, t=13)
  lengths = [13, 6, 9]
  rng = np.random.default_rng(8)
  valid = np.zeros((3, 13), bool)
  for r, n in enumerate(lengths):
    if side == "right":
      valid[r, :n] = True
    else:
      valid[r, 13 - n :] = True

  def garbage(a):
    return np.where(
      valid.reshape(valid.shape + (1,) * (a.ndim - 2)),
      a,
      100 * rng.standard_normal(a.shape).astype(np.float32),
    )

  px, pdt, pB, pC = (garbage(a) for a in (x, dt, B, C))
  y, h = op(px, np.abs(pdt), A, pB, pC, D, valid=valid, return_state=True)
  for r in range(3):
    sel = valid[r]
    alone, h_alone = op(
      x[r : r + 1, sel],
      dt[r : r + 1, sel],
      A,
      B[r : r + 1, sel],
      C[r : r + 1, sel],
      D,
      return_state=True,
    )
    np.testing.assert_allclose(y[r, sel], alone[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h[r], h_alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", SCANS)
def test_packed_segments_equal_separate_sequences(name):
  make, op = SCANS[name]
  x, dt, A, B, C, D = make(9, b=1, t=15)
  seg = np.array([[0] * 6 + [1] * 9])
  y = op(x, dt, A, B, C, D, segment_ids=seg)
  first = op(x[:, :6], dt[:, :6], A, B[:, :6], C[:, :6], D)
  second = op(x[:, 6:], dt[:, 6:], A, B[:, 6:], C[:, 6:], D)
  np.testing.assert_allclose(y, jnp.concatenate([first, second], 1), rtol=1e-5, atol=1e-5)


def _temp_bytes(fn, *args):
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_the_whole_sequences_states_are_never_materialised():
  """The scratch memory of a scan and of its gradient grows with T by much less than a
  ``[B, T, E, S]`` float32 array would (O(T E) for the inputs and outputs, plus one state per
  chunk): the states inside a chunk are recomputed in the backward pass, not stored."""
  e, s = 32, 32

  def growth(make, op, **shape):
    sizes = []
    for t in (512, 1024):
      x, dt, A, B, C, D = make(10, b=1, t=t, **shape)
      loss = lambda x, dt, B, C: jnp.sum(op(x, dt, A, B, C, D))  # noqa: E731
      # The gradient's program holds the forward pass too.
      sizes.append(_temp_bytes(jax.grad(loss, argnums=(0, 1, 2, 3)), x, dt, B, C))
    return np.subtract(sizes[1], sizes[0])

  states_growth = 512 * e * s * 4  # what 512 more positions of [1, T, E, S] would add
  m1 = growth(m1_inputs, lambda *a: ops.selective_scan(*a, chunk_size=32), e=e, s=s)
  m2 = growth(m2_inputs, lambda *a: ops.ssd(*a, chunk_size=32), n=8, hd=e // 8, g=1, s=s)
  assert np.all(m1 < states_growth / 4) and np.all(m2 < states_growth / 4), (m1, m2)


# --- the convolution ---------------------------------------------------------------------------


def conv_inputs(seed, b=2, t=11, c=5, w=4):
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  return f(b, t, c), f(w, c), f(c), f(b, w - 1, c)


def test_causal_conv1d_matches_the_reference_and_torch_layout():
  x, w, bias, state = conv_inputs(11)
  seg = np.array([[0] * 4 + [1] * 7, [2] * 11])
  for kw, ref_kw in (
    (dict(), dict()),
    (dict(state_BWC=state), dict(state=state)),
    (dict(segment_ids=seg), dict(seg=seg)),
  ):
    got = ops.causal_conv1d(x, w, bias, **kw)
    with jax.enable_x64(True):
      want = np.asarray(
        ref_conv(
          *(jnp.asarray(a, jnp.float64) for a in (x, w, bias)),
          **{
            k: jnp.asarray(v, jnp.float64 if k == "state" else v.dtype) for k, v in ref_kw.items()
          },
        )
      )
    assert rel_err(got, want) < 1e-6
  # PyTorch's Conv1d(C, C, W, groups=C, padding=W - 1) cropped to T, weight [C, 1, W].
  torch = pytest.importorskip("torch")
  conv = torch.nn.functional.conv1d(
    torch.tensor(x).transpose(1, 2),
    torch.tensor(w.T[:, None, :]),
    torch.tensor(bias),
    padding=3,
    groups=5,
  )[..., :11].transpose(1, 2)
  np.testing.assert_allclose(ops.causal_conv1d(x, w, bias), conv.numpy(), rtol=1e-5, atol=1e-6)


def test_conv_state_rolls_to_each_rows_last_real_input():
  x, w, bias, state = conv_inputs(12, b=3, t=9)
  lengths = np.array([9, 2, 5])
  valid = np.arange(9)[None, :] < lengths[:, None]
  y, new = ops.causal_conv1d(x, w, bias, state_BWC=state, valid=valid, return_state=True)
  step = jax.jit(ops.causal_conv1d_step)
  for r, n in enumerate(lengths):
    s = state[r : r + 1]
    for i in range(n):
      out, s = step(s, x[r : r + 1, i], w, bias)
      np.testing.assert_allclose(out[0], y[r, i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s[0], new[r], rtol=0, atol=0)
  # A row with fewer real inputs than W - 1 keeps the older state entries.
  np.testing.assert_array_equal(new[1, 0], state[1, 2])


def test_errors_name_the_problem():
  x, dt, A, B, C, D = m1_inputs(13, t=8)
  with pytest.raises(ValueError, match="chunk_size=0"):
    ops.selective_scan(x, dt, A, B, C, D, chunk_size=0)
  with pytest.raises(ValueError, match=r"valid must be \[B, T\]"):
    ops.selective_scan(x, dt, A, B, C, D, valid=np.ones((2, 7), bool))
  with pytest.raises(ValueError, match="method='parallel' must be one of"):
    ops.selective_scan(x, dt, A, B, C, D, method="parallel")
  with pytest.raises(ValueError, match="selective_scan shapes"):
    ops.selective_scan(x, dt, A[:, :3], B, C, D)
  x2, dt2, A2, B2, C2, D2 = m2_inputs(13, t=8)
  with pytest.raises(ValueError, match="N % G == 0"):
    ops.ssd(x2, dt2, A2, B2[:, :, :1].repeat(3, 2), C2[:, :, :1].repeat(3, 2), D2)
  with pytest.raises(ValueError, match=r"time_step_limit=\(1.0, 0.5\)"):
    ops.ssd(x2, dt2, A2, B2, C2, D2, time_step_limit=(1.0, 0.5))
  with pytest.raises(ValueError, match=r"w must be \[W, C\]"):
    ops.causal_conv1d(x, np.zeros((4, 5), np.float32))
  assert isinstance(ssm.SSMState(1, 2), tuple)
