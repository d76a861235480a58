"""Tests for ``transformer_jax.ops.masks`` against explicit NumPy loops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.ops import (
  and_masks,
  causal_mask,
  padding_mask,
  segment_mask,
  segment_runs,
  sliding_window_mask,
)


def causal_ref(t, s):
  m = np.zeros((t, s), bool)
  for i in range(t):
    for j in range(s):
      m[i, j] = j <= s - t + i  # query i sits at key position s - t + i
  return m


def window_ref(t, s, w):
  m = np.zeros((t, s), bool)
  for i in range(t):
    for j in range(s):
      m[i, j] = abs((s - t + i) - j) < w
  return m


@pytest.mark.parametrize("t,s", [(1, 1), (4, 4), (3, 7), (1, 5)])
def test_causal_mask_blocks_future(t, s):
  m = causal_mask(t, s)
  assert m.shape == (1, 1, t, s)
  assert m.dtype == jnp.bool_
  np.testing.assert_array_equal(m[0, 0], causal_ref(t, s))


def test_causal_mask_default_key_length_is_square():
  np.testing.assert_array_equal(causal_mask(5)[0, 0], np.tril(np.ones((5, 5), bool)))


def test_causal_mask_last_query_sees_all_keys_when_t_lt_s():
  m = np.asarray(causal_mask(3, 8))[0, 0]
  assert m[-1].all()
  assert m[0].sum() == 6  # query 0 sits at key position 5


@pytest.mark.parametrize("t,s,w", [(6, 6, 1), (6, 6, 3), (4, 9, 2), (5, 5, 10)])
def test_sliding_window_mask_matches_loop(t, s, w):
  m = sliding_window_mask(t, s, w)
  assert m.shape == (1, 1, t, s)
  assert m.dtype == jnp.bool_
  np.testing.assert_array_equal(m[0, 0], window_ref(t, s, w))


def test_sliding_window_mask_default_key_length_is_square():
  np.testing.assert_array_equal(sliding_window_mask(5, None, 2)[0, 0], window_ref(5, 5, 2))


@pytest.mark.parametrize("window", [0, -1])
def test_sliding_window_mask_raises_when_window_below_one(window):
  with pytest.raises(ValueError, match="window"):
    sliding_window_mask(4, 4, window)


@pytest.mark.parametrize("t,s,w", [(8, 8, 3), (4, 10, 3), (6, 6, 1)])
def test_causal_sliding_window_sees_last_w_keys(t, s, w):
  m = np.asarray(and_masks(causal_mask(t, s), sliding_window_mask(t, s, w)))[0, 0]
  for i in range(t):
    p = s - t + i  # key position of query i
    want = np.zeros(s, bool)
    want[max(0, p - w + 1) : p + 1] = True  # keys i-w+1 .. i
    np.testing.assert_array_equal(m[i], want, err_msg=f"query {i}")


def test_padding_mask_without_query_valid():
  key_valid = np.array([[1, 1, 0, 0, 1], [1, 0, 1, 1, 1]])
  m = padding_mask(jnp.asarray(key_valid))
  assert m.shape == (2, 1, 1, 5)
  assert m.dtype == jnp.bool_
  m = np.asarray(m)
  for b in range(2):
    for j in range(5):
      assert bool(m[b, 0, 0, j]) == bool(key_valid[b, j])


def test_padding_mask_with_query_valid_blocks_padding_queries():
  rng = np.random.default_rng(0)
  key_valid = rng.random((3, 6)) < 0.6
  query_valid = rng.random((3, 4)) < 0.6
  m = np.asarray(padding_mask(jnp.asarray(key_valid), jnp.asarray(query_valid)))
  assert m.shape == (3, 1, 4, 6)
  for b in range(3):
    for i in range(4):
      for j in range(6):
        assert m[b, 0, i, j] == (key_valid[b, j] and query_valid[b, i])


def test_padding_mask_accepts_bool_and_int():
  valid = np.array([[True, False, True]])
  np.testing.assert_array_equal(
    padding_mask(jnp.asarray(valid)), padding_mask(jnp.asarray(valid.astype(np.int32)))
  )


def test_segment_mask_matches_loop():
  seg = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 7, 7]])
  m = np.asarray(segment_mask(jnp.asarray(seg)))
  assert m.shape == (2, 1, 6, 6)
  for b in range(2):
    for i in range(6):
      for j in range(6):
        assert m[b, 0, i, j] == (seg[b, i] == seg[b, j])


def test_segment_mask_separate_query_and_key_ids():
  q_seg = np.array([[1, 2, 2]])
  kv_seg = np.array([[1, 1, 2, 2, 3]])
  m = np.asarray(segment_mask(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  assert m.shape == (1, 1, 3, 5)
  want = q_seg[0][:, None] == kv_seg[0][None, :]
  np.testing.assert_array_equal(m[0, 0], want)


def test_and_masks_skips_none():
  a = causal_mask(4)
  assert and_masks() is None
  assert and_masks(None, None) is None
  np.testing.assert_array_equal(and_masks(None, a, None), a)


def test_and_masks_broadcasts_and_matches_loop():
  t = s = 5
  key_valid = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
  seg = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])
  m = np.asarray(
    and_masks(
      causal_mask(t, s), padding_mask(jnp.asarray(key_valid)), segment_mask(jnp.asarray(seg))
    )
  )
  assert m.shape == (2, 1, t, s)
  for b in range(2):
    for i in range(t):
      for j in range(s):
        assert m[b, 0, i, j] == (j <= i and key_valid[b, j] and seg[b, i] == seg[b, j])


def test_masks_work_under_jit():
  @jax.jit
  def build(key_valid, seg):
    return and_masks(
      causal_mask(4, 6),
      sliding_window_mask(4, 6, 2),
      padding_mask(key_valid),
      segment_mask(seg[:, 2:], seg),
    )

  key_valid = jnp.asarray([[1, 1, 1, 1, 1, 0]])
  seg = jnp.asarray([[0, 1, 1, 1, 1, 1]])
  got = np.asarray(build(key_valid, seg))[0, 0]
  want = window_ref(4, 6, 2) & causal_ref(4, 6) & (np.asarray(key_valid)[0] == 1)[None, :]
  want &= np.asarray(seg)[0, 2:, None] == np.asarray(seg)[0][None, :]
  np.testing.assert_array_equal(got, want)


def test_segment_and_padding_masks_vmap_over_extra_axis_equals_loop():
  rng = np.random.default_rng(1)
  seg = jnp.asarray(rng.integers(0, 3, (3, 2, 5)))
  valid = jnp.asarray(rng.random((3, 2, 5)) < 0.7)

  def f(s_, v_):
    return and_masks(segment_mask(s_), padding_mask(v_, v_))

  batched = jax.vmap(f)(seg, valid)
  assert batched.shape == (3, 2, 1, 5, 5)
  for e in range(3):
    np.testing.assert_array_equal(batched[e], f(seg[e], valid[e]))


def test_masks_work_under_strict_rank_promotion():
  with jax.numpy_rank_promotion("raise"):
    m = jax.jit(
      lambda: and_masks(
        causal_mask(4, 6),
        sliding_window_mask(4, 6, 3),
        padding_mask(jnp.ones((2, 6)), jnp.ones((2, 4))),
        segment_mask(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 6), jnp.int32)),
      )
    )()
  np.testing.assert_array_equal(np.asarray(m)[1, 0], causal_ref(4, 6) & window_ref(4, 6, 3))


def _runs_by_loop(ids, max_runs):
  """Each row's runs of equal ids by a loop, and whether every row has at most ``max_runs`` runs
  and no id in two of them."""
  lengths, starts, fits = [], [], True
  for row in np.asarray(ids):
    row_starts = [i for i in range(len(row)) if i == 0 or row[i] != row[i - 1]]
    ends = row_starts[1:] + [len(row)]
    run_ids = [row[i] for i in row_starts]
    fits &= len(row_starts) <= max_runs and len(set(run_ids)) == len(run_ids)
    pad = max(max_runs - len(row_starts), 0)
    lengths.append(([e - s for s, e in zip(row_starts, ends)] + [-1] * pad)[:max_runs])
    starts.append((row_starts + [-1] * pad)[:max_runs] + [-1])
  return np.array(lengths), np.array(starts), fits


RUN_CASES = {
  "one-document": [[1] * 12, [1] * 12],
  "packed-then-padding": [[1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0], [1] * 5 + [2] * 7],
  "one-token-runs": [[1, 2, 3, 4, 4, 4, 4, 4, 4, 4, 4, 4], [7] * 11 + [8]],
  "too-many-runs": [[1, 2, 3, 4, 5, 6, 6, 6, 6, 6, 6, 6], [1] * 12],
  "id-comes-back": [[1, 1, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 12],
}


@pytest.mark.parametrize("case", list(RUN_CASES))
def test_segment_runs_match_a_loop(case):
  ids = np.array(RUN_CASES[case], np.int32)
  lengths, starts, fits = jax.jit(segment_runs, static_argnums=1)(jnp.asarray(ids), 5)
  want_lengths, want_starts, want_fits = _runs_by_loop(ids, 5)
  assert bool(fits) == want_fits
  if want_fits:
    np.testing.assert_array_equal(lengths, want_lengths)
    np.testing.assert_array_equal(starts, want_starts)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_attention_within_runs_equals_the_segment_mask(causal):
  # The contract a packed-sequence kernel relies on: attention computed run by run, each run a
  # sequence of its own, is attention under segment_mask (float64, by loops).
  ids = np.array(RUN_CASES["packed-then-padding"], np.int32)
  b, t = ids.shape
  r = np.random.default_rng(0)
  q, k, v = (r.standard_normal((b, t, 3)) for _ in range(3))
  lengths, starts, fits = segment_runs(jnp.asarray(ids), 4)
  assert bool(fits)
  mask = np.asarray(segment_mask(jnp.asarray(ids)))[:, 0]
  if causal:
    mask = mask & np.tril(np.ones((t, t), bool))

  def attend(qi, ks, vs):
    w = np.exp(ks @ qi - np.max(ks @ qi))
    return (w / w.sum()) @ vs

  for bi in range(b):
    for length, start in zip(np.asarray(lengths[bi]), np.asarray(starts[bi])):
      if length < 0:
        continue
      for i in range(start, start + length):
        stop = i + 1 if causal else start + length
        got = attend(q[bi, i], k[bi, start:stop], v[bi, start:stop])
        want = attend(q[bi, i], k[bi][mask[bi, i]], v[bi][mask[bi, i]])
        np.testing.assert_allclose(got, want, rtol=1e-12)
    assert np.asarray(lengths[bi])[np.asarray(lengths[bi]) > 0].sum() == t


def test_segment_runs_reject_bad_arguments():
  with pytest.raises(ValueError, match="max_runs=0 must be >= 1"):
    segment_runs(jnp.ones((2, 4), jnp.int32), 0)
  with pytest.raises(ValueError, match=r"segment_ids must be \[B, T\]; got shape \(4,\)"):
    segment_runs(jnp.ones((4,), jnp.int32), 2)
