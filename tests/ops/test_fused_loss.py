"""Tests for ``transformer_jax.ops.fused_loss`` against a float64 NumPy reference (loss, accuracy
and the analytic gradients), ``ops.cross_entropy`` on explicit logits, and the compiled program's
temporaries."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.ops import cross_entropy
from transformer_jax.ops.fused_loss import default_chunk_size, linear_cross_entropy

N, D, V = 19, 8, 23


def reference(x_ND, w_VD, labels_N, weights_N, eps=0.0, z=0.0):
  """float64 ``(loss_sum, correct_sum, dx, dW_VD)`` of the weighted summed cross-entropy."""
  x, w = np.asarray(x_ND, np.float64), np.asarray(w_VD, np.float64)
  labels, weights = np.asarray(labels_N), np.asarray(weights_N, np.float64)
  logits = x @ w.T
  v = logits.shape[-1]
  m = logits.max(-1)
  lse = m + np.log(np.exp(logits - m[:, None]).sum(-1))
  probs = np.exp(logits - lse[:, None])
  onehot = np.eye(v)[labels]
  label_logit = logits[np.arange(len(labels)), labels]
  nll = (1 - eps) * (lse - label_logit) + eps * (lse - logits.mean(-1)) + z * lse**2
  loss = (weights * nll).sum()
  correct = (weights * (label_logit >= m)).sum()
  dlogits = weights[:, None] * (
    (1 - eps) * (probs - onehot) + eps * (probs - 1.0 / v) + 2 * z * lse[:, None] * probs
  )
  return loss, correct, dlogits @ w, dlogits.T @ x


def data(seed, n=N, d=D, v=V):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
  w_VD = jnp.asarray(rng.standard_normal((v, d)) / np.sqrt(d) * 2.0, jnp.float32)
  labels = jnp.asarray(rng.integers(0, v, n), jnp.int32)
  # Zeros, ones and fractional weights.
  weights = jnp.asarray(rng.choice([0.0, 1.0, 1.0, 0.5], n), jnp.float32)
  return x, w_VD, labels, weights


def loss_and_grads(x, w, labels, weights, **kw):
  """``((loss_sum, correct_sum), (dx, dw))`` of ``linear_cross_entropy``, jitted."""

  def run(x, w):
    (loss, correct), vjp = jax.vjp(
      lambda x, w: linear_cross_entropy(x, w, labels, weights, **kw), x, w
    )
    return (loss, correct), vjp((jnp.ones((), jnp.float32), jnp.zeros((), jnp.float32)))

  return jax.jit(run)(x, w)


def assert_close(actual, expected, rtol=1e-5):
  expected = np.asarray(expected, np.float64)
  scale = max(float(np.max(np.abs(expected))), 1e-30)
  np.testing.assert_allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("w_layout", ["VD", "DV"])
# N=19 rows: one chunk; 19 chunks of 1; 3 chunks of 7 (2 padding rows); 64 capped to one chunk.
@pytest.mark.parametrize("chunk_size", [None, 1, 7, 64])
@pytest.mark.parametrize("eps,z", [(0.0, 0.0), (0.1, 1e-3)])
def test_matches_float64_reference(w_layout, chunk_size, eps, z):
  x, w_VD, labels, weights = data(0)
  w = w_VD if w_layout == "VD" else w_VD.T
  (loss, correct), (dx, dw) = loss_and_grads(
    x, w, labels, weights, w_layout=w_layout, label_smoothing=eps, z_loss=z, chunk_size=chunk_size
  )
  ref_loss, ref_correct, ref_dx, ref_dw_VD = reference(x, w_VD, labels, weights, eps, z)
  assert loss.dtype == jnp.float32 and loss.shape == () and correct.dtype == jnp.float32
  assert dx.dtype == x.dtype and dx.shape == x.shape and dw.dtype == w.dtype and dw.shape == w.shape
  assert_close(loss, ref_loss)
  assert float(correct) == ref_correct
  assert_close(dx, ref_dx)
  assert_close(dw, ref_dw_VD if w_layout == "VD" else ref_dw_VD.T)


def test_default_weights_and_cotangent_scaling():
  """No weights means all ones; the backward scales the saved gradients by the cotangent."""
  x, w, labels, _ = data(1)
  ref_loss, _, ref_dx, ref_dw = reference(x, w, labels, np.ones(N))

  def fn(x, w):
    return 0.25 * linear_cross_entropy(x, w, labels, chunk_size=5)[0]

  loss, (dx, dw) = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
  assert_close(loss, 0.25 * ref_loss)
  assert_close(dx, 0.25 * ref_dx)
  assert_close(dw, 0.25 * ref_dw)


@pytest.mark.parametrize("w_layout", ["VD", "DV"])
def test_equals_cross_entropy_on_explicit_logits(w_layout):
  x, w_VD, labels, weights = data(2)
  w = w_VD if w_layout == "VD" else w_VD.T
  kw = dict(label_smoothing=0.05, z_loss=1e-2)

  def explicit(x, w):
    logits = x @ (w.T if w_layout == "VD" else w)
    loss, count = cross_entropy(logits, labels, mask=weights, **kw)
    return loss * count

  def fused(x, w):
    return linear_cross_entropy(x, w, labels, weights, w_layout=w_layout, chunk_size=6, **kw)[0]

  want, want_grads = jax.value_and_grad(explicit, argnums=(0, 1))(x, w)
  got, got_grads = jax.value_and_grad(fused, argnums=(0, 1))(x, w)
  assert_close(got, want)
  for g, e in zip(got_grads, want_grads):
    assert_close(g, e)


def test_jit_matches_eager():
  x, w, labels, weights = data(3)

  def fn(x, w):
    return linear_cross_entropy(
      x, w, labels, weights, label_smoothing=0.1, z_loss=1e-3, chunk_size=4
    )

  def loss_fn(x, w):
    return fn(x, w)[0]

  eager, jitted = fn(x, w), jax.jit(fn)(x, w)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  eager_g = jax.grad(loss_fn, argnums=(0, 1))(x, w)
  jitted_g = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(x, w)
  for a, b in zip(eager_g, jitted_g):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("w_layout", ["VD", "DV"])
def test_bfloat16_compute_dtype(w_layout):
  """bfloat16 products are close to float32 ones; the gradients come back in the inputs' dtypes."""
  x, w_VD, labels, weights = data(4, n=37, d=32, v=50)
  w = w_VD if w_layout == "VD" else w_VD.T
  kw = dict(w_layout=w_layout, label_smoothing=0.1, z_loss=1e-3, chunk_size=8)
  (loss32, correct32), (dx32, dw32) = loss_and_grads(x, w, labels, weights, **kw)
  (loss16, _), (dx16, dw16) = loss_and_grads(x, w, labels, weights, dtype=jnp.bfloat16, **kw)
  assert dx16.dtype == jnp.float32 and dw16.dtype == jnp.float32
  assert_close(loss16, loss32, rtol=2e-2)
  assert_close(dx16, dx32, rtol=2e-2)
  assert_close(dw16, dw32, rtol=2e-2)
  # bfloat16 inputs: dx in bfloat16, W's gradient in W's float32.
  (loss_b, _), (dx_b, dw_b) = loss_and_grads(x.astype(jnp.bfloat16), w, labels, weights, **kw)
  assert dx_b.dtype == jnp.bfloat16 and dw_b.dtype == jnp.float32
  assert_close(loss_b, loss32, rtol=2e-2)
  assert_close(dx_b.astype(jnp.float32), dx32, rtol=2e-2)
  assert_close(dw_b, dw32, rtol=2e-2)


def test_out_of_range_labels_on_zero_weight_rows():
  x, w, labels, weights = data(5)
  bad = labels.at[0].set(-1).at[1].set(V + 3).at[2].set(2**30)
  zero = weights.at[:3].set(0.0)
  (loss, correct), (dx, dw) = loss_and_grads(x, w, bad, zero, chunk_size=4)
  ref_loss, ref_correct, ref_dx, ref_dw = reference(x, w, labels, zero)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
  assert_close(loss, ref_loss)
  assert float(correct) == ref_correct
  assert_close(dx, ref_dx)
  assert_close(dw, ref_dw)
  np.testing.assert_array_equal(dx[:3], 0.0)


def test_labels_and_weights_get_no_gradient():
  x, w, labels, weights = data(6)
  dweights = jax.grad(lambda wt: linear_cross_entropy(x, w, labels, wt, chunk_size=5)[0])(weights)
  np.testing.assert_array_equal(dweights, 0.0)


def test_empty_batch():
  x, w, _, _ = data(7, n=0)
  labels = jnp.zeros((0,), jnp.int32)

  def fn(x, w):
    return linear_cross_entropy(x, w, labels)[0]

  loss, (dx, dw) = jax.value_and_grad(fn, argnums=(0, 1))(x, w)
  assert float(loss) == 0.0 and dx.shape == (0, D)
  np.testing.assert_array_equal(dw, 0.0)


def _count_dots(jaxpr) -> int:
  """dot_general equations in a jaxpr and its sub-jaxprs (scan bodies, custom-VJP calls)."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          count += _count_dots(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          count += _count_dots(sub)
  return count


def test_plain_forward_computes_no_gradients():
  """A non-differentiated call runs the primal alone: one product per chunk (the logits); the
  differentiated one three (logits, dx, dW)."""
  x, w, labels, weights = data(8)

  def fn(x, w):
    return linear_cross_entropy(x, w, labels, weights, chunk_size=4)[0]

  assert _count_dots(jax.make_jaxpr(fn)(x, w).jaxpr) == 1
  grad_jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(x, w).jaxpr
  assert _count_dots(grad_jaxpr) == 3


def test_no_full_logits_buffer():
  """Compiled forward + backward at N=4096, V=32768, chunks of 512: its temporaries are far below
  the 512 MiB of float32 [N, V] logits."""
  n, d, v, chunk = 4096, 64, 32768, 512
  labels = jnp.zeros((n,), jnp.int32)

  def fn(x, w):
    return linear_cross_entropy(x, w, labels, chunk_size=chunk)[0]

  shapes = jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((v, d), jnp.float32)
  compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(*shapes).compile()
  stats = compiled.memory_analysis()
  if stats is None:
    pytest.skip("memory_analysis() returned None on this backend")
  full = 4 * n * v
  # One chunk's logits are 64 MiB; XLA keeps two or three such buffers (CPU: 72 MiB in all,
  # an H100: 136 MiB).
  assert stats.temp_size_in_bytes < 0.4 * full, (stats.temp_size_in_bytes, full)


def test_default_chunk_size():
  assert default_chunk_size(100_000, 32768) == 2048
  assert default_chunk_size(100, 32768) == 100
  assert default_chunk_size(10, 1 << 40) == 1
  assert default_chunk_size(0, 10) == 1


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(x_ND=jnp.zeros((2, 3, D))), "x_ND"),
    (dict(labels_N=jnp.zeros((N + 1,), jnp.int32)), "labels_N"),
    (dict(labels_N=jnp.zeros((N,), jnp.float32)), "labels_N"),
    (dict(weights_N=jnp.zeros((N, 1))), "weights_N"),
    (dict(w=jnp.zeros((V, D + 1))), "w.shape"),
    (dict(w=jnp.zeros((V,))), "w.shape"),
    (dict(w=jnp.zeros((V, D)), w_layout="DV"), "w.shape"),
    (dict(w_layout="vd"), "w_layout"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(label_smoothing=-0.1), "label_smoothing"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=2.5), "chunk_size"),
  ],
)
def test_errors(kwargs, match):
  x, w, labels, weights = data(9)
  args = dict(x_ND=x, w=w, labels_N=labels, weights_N=weights)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    linear_cross_entropy(**args)
