"""Tests for ``transformer_jax.ops.moe`` against float64 NumPy references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.ops import moe

N, E = 37, 8


def logits(seed=0, n=N, e=E, scale=2.0):
  return np.random.default_rng(seed).standard_normal((n, e)) * scale


def topk_ref(scores, k):
  """Indices of the k largest per row, best first (ties: lower index first, as lax.top_k)."""
  return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def softmax64(x):
  x = np.asarray(x, np.float64)
  z = np.exp(x - x.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_topk_matches_reference(normalize):
  x = logits(1)
  r = moe.route(jnp.asarray(x, jnp.float32), top_k=2, normalize=normalize)
  p = softmax64(x)
  idx = topk_ref(p, 2)
  w = np.take_along_axis(p, idx, -1)
  if normalize:
    w = w / w.sum(-1, keepdims=True)
  np.testing.assert_array_equal(np.asarray(r.experts_Nk), idx)
  np.testing.assert_allclose(np.asarray(r.weights_Nk), w, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(r.probs_NE), p, rtol=1e-6, atol=1e-7)


def test_sigmoid_bias_selects_but_does_not_weigh():
  x = logits(2)
  bias = np.random.default_rng(3).standard_normal(E) * 2.0
  r = moe.route(
    jnp.asarray(x, jnp.float32),
    top_k=3,
    scoring="sigmoid",
    bias_E=jnp.asarray(bias),
    normalize=False,
    scale=2.5,
  )
  s = 1.0 / (1.0 + np.exp(-x))
  idx = topk_ref(s + bias, 3)
  np.testing.assert_array_equal(np.asarray(r.experts_Nk), idx)
  np.testing.assert_allclose(
    np.asarray(r.weights_Nk), 2.5 * np.take_along_axis(s, idx, -1), rtol=1e-6
  )
  # The bias changed the choice of some tokens (else this test would not test it).
  assert (topk_ref(s, 3) != idx).any()


def test_group_limited_topk_matches_reference():
  x, g, kg, k = logits(4, e=16), 4, 2, 4
  bias = np.random.default_rng(5).standard_normal(16) * 0.5
  r = moe.route(
    jnp.asarray(x, jnp.float32),
    top_k=k,
    scoring="sigmoid",
    bias_E=jnp.asarray(bias),
    num_groups=g,
    topk_groups=kg,
  )
  s = 1.0 / (1.0 + np.exp(-x))
  choose = (s + bias).reshape(N, g, 16 // g)
  group_score = np.sort(choose, -1)[..., -2:].sum(-1)  # DeepSeek-V3: sum of the two best
  keep = topk_ref(group_score, kg)
  masked = np.full_like(choose, -np.inf)
  for n in range(N):
    masked[n, keep[n]] = choose[n, keep[n]]
  idx = topk_ref(masked.reshape(N, 16), k)
  w = np.take_along_axis(s, idx, -1)
  np.testing.assert_array_equal(np.asarray(r.experts_Nk), idx)
  np.testing.assert_allclose(np.asarray(r.weights_Nk), w / w.sum(-1, keepdims=True), rtol=1e-6)
  assert (np.asarray(r.experts_Nk) // (16 // g) == keep[:, :1]).any()  # chose within groups
  assert (topk_ref(s + bias, k) != idx).any()  # the group limit changed some choices


def test_route_refuses_bad_options_by_name():
  x = jnp.zeros((3, 8))
  with pytest.raises(ValueError, match="top_k=9"):
    moe.route(x, top_k=9)
  with pytest.raises(ValueError, match="num_groups=3"):
    moe.route(x, top_k=2, scoring="sigmoid", num_groups=3)
  with pytest.raises(ValueError, match="topk_groups=5"):
    moe.route(x, top_k=2, scoring="sigmoid", num_groups=4, topk_groups=5)
  with pytest.raises(ValueError, match="scoring='tanh'"):
    moe.route(x, top_k=2, scoring="tanh")
  with pytest.raises(ValueError, match="sigmoid"):
    moe.route(x, top_k=2, bias_E=jnp.zeros(8))


def lb_ref(x, k, mask=None):
  p = softmax64(x)
  idx = topk_ref(p, k)
  w = np.ones(len(x)) if mask is None else mask.astype(np.float64)
  chosen = np.zeros_like(p)
  for j in range(k):
    chosen[np.arange(len(x)), idx[:, j]] = 1.0
  f = (chosen * w[:, None]).sum(0) / w.sum()
  pe = (p * w[:, None]).sum(0) / w.sum()
  return x.shape[1] * (f * pe).sum(), (chosen * w[:, None]).sum(0)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_and_counts_match_reference(masked):
  x = logits(6)
  mask = np.random.default_rng(7).random(N) < 0.6 if masked else None
  r = moe.route(jnp.asarray(x, jnp.float32), top_k=2)
  m = None if mask is None else jnp.asarray(mask)
  loss = moe.load_balancing_loss(r.probs_NE, r.experts_Nk, mask_N=m)
  ref, counts = lb_ref(x, 2, mask)
  np.testing.assert_allclose(float(loss), ref, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(moe.tokens_per_expert(r.experts_Nk, E, mask_N=m)), counts)


def test_load_balancing_loss_is_top_k_when_uniform():
  # Equal logits: P_e = 1/E; each expert chosen by the same share when choices rotate.
  experts = jnp.asarray(np.arange(2 * E).reshape(E, 2) % E, jnp.int32)
  probs = jnp.full((E, E), 1.0 / E)
  np.testing.assert_allclose(float(moe.load_balancing_loss(probs, experts)), 2.0, rtol=1e-6)


def test_load_balancing_gradient_matches_reference():
  x = logits(8)
  r = moe.route(jnp.asarray(x, jnp.float32), top_k=2)
  _, counts = lb_ref(x, 2)
  g = jax.grad(lambda lg: moe.load_balancing_loss(jax.nn.softmax(lg), r.experts_Nk))(
    jnp.asarray(x, jnp.float32)
  )
  # d/dx of E * sum_e f_e * mean_n p_ne: f constant; softmax Jacobian per row.
  f = counts / N
  p = softmax64(x)
  v = E * f / N  # d loss / d p_ne
  ref = p * (v - (p * v).sum(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-8)


def test_router_z_loss_matches_reference():
  x = logits(9, scale=5.0)
  mask = np.random.default_rng(10).random(N) < 0.5
  lse = np.log(np.exp(x).sum(-1))
  ref = (lse**2 * mask).sum() / mask.sum()
  got = moe.router_z_loss(jnp.asarray(x, jnp.float32), mask_N=jnp.asarray(mask))
  np.testing.assert_allclose(float(got), ref, rtol=1e-6)


def test_sort_permute_unsort_round_trip():
  x = np.random.default_rng(11).standard_normal((N, 5))
  r = moe.route(jnp.asarray(logits(12), jnp.float32), top_k=3)
  srt = moe.sort_by_expert(r.experts_Nk, E)
  rows = moe.permute(jnp.asarray(x, jnp.float32), srt, 3)
  experts = np.asarray(r.experts_Nk).reshape(-1)[np.asarray(srt.order_M)]
  assert (np.diff(experts) >= 0).all()  # grouped by expert
  np.testing.assert_array_equal(np.asarray(srt.group_sizes_E), np.bincount(experts, minlength=E))
  back = moe.unsort(rows, srt, r.weights_Nk)
  np.testing.assert_allclose(
    np.asarray(back), x * np.asarray(r.weights_Nk).sum(-1, keepdims=True), rtol=1e-6
  )


def test_capacity_slots_first_come_first_served():
  experts = jnp.asarray([[0, 1], [0, 2], [0, 1], [1, 0]], jnp.int32)
  slot, kept = moe.capacity_slots(experts, 3, 2)
  # First choices in token order (0, 0, 0, 1), then second choices (1, 2, 1, 0).
  np.testing.assert_array_equal(np.asarray(slot), [[0, 1], [1, 0], [2, 2], [0, 2]])
  np.testing.assert_array_equal(np.asarray(kept), [[1, 1], [1, 1], [0, 0], [1, 0]])
  assert moe.capacity(4, 2, 3, 1.0) == 3
  with pytest.raises(ValueError, match="capacity_factor=0"):
    moe.capacity(4, 2, 3, 0)
