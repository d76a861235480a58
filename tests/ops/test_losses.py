"""Tests for ``transformer_jax.ops.losses`` against a float64 NumPy log-softmax reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from transformer_jax.ops import cross_entropy

V = 11


def cross_entropy_ref(logits, labels, mask=None, label_smoothing=0.0, z_loss=0.0):
  """Mean over unmasked tokens of -sum(target * log_softmax) + z * lse^2; -> (loss, count)."""
  logits = np.asarray(logits, np.float64)
  labels = np.asarray(labels)
  v = logits.shape[-1]
  m = logits.max(-1, keepdims=True)
  lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
  log_probs = logits - lse[..., None]
  onehot = np.eye(v)[labels]
  target = (1.0 - label_smoothing) * onehot + label_smoothing / v
  per_token = -(target * log_probs).sum(-1) + z_loss * lse**2
  w = np.ones(labels.shape) if mask is None else np.asarray(mask, np.float64)
  count = w.sum()
  loss = (per_token * w).sum() / count if count > 0 else 0.0
  return loss, count


def data(seed, shape=(3, 5), scale=3.0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(scale * rng.standard_normal(shape + (V,)), dtype)
  labels = jnp.asarray(rng.integers(0, V, shape), jnp.int32)
  mask = jnp.asarray(rng.random(shape) < 0.7)
  return logits, labels, mask


ce = jax.jit(cross_entropy, static_argnames=("label_smoothing", "z_loss"))


def test_cross_entropy_matches_reference_without_mask():
  logits, labels, _ = data(0)
  loss, count = ce(logits, labels)
  want, want_count = cross_entropy_ref(logits, labels)
  assert loss.shape == () and count.shape == ()
  assert loss.dtype == jnp.float32 and count.dtype == jnp.float32
  assert float(count) == want_count == 15
  np.testing.assert_allclose(loss, want, rtol=1e-6)


@pytest.mark.parametrize("mask_dtype", [bool, np.int32, np.float32])
def test_cross_entropy_matches_reference_with_mask(mask_dtype):
  logits, labels, mask = data(1)
  mask = jnp.asarray(np.asarray(mask).astype(mask_dtype))
  loss, count = ce(logits, labels, mask=mask)
  want, want_count = cross_entropy_ref(logits, labels, mask=mask)
  assert float(count) == want_count
  np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_cross_entropy_ignores_masked_labels_out_of_range():
  logits, labels, mask = data(2)
  labels_bad = jnp.where(mask, labels, -100)  # e.g. an ignore index at masked positions
  loss, _ = ce(logits, labels_bad, mask=mask)
  want, _ = cross_entropy_ref(logits, labels, mask=mask)
  np.testing.assert_allclose(loss, want, rtol=1e-6)


@pytest.mark.parametrize("eps", [0.1, 0.5])
def test_cross_entropy_label_smoothing_matches_reference(eps):
  logits, labels, mask = data(3)
  loss, _ = ce(logits, labels, mask=mask, label_smoothing=eps)
  want, _ = cross_entropy_ref(logits, labels, mask=mask, label_smoothing=eps)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  plain, _ = cross_entropy_ref(logits, labels, mask=mask)
  assert abs(float(loss) - plain) > 1e-3  # smoothing is applied


def test_cross_entropy_z_loss_matches_reference():
  logits, labels, mask = data(4)
  loss, _ = ce(logits, labels, mask=mask, z_loss=1e-2)
  want, _ = cross_entropy_ref(logits, labels, mask=mask, z_loss=1e-2)
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  plain, _ = cross_entropy_ref(logits, labels, mask=mask)
  assert abs(float(loss) - plain) > 1e-3


def test_cross_entropy_smoothing_and_z_loss_combine():
  logits, labels, mask = data(5)
  loss, _ = ce(logits, labels, mask=mask, label_smoothing=0.2, z_loss=1e-3)
  want, _ = cross_entropy_ref(logits, labels, mask=mask, label_smoothing=0.2, z_loss=1e-3)
  np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_cross_entropy_all_masked_gives_zero_loss_and_count():
  logits, labels, _ = data(6)
  loss, count = ce(
    logits, labels, mask=jnp.zeros(labels.shape, bool), label_smoothing=0.1, z_loss=1e-3
  )
  assert float(loss) == 0.0 and float(count) == 0.0
  g = jax.jit(
    jax.grad(lambda l_: cross_entropy(l_, labels, mask=jnp.zeros(labels.shape, bool))[0])
  )(logits)
  assert np.all(np.asarray(g) == 0.0)


def test_cross_entropy_masked_positions_get_no_gradient():
  logits, labels, mask = data(7)
  g = np.asarray(jax.jit(jax.grad(lambda l_: cross_entropy(l_, labels, mask=mask)[0]))(logits))
  assert np.all(g[~np.asarray(mask)] == 0.0)
  assert np.all(np.any(g[np.asarray(mask)] != 0.0, axis=-1))


def test_cross_entropy_gradient_is_softmax_minus_onehot():
  logits, labels, _ = data(8, shape=(4,))
  g = np.asarray(jax.jit(jax.grad(lambda l_: cross_entropy(l_, labels)[0]))(logits))
  x = np.asarray(logits, np.float64)
  p = np.exp(x - x.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  np.testing.assert_allclose(g, (p - np.eye(V)[np.asarray(labels)]) / 4, atol=1e-6)


def _grad_ref(logits, labels, mask, label_smoothing, z_loss):
  """Float64 d loss / d logits of ``cross_entropy_ref``, written out."""
  x = np.asarray(logits, np.float64)
  v = x.shape[-1]
  m = x.max(-1, keepdims=True)
  lse = np.log(np.exp(x - m).sum(-1, keepdims=True)) + m
  p = np.exp(x - lse)
  target = (1.0 - label_smoothing) * np.eye(v)[np.asarray(labels)] + label_smoothing / v
  w = np.asarray(mask, np.float64)[..., None]
  return (p - target + 2.0 * z_loss * lse * p) * w / w.sum()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cross_entropy_gradient_matches_float64_with_every_term(dtype):
  logits, labels, mask = data(13, dtype=dtype)
  g = jax.jit(
    jax.grad(lambda l_: cross_entropy(l_, labels, mask=mask, label_smoothing=0.1, z_loss=1e-3)[0])
  )(logits)
  assert g.dtype == dtype  # the gradient comes back in the logits' dtype
  want = _grad_ref(logits, labels, mask, 0.1, 1e-3)
  tol = 1e-6 if dtype == jnp.float32 else 2e-3  # bfloat16: the gradient itself is rounded
  np.testing.assert_allclose(np.asarray(g, np.float64), want, atol=tol)


def test_cross_entropy_gradient_has_no_scatter():
  # d logits is one elementwise expression of the logits (softmax minus a one-hot built from an
  # iota): nothing is scattered into a zero [..., V] array.
  logits, labels, mask = data(14)
  text = (
    jax.jit(jax.grad(lambda l_: cross_entropy(l_, labels, mask=mask)[0])).lower(logits).as_text()
  )
  assert "scatter" not in text


@pytest.mark.parametrize("shape", [(7,), (2, 3, 4)])
def test_cross_entropy_any_leading_shape(shape):
  logits, labels, mask = data(9, shape=shape)
  loss, count = ce(logits, labels, mask=mask)
  want, want_count = cross_entropy_ref(logits, labels, mask=mask)
  assert float(count) == want_count
  np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_cross_entropy_stable_for_large_logits():
  logits, labels, mask = data(10, scale=1e4)
  loss, _ = ce(logits, labels, mask=mask, z_loss=1e-8)
  want, _ = cross_entropy_ref(logits, labels, mask=mask, z_loss=1e-8)
  assert np.isfinite(float(loss))
  np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_cross_entropy_bf16_logits_upcast():
  logits, labels, mask = data(11, dtype=jnp.bfloat16)
  loss, _ = ce(logits, labels, mask=mask)
  assert loss.dtype == jnp.float32
  want, _ = cross_entropy_ref(logits, labels, mask=mask)  # from the same bf16-rounded logits
  np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_cross_entropy_raises_when_shapes_mismatch():
  logits, labels, _ = data(12)
  with pytest.raises(ValueError, match=r"\(3, 5, 11\).*\(3, 4\)"):
    cross_entropy(logits, labels[:, :4])
  with pytest.raises(ValueError, match="labels.shape"):
    cross_entropy(logits[..., 0], labels)


@pytest.mark.parametrize("eps", [-0.1, 1.0])
def test_cross_entropy_raises_when_label_smoothing_out_of_range(eps):
  logits, labels, _ = data(13)
  with pytest.raises(ValueError, match="label_smoothing"):
    cross_entropy(logits, labels, label_smoothing=eps)


def test_cross_entropy_eager_matches_jit():
  logits, labels, mask = data(14)
  eager = cross_entropy(logits, labels, mask=mask, label_smoothing=0.1, z_loss=1e-3)
  jitted = ce(logits, labels, mask=mask, label_smoothing=0.1, z_loss=1e-3)
  for e, j in zip(eager, jitted):
    np.testing.assert_allclose(e, j, rtol=1e-6)


def test_cross_entropy_vmap_over_extra_axis_equals_loop():
  logits, labels, mask = data(15, shape=(3, 2, 4))
  f = jax.jit(jax.vmap(lambda l_, y_, m_: cross_entropy(l_, y_, mask=m_)))
  losses, counts = f(logits, labels, mask)
  for e in range(3):
    want, want_count = cross_entropy_ref(logits[e], labels[e], mask=mask[e])
    assert float(counts[e]) == want_count
    np.testing.assert_allclose(losses[e], want, rtol=1e-6)


def test_cross_entropy_works_under_strict_rank_promotion():
  logits, labels, mask = data(16)
  with jax.numpy_rank_promotion("raise"):  # tracing (eval_shape) hits the check
    loss, _ = jax.eval_shape(
      lambda: cross_entropy(logits, labels, mask=mask, label_smoothing=0.1, z_loss=1e-3)
    )
  assert loss.shape == ()


def test_cross_entropy_gradients_match_numerical():
  with jax.enable_x64(True):
    logits, labels, mask = data(17, shape=(2, 3), dtype=jnp.float64)
    f = jax.jit(
      lambda l_: cross_entropy(l_, labels, mask=mask, label_smoothing=0.1, z_loss=1e-2)[0]
    )
    check_grads(f, (logits,), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3)
