"""Tests for ``transformer_jax.ops.positions`` against independent float64 NumPy transcriptions."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

from transformer_jax.ops import (
  RopeScaling,
  alibi_bias,
  alibi_slopes,
  apply_rope,
  relative_position_bucket,
  relative_positions,
  rope_frequencies,
  sinusoidal_positions,
)

# --------------------------------------------------------------------------------------------------
# Sinusoidal.


def test_sinusoidal_positions_reference_values():
  # Required reference values: PE[1, :5] for a 64-wide table.
  np.testing.assert_allclose(
    np.asarray(sinusoidal_positions(16, 64))[1, :5],
    [0.841471, 0.540302, 0.681561, 0.731761, 0.533168],
    atol=5e-7,
  )


@pytest.mark.parametrize("num_positions,dim", [(50, 64), (7, 10), (1, 2)])
def test_sinusoidal_positions_match_formula(num_positions, dim):
  pe = sinusoidal_positions(num_positions, dim)
  assert pe.shape == (num_positions, dim)
  assert pe.dtype == jnp.float32
  want = np.zeros((num_positions, dim))
  for p in range(num_positions):
    for i in range(dim // 2):
      want[p, 2 * i] = math.sin(p / 10000 ** (2 * i / dim))
      want[p, 2 * i + 1] = math.cos(p / 10000 ** (2 * i / dim))
  np.testing.assert_allclose(pe, want, atol=1e-6)


def test_sinusoidal_positions_raise_when_dim_odd():
  with pytest.raises(ValueError, match="dim=7"):
    sinusoidal_positions(4, 7)


# --------------------------------------------------------------------------------------------------
# RoPE frequencies and scaling.


def inv_freq_ref(dim, theta):
  return np.array([1.0 / theta ** (2 * i / dim) for i in range(dim // 2)])


def llama3_ref(freqs, factor, low_freq_factor, high_freq_factor, old_context_len):
  """Transcription of ``apply_scaling`` in Meta's llama-models reference code (LLaMA 3.1)."""
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  new_freqs = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < high_freq_wavelen:
      new_freqs.append(freq)
    elif wavelen > low_freq_wavelen:
      new_freqs.append(freq / factor)
    else:
      smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
      new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(new_freqs)


@pytest.mark.parametrize("dim,theta", [(64, 10000.0), (128, 500000.0), (2, 10.0)])
def test_rope_frequencies_unscaled_match_formula(dim, theta):
  got = rope_frequencies(dim, theta=theta)
  assert got.shape == (dim // 2,)
  np.testing.assert_allclose(got, inv_freq_ref(dim, theta), rtol=1e-12)


def test_rope_frequencies_raise_when_dim_odd():
  with pytest.raises(ValueError, match="dim=9"):
    rope_frequencies(9)


def test_rope_frequencies_linear_divides_by_factor():
  got = rope_frequencies(64, theta=10000.0, scaling=RopeScaling("linear", factor=4.0))
  np.testing.assert_allclose(got, inv_freq_ref(64, 10000.0) / 4.0, rtol=1e-12)


@pytest.mark.parametrize("dim,factor", [(64, 4.0), (128, 8.0), (16, 2.0)])
def test_rope_frequencies_ntk_raises_base(dim, factor):
  got = rope_frequencies(dim, theta=10000.0, scaling=RopeScaling("ntk", factor=factor))
  np.testing.assert_allclose(
    got, inv_freq_ref(dim, 10000.0 * factor ** (dim / (dim - 2))), rtol=1e-12
  )
  # NTK-aware: the highest frequency is kept, the lowest is divided by exactly ``factor``.
  plain = inv_freq_ref(dim, 10000.0)
  assert got[0] == pytest.approx(plain[0])
  assert got[-1] == pytest.approx(plain[-1] / factor, rel=1e-12)


@pytest.mark.parametrize(
  "dim,theta,factor,low,high,orig",
  [
    (128, 500000.0, 8.0, 1.0, 4.0, 8192),  # LLaMA 3.1
    (128, 500000.0, 32.0, 1.0, 4.0, 8192),  # LLaMA 3.2
    (64, 10000.0, 4.0, 2.0, 8.0, 256),
  ],
)
def test_rope_frequencies_llama3_match_reference(dim, theta, factor, low, high, orig):
  scaling = RopeScaling(
    "llama3", factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_len=orig
  )
  got = rope_frequencies(dim, theta=theta, scaling=scaling)
  plain = inv_freq_ref(dim, theta)
  want = llama3_ref(plain, factor, low, high, orig)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  # The parameters exercise all three regimes: kept, blended and divided by the factor.
  wavelen = 2 * np.pi / plain
  assert np.any(wavelen < orig / high)
  assert np.any(wavelen > orig / low)
  medium = (wavelen >= orig / high) & (wavelen <= orig / low)
  assert np.any(medium)
  high_freq, low_freq = wavelen < orig / high, wavelen > orig / low
  np.testing.assert_allclose(got[high_freq], plain[high_freq], rtol=1e-12)
  np.testing.assert_allclose(got[low_freq], plain[low_freq] / factor, rtol=1e-12)
  assert np.all((got[medium] < plain[medium]) & (got[medium] > plain[medium] / factor))


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(kind="yarn"), "kind"),
    (dict(kind="linear", factor=0.0), "factor"),
    (dict(kind="ntk", factor=-2.0), "factor"),
    (dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=4.0), "high_freq"),
    (dict(kind="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0), "high_freq"),
    (dict(kind="linear", factor=float("nan")), "factor"),
  ],
)
def test_rope_scaling_validation_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RopeScaling(**kwargs)


def test_rope_scaling_is_frozen():
  s = RopeScaling("linear", factor=2.0)
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.factor = 3.0  # type: ignore[misc]


# --------------------------------------------------------------------------------------------------
# apply_rope.


def rope_ref(x, positions, *, inv_freq, interleaved):
  """Rotates pairs (2i, 2i+1) (GPT-J) or (i, i + H/2) (rotate half, LLaMA/HF) in float64."""
  x = np.asarray(x, np.float64)
  b, t, _, h = x.shape
  pos = np.broadcast_to(np.asarray(positions, np.float64), (b, t))
  out = np.empty_like(x)
  for f in range(h // 2):
    i, j = (2 * f, 2 * f + 1) if interleaved else (f, f + h // 2)
    angle = pos * inv_freq[f]
    c, s = np.cos(angle)[..., None], np.sin(angle)[..., None]
    out[..., i] = x[..., i] * c - x[..., j] * s
    out[..., j] = x[..., j] * c + x[..., i] * s
  return out


def rand(shape, seed, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


rope = jax.jit(apply_rope, static_argnames=("theta", "interleaved", "scaling"))


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("batched_positions", [False, True], ids=["pos_T", "pos_BT"])
def test_apply_rope_matches_reference(interleaved, batched_positions):
  x = rand((2, 6, 3, 8), 0)
  if batched_positions:
    positions = np.array([[0, 1, 2, 3, 4, 5], [7, 3, 40, 11, 0, 2]])
  else:
    positions = np.array([3, 4, 5, 6, 7, 50])
  got = rope(x, jnp.asarray(positions), theta=10000.0, interleaved=interleaved)
  assert got.shape == x.shape and got.dtype == x.dtype
  want = rope_ref(x, positions, inv_freq=inv_freq_ref(8, 10000.0), interleaved=interleaved)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_apply_rope_conventions_differ():
  x = rand((1, 4, 1, 8), 1)
  pos = jnp.arange(1, 5)
  assert not np.allclose(rope(x, pos, interleaved=True), rope(x, pos, interleaved=False), atol=1e-3)


def test_apply_rope_interleaved_equals_rotate_half_after_permutation():
  # Moving features (2i, 2i+1) to (i, i + H/2) turns the GPT-J convention into the NeoX one.
  x = rand((2, 5, 2, 8), 2)
  pos = jnp.arange(5) * 3
  perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
  np.testing.assert_allclose(
    rope(x, pos, interleaved=True)[..., perm], rope(x[..., perm], pos, interleaved=False), atol=1e-6
  )


def test_apply_rope_custom_theta_matches_reference():
  x = rand((1, 4, 2, 16), 3)
  pos = np.array([0, 9, 100, 1000])
  got = rope(x, jnp.asarray(pos), theta=500000.0)
  want = rope_ref(x, pos, inv_freq=inv_freq_ref(16, 500000.0), interleaved=False)
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)


def test_apply_rope_position_zero_is_identity():
  x = rand((2, 3, 2, 8), 4)
  np.testing.assert_array_equal(rope(x, jnp.zeros(3, jnp.int32)), x)


def test_apply_rope_preserves_pair_norms():
  x = rand((2, 6, 2, 8), 5)
  y = np.asarray(rope(x, jnp.arange(6) * 7))
  x = np.asarray(x)
  np.testing.assert_allclose(
    x[..., :4] ** 2 + x[..., 4:] ** 2, y[..., :4] ** 2 + y[..., 4:] ** 2, rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rope_llama3_scaling_matches_reference(interleaved):
  scaling = RopeScaling(
    "llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=64
  )
  x = rand((1, 5, 2, 16), 6)
  pos = np.array([0, 3, 17, 60, 200])
  got = rope(x, jnp.asarray(pos), interleaved=interleaved, scaling=scaling)
  inv = llama3_ref(inv_freq_ref(16, 10000.0), 4.0, 1.0, 4.0, 64)
  want = rope_ref(x, pos, inv_freq=inv, interleaved=interleaved)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_apply_rope_linear_scaling_equals_scaled_positions():
  x = rand((2, 4, 2, 8), 7)
  pos = jnp.asarray([0, 5, 12, 31])
  np.testing.assert_allclose(
    rope(x, 2 * pos, scaling=RopeScaling("linear", factor=2.0)), rope(x, pos), atol=1e-5
  )


def test_apply_rope_ntk_scaling_equals_raised_theta():
  x = rand((2, 4, 2, 8), 8)
  pos = jnp.asarray([0, 5, 12, 31])
  np.testing.assert_allclose(
    rope(x, pos, scaling=RopeScaling("ntk", factor=4.0)),
    rope(x, pos, theta=10000.0 * 4.0 ** (8 / 6)),
    atol=1e-5,
  )


def test_apply_rope_bf16_keeps_dtype_and_is_accurate():
  x = rand((2, 4, 2, 16), 9, jnp.bfloat16)
  pos = np.array([1, 2, 30, 400])
  got = rope(x, jnp.asarray(pos))
  assert got.dtype == jnp.bfloat16
  want = rope_ref(x, pos, inv_freq=inv_freq_ref(16, 10000.0), interleaved=False)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=1e-2)


def test_apply_rope_raises_when_head_dim_odd():
  with pytest.raises(ValueError, match="even"):
    apply_rope(rand((1, 2, 1, 5), 10), jnp.arange(2))


_scores = jax.jit(
  lambda q, k, pq, pk, interleaved: jnp.einsum(
    "bth,bth->bt",
    rope(q, pq, interleaved=interleaved)[:, :, 0],
    rope(k, pk, interleaved=interleaved)[:, :, 0],
  ),
  static_argnums=4,
)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
  p=st.integers(0, 2000),
  r=st.integers(0, 2000),
  c=st.integers(-2000, 2000),
  interleaved=st.booleans(),
)
def test_rope_scores_depend_only_on_relative_offset(p, r, c, interleaved):
  c = max(c, -min(p, r))  # keep positions non-negative
  q = rand((1, 1, 1, 16), 11)
  k = rand((1, 1, 1, 16), 12)
  q, k = q / jnp.linalg.norm(q), k / jnp.linalg.norm(k)
  pq = jnp.asarray([[p], [p + c]])
  pk = jnp.asarray([[r], [r + c]])
  s = np.asarray(_scores(jnp.concatenate([q, q]), jnp.concatenate([k, k]), pq, pk, interleaved))
  assert s[0, 0] == pytest.approx(s[1, 0], abs=2e-3)
  # And the reference agrees on the value.
  inv = inv_freq_ref(16, 10000.0)
  want = np.sum(
    rope_ref(q, [[p]], inv_freq=inv, interleaved=interleaved)
    * rope_ref(k, [[r]], inv_freq=inv, interleaved=interleaved)
  )
  assert s[0, 0] == pytest.approx(want, abs=2e-3)


def test_rope_scores_change_with_offset():
  q, k = rand((2, 1, 1, 16), 13), rand((2, 1, 1, 16), 14)
  q = jnp.concatenate([q[:1], q[:1]])
  k = jnp.concatenate([k[:1], k[:1]])
  s = np.asarray(_scores(q, k, jnp.asarray([[5], [5]]), jnp.asarray([[3], [4]]), False))
  assert abs(s[0, 0] - s[1, 0]) > 1e-3


def test_apply_rope_vmap_over_extra_axis_equals_loop():
  x = rand((3, 2, 4, 2, 8), 15)
  pos = jnp.asarray(np.random.default_rng(16).integers(0, 100, (3, 2, 4)))
  batched = jax.jit(jax.vmap(lambda x_, p_: apply_rope(x_, p_, interleaved=True)))(x, pos)
  for e in range(3):
    want = rope_ref(x[e], pos[e], inv_freq=inv_freq_ref(8, 10000.0), interleaved=True)
    np.testing.assert_allclose(batched[e], want, atol=1e-5, rtol=1e-5)


def test_apply_rope_eager_matches_jit():
  x = rand((2, 3, 2, 8), 17)
  pos = jnp.asarray([[1, 2, 3], [9, 8, 7]])
  np.testing.assert_allclose(apply_rope(x, pos), rope(x, pos), atol=1e-6)


def test_apply_rope_gradients_match_numerical():
  with jax.enable_x64(True):
    x = rand((1, 3, 2, 4), 18, jnp.float64)
    pos = jnp.asarray([2, 5, 11])
    f = jax.jit(lambda x_: apply_rope(x_, pos) ** 2)  # squared, so the 2nd order is non-trivial
    check_grads(f, (x,), order=2, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3)


# --------------------------------------------------------------------------------------------------
# ALiBi.


def alibi_slopes_ref(n):
  """The paper's slopes: 2^(-8i/n) for a power of two n; else those of the closest smaller power of
  two c, then the odd-indexed slopes 2^(-8(2j+1)/(2c)) of the 2c sequence."""
  c = 2 ** int(math.floor(math.log2(n)))
  slopes = [2.0 ** (-8.0 * i / c) for i in range(1, c + 1)]
  slopes += [2.0 ** (-8.0 * (2 * j + 1) / (2 * c)) for j in range(n - c)]
  return np.array(slopes)


def test_alibi_slopes_eight_heads():
  np.testing.assert_allclose(alibi_slopes(8), [2.0**-i for i in range(1, 9)], rtol=1e-12)


def test_alibi_slopes_twelve_heads_hand_values():
  want = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
  np.testing.assert_allclose(alibi_slopes(12), want, rtol=1e-12)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 12, 16, 20, 24, 32, 40])
def test_alibi_slopes_match_paper_definition(n):
  got = alibi_slopes(n)
  assert got.shape == (n,)
  np.testing.assert_allclose(got, alibi_slopes_ref(n), rtol=1e-12)


def test_alibi_slopes_raise_when_no_heads():
  with pytest.raises(ValueError, match="num_heads"):
    alibi_slopes(0)


@pytest.mark.parametrize("n,t,s", [(4, 5, 5), (6, 3, 7), (12, 1, 4)])
def test_alibi_bias_is_minus_slope_times_distance(n, t, s):
  bias = alibi_bias(n, t, s)
  assert bias.shape == (1, n, t, s)
  assert bias.dtype == jnp.float32
  slopes = alibi_slopes_ref(n)
  want = np.zeros((1, n, t, s))
  for h in range(n):
    for i in range(t):
      for j in range(s):
        want[0, h, i, j] = -slopes[h] * abs((s - t + i) - j)
  np.testing.assert_allclose(bias, want, rtol=1e-6)


def test_alibi_bias_default_key_length_is_square():
  np.testing.assert_array_equal(alibi_bias(4, 6), alibi_bias(4, 6, 6))


# --------------------------------------------------------------------------------------------------
# T5 relative position buckets.


def t5_bucket_ref(relative_position, bidirectional, num_buckets, max_distance):
  """Transcription of Mesh TensorFlow's ``_relative_position_bucket`` for one integer."""
  ret = 0
  n = -relative_position
  if bidirectional:
    num_buckets //= 2
    ret += num_buckets if n < 0 else 0
    n = abs(n)
  else:
    n = max(n, 0)
  max_exact = num_buckets // 2
  if n < max_exact:
    return ret + n
  val_if_large = max_exact + int(
    math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
  )
  return ret + min(val_if_large, num_buckets - 1)


bucket = jax.jit(
  relative_position_bucket, static_argnames=("bidirectional", "num_buckets", "max_distance")
)


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 64), (64, 256)])
def test_relative_position_bucket_matches_t5(bidirectional, num_buckets, max_distance):
  rp = np.arange(-300, 301)
  got = np.asarray(
    bucket(
      jnp.asarray(rp),
      bidirectional=bidirectional,
      num_buckets=num_buckets,
      max_distance=max_distance,
    )
  )
  want = np.array([t5_bucket_ref(int(r), bidirectional, num_buckets, max_distance) for r in rp])
  np.testing.assert_array_equal(got, want)
  assert got.min() >= 0 and got.max() < num_buckets


@pytest.mark.parametrize(
  "rp,want",
  [
    (0, 0),
    (1, 17),
    (-1, 1),
    (7, 23),
    (-7, 7),
    (-8, 8),
    (-127, 15),
    (-128, 15),
    (-300, 15),
    (300, 31),
    (16, 26),
  ],
)
def test_relative_position_bucket_bidirectional_hand_values(rp, want):
  assert int(relative_position_bucket(jnp.asarray(rp))) == want


@pytest.mark.parametrize(
  "rp,want",
  [(0, 0), (1, 0), (5, 0), (300, 0), (-1, 1), (-15, 15), (-16, 16), (-127, 31), (-300, 31)],
)
def test_relative_position_bucket_causal_hand_values(rp, want):
  assert int(relative_position_bucket(jnp.asarray(rp), bidirectional=False)) == want


def test_relative_position_bucket_keeps_shape_and_int_dtype():
  rp = relative_positions(3, 5)
  got = bucket(rp)
  assert got.shape == (3, 5)
  assert jnp.issubdtype(got.dtype, jnp.integer)


@pytest.mark.parametrize("t,s", [(4, 4), (2, 6), (1, 3)])
def test_relative_positions_are_key_minus_query(t, s):
  got = np.asarray(relative_positions(t, s))
  want = np.array([[j - (s - t + i) for j in range(s)] for i in range(t)])
  np.testing.assert_array_equal(got, want)


def test_relative_positions_default_key_length_is_square():
  np.testing.assert_array_equal(relative_positions(4), relative_positions(4, 4))


def test_relative_position_bucket_vmap_equals_loop():
  rp = jnp.asarray(np.random.default_rng(19).integers(-200, 200, (4, 6)))
  batched = jax.vmap(lambda r: relative_position_bucket(r, bidirectional=True))(rp)
  want = np.array([[t5_bucket_ref(int(r), True, 32, 128) for r in row] for row in np.asarray(rp)])
  np.testing.assert_array_equal(batched, want)


@pytest.mark.parametrize("batched_positions", [False, True], ids=["pos_T", "pos_BT"])
def test_apply_rope_works_under_strict_rank_promotion(batched_positions):
  # STYLE.md: tests run with jax_numpy_rank_promotion="raise"; the [B, T, 1] positions times the
  # [H/2] frequencies must not rely on implicit rank promotion.
  x = rand((2, 4, 2, 8), 20)
  pos = np.tile(np.arange(4), (2, 1)) if batched_positions else np.arange(4)
  with jax.numpy_rank_promotion("raise"):
    out = jax.eval_shape(lambda: apply_rope(x, jnp.asarray(pos)))  # tracing hits the check
  assert out.shape == x.shape


def test_positions_helpers_work_under_strict_rank_promotion():
  with jax.numpy_rank_promotion("raise"):
    b = jax.jit(lambda: relative_position_bucket(relative_positions(3, 5), bidirectional=False))()
    alibi_bias(4, 3, 5)
  want = [[t5_bucket_ref(j - (2 + i), False, 32, 128) for j in range(5)] for i in range(3)]
  np.testing.assert_array_equal(b, want)
