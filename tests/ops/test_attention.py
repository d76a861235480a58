"""Tests for ``transformer_jax.ops.attention`` against an independent float64 NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from transformer_jax.ops import alibi_bias, dot_product_attention, padding_mask

B, T, S, H = 2, 5, 7, 8


def attention_ref(q, k, v, *, bias=None, mask=None, causal=False, scale=None):
  """softmax(scale * q k^T + bias) v in float64, K/V heads repeated explicitly.

  Returns ``(out [B, T, N, H], weights [B, N, T, S])``; a row with no allowed key gives zeros.
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  s, kh = k.shape[1], k.shape[2]
  k = np.repeat(k, n // kh, axis=2)  # [B, S, N, H]: query head n uses kv head n // G
  v = np.repeat(v, n // kh, axis=2)
  scale = 1.0 / np.sqrt(h) if scale is None else scale
  logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  allowed = np.ones((b, n, t, s), bool)
  if mask is not None:
    allowed &= np.broadcast_to(np.asarray(mask, bool), (b, n, t, s))
  if causal:
    for i in range(t):
      for j in range(s):
        if j > s - t + i:  # query i sits at key position s - t + i
          allowed[:, :, i, j] = False
  logits = np.where(allowed, logits, -np.inf)
  row_max = logits.max(-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  e = np.exp(logits - row_max) * allowed
  denom = e.sum(-1, keepdims=True)
  weights = np.where(denom > 0, e / np.where(denom > 0, denom, 1.0), 0.0)
  out = np.einsum("bnts,bsnh->btnh", weights, v)
  return out, weights


def make_qkv(seed, *, b=B, t=T, s=S, n=4, k=4, h=H, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, n, h))
  kk = rng.standard_normal((b, s, k, h))
  v = rng.standard_normal((b, s, k, h))
  return tuple(jnp.asarray(a, dtype) for a in (q, kk, v))


# Tests call the jitted op (one compilation per test instead of one per primitive);
# test_jit_matches_eager_with_all_options checks the eager path against it.
attn = jax.jit(
  dot_product_attention, static_argnames=("causal", "scale", "dropout_rate", "return_weights")
)


# --------------------------------------------------------------------------------------------------
# Values against the reference.


@pytest.mark.parametrize(
  "n,k", [(4, 4), (4, 1), (6, 2), (8, 2)], ids=["mha", "mqa", "gqa6_2", "gqa8_2"]
)
def test_output_matches_reference_for_head_layout(n, k):
  q, kk, v = make_qkv(0, n=n, k=k)
  out = attn(q, kk, v)
  ref, _ = attention_ref(q, kk, v)
  assert out.shape == (B, T, n, H)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,k", [(4, 1), (6, 2), (8, 2)])
def test_gqa_matches_repeated_kv(n, k):
  q, kk, v = make_qkv(1, n=n, k=k)
  got = attn(q, kk, v, causal=True)
  want = attn(q, jnp.repeat(kk, n // k, axis=2), jnp.repeat(v, n // k, axis=2), causal=True)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
  "mask_shape", [(B, 1, T, S), (1, 1, T, S), (B, 6, T, S), (B, 1, 1, S), (1, 6, 1, 1)]
)
def test_boolean_mask_matches_reference_for_broadcast_shape(mask_shape):
  q, kk, v = make_qkv(2, n=6, k=2)
  mask = np.random.default_rng(3).random(mask_shape) < 0.6
  out, w = attn(q, kk, v, mask=jnp.asarray(mask), return_weights=True)
  ref, ref_w = attention_ref(q, kk, v, mask=mask)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(w, ref_w, atol=1e-6)
  # Masked entries get exactly zero weight.
  assert np.all(np.asarray(w)[~np.broadcast_to(mask, w.shape)] == 0.0)


@pytest.mark.parametrize("bias_shape", [(B, 4, T, S), (1, 4, T, S), (1, 1, T, S)])
def test_additive_bias_matches_reference(bias_shape):
  q, kk, v = make_qkv(4, n=4, k=2)
  bias = 2.0 * np.random.default_rng(5).standard_normal(bias_shape)
  out = attn(q, kk, v, bias=jnp.asarray(bias, jnp.float32))
  ref, _ = attention_ref(q, kk, v, bias=bias)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_alibi_bias_with_mask_and_causal_matches_reference():
  q, kk, v = make_qkv(6, n=4, k=4)
  bias = alibi_bias(4, T, S)
  mask = np.random.default_rng(7).random((B, 1, 1, S)) < 0.8
  mask[:, :, :, -1] = True  # keep every causal row non-empty
  out = attn(q, kk, v, bias=bias, mask=jnp.asarray(mask), causal=True)
  ref, _ = attention_ref(q, kk, v, bias=np.asarray(bias), mask=mask, causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t,s", [(5, 5), (3, 7), (1, 7)])
def test_causal_aligns_queries_to_end_of_keys(t, s):
  q, kk, v = make_qkv(8, t=t, s=s, n=4, k=2)
  out, w = attn(q, kk, v, causal=True, return_weights=True)
  ref, ref_w = attention_ref(q, kk, v, causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  w = np.asarray(w)
  for i in range(t):
    assert np.all(w[..., i, s - t + i + 1 :] == 0.0), f"query {i} sees a future key"
    assert np.all(w[..., i, : s - t + i + 1] > 0.0), f"query {i} misses a past key"


def test_causal_single_query_equals_unmasked_attention():
  q, kk, v = make_qkv(9, t=1, s=S)
  np.testing.assert_allclose(attn(q, kk, v, causal=True), attn(q, kk, v), atol=1e-6)


def test_causal_output_independent_of_future_keys_via_gradient():
  # nanodo-style: d out[:, i] / d (k, v)[:, j] must vanish for every key j after query i.
  q, kk, v = make_qkv(10, t=6, s=6, n=4, k=2)
  out, vjp = jax.vjp(lambda k_, v_: attn(q, k_, v_, causal=True), kk, v)
  vjp = jax.jit(vjp)
  for i in range(6):
    gk, gv = vjp(jnp.zeros_like(out).at[:, i].set(1.0))
    assert np.all(np.asarray(gk)[:, i + 1 :] == 0.0)
    assert np.all(np.asarray(gv)[:, i + 1 :] == 0.0)
    assert np.all(np.any(np.asarray(gv)[:, : i + 1] != 0.0, axis=(2, 3)))


def test_causal_and_mask_combine():
  q, kk, v = make_qkv(11, t=4, s=6)
  mask = np.ones((B, 1, 4, 6), bool)
  mask[0, :, :, -1] = False  # batch 0: the key that queries sit on at the end is hidden
  out = attn(q, kk, v, mask=jnp.asarray(mask), causal=True)
  ref, _ = attention_ref(q, kk, v, mask=mask, causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_custom_scale_matches_reference():
  q, kk, v = make_qkv(12, n=4, k=2)
  out = attn(q, kk, v, scale=0.7)
  ref, _ = attention_ref(q, kk, v, scale=0.7)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)
  default_ref, _ = attention_ref(q, kk, v)
  assert not np.allclose(out, default_ref, atol=1e-3)  # the scale really is used


def test_return_weights_gives_attention_matrix():
  q, kk, v = make_qkv(13, n=6, k=3)
  out, w = attn(q, kk, v, causal=True, return_weights=True)
  ref_out, ref_w = attention_ref(q, kk, v, causal=True)
  assert w.shape == (B, 6, T, S)
  assert w.dtype == jnp.float32
  np.testing.assert_allclose(w, ref_w, atol=1e-6)
  np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, atol=1e-5)
  np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
  # out == weights @ v (kv heads repeated).
  v_rep = np.repeat(np.asarray(v, np.float64), 2, axis=2)
  np.testing.assert_allclose(out, np.einsum("bnts,bsnh->btnh", np.asarray(w), v_rep), atol=1e-5)


def test_output_dtype_follows_query_dtype():
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    q, kk, v = make_qkv(14, dtype=dtype)
    assert attn(q, kk, v).dtype == dtype


# --------------------------------------------------------------------------------------------------
# Fully masked rows.


def fully_masked_setup():
  q, kk, v = make_qkv(15, n=4, k=2)
  mask = np.random.default_rng(16).random((B, 1, T, S)) < 0.7
  mask[0, :, 1, :] = False  # batch 0, query 1: nothing to attend to
  mask[1, :, 3, :] = False
  mask[1, :, 2, 0] = True
  return q, kk, v, mask


def test_fully_masked_row_gives_zeros():
  q, kk, v, mask = fully_masked_setup()
  out, w = attn(q, kk, v, mask=jnp.asarray(mask), return_weights=True)
  out, w = np.asarray(out), np.asarray(w)
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(w))
  assert np.all(out[0, 1] == 0.0) and np.all(out[1, 3] == 0.0)
  assert np.all(w[0, :, 1] == 0.0) and np.all(w[1, :, 3] == 0.0)
  ref, _ = attention_ref(q, kk, v, mask=mask)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_fully_masked_row_gives_zeros_with_padding_queries():
  q, kk, v = make_qkv(17, t=4, s=4)
  key_valid = jnp.asarray([[1, 1, 1, 0], [1, 1, 0, 0]])
  mask = padding_mask(key_valid, query_valid=key_valid)
  out = np.asarray(attn(q, kk, v, mask=mask, causal=True))
  assert np.all(out[0, 3] == 0.0) and np.all(out[1, 2:] == 0.0)
  ref, _ = attention_ref(q, kk, v, mask=np.asarray(mask), causal=True)
  np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5)


def test_fully_masked_row_gradients_are_finite():
  q, kk, v, mask = fully_masked_setup()
  mask = jnp.asarray(mask)
  bias = jnp.zeros((1, 4, T, S))

  def loss(q_, k_, v_, b_):
    return jnp.sum(jnp.square(attn(q_, k_, v_, mask=mask, bias=b_)))

  grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, kk, v, bias)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  # The masked query rows get no gradient.
  assert np.all(np.asarray(grads[0])[0, 1] == 0.0)
  assert np.all(np.asarray(grads[0])[1, 3] == 0.0)


# --------------------------------------------------------------------------------------------------
# Low precision.


def test_bf16_inputs_close_to_reference():
  q, kk, v = make_qkv(18, n=8, k=2, dtype=jnp.bfloat16)
  out, w = attn(q, kk, v, causal=True, return_weights=True)
  assert out.dtype == jnp.bfloat16
  ref, ref_w = attention_ref(q, kk, v, causal=True)  # from the same bf16-rounded inputs
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2, rtol=3e-2)
  # Softmax runs in float32: the weights are as accurate as float32 logits allow.
  assert w.dtype == jnp.float32
  np.testing.assert_allclose(w, ref_w, atol=1e-5)


def test_bf16_large_logits_softmax_in_float32():
  # Logits ~ hundreds: a bf16 softmax would lose the small differences between them.
  q, kk, v = make_qkv(19, dtype=jnp.float32)
  q = (q * 8).astype(jnp.bfloat16)
  kk = (kk * 8).astype(jnp.bfloat16)
  _, w = attn(q, kk, v.astype(jnp.bfloat16), return_weights=True)
  _, ref_w = attention_ref(q, kk, v)
  np.testing.assert_allclose(w, ref_w, atol=1e-4)


def _grads_f64(q, kk, v, bias, mask, w, causal):
  """Output and gradients of ``sum(out * w)`` in float64, by differentiating the forward formulas
  (the ``return_weights`` path)."""
  with jax.enable_x64(True):

    def loss(q_, k_, v_, b_):
      out = dot_product_attention(
        q_, k_, v_, bias=b_, mask=mask, causal=causal, implementation="xla", return_weights=True
      )[0]
      return jnp.sum(out * jnp.asarray(w, jnp.float64)), out

    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (q, kk, v, bias)]
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    return np.asarray(out), [np.asarray(g) for g in grads]


# --------------------------------------------------------------------------------------------------
# Errors.


def test_shape_error_when_heads_not_divisible():
  q, kk, v = make_qkv(20, n=6, k=4)
  with pytest.raises(ValueError, match=r"N=6.*K=4"):
    attn(q, kk, v)


def test_shape_error_names_shapes_when_batch_mismatched():
  q, _, _ = make_qkv(21, b=2)
  _, kk, v = make_qkv(21, b=3)
  with pytest.raises(ValueError, match=r"\(2, 5, 4, 8\).*\(3, 7, 4, 8\)"):
    attn(q, kk, v)


def test_shape_error_names_shapes_when_head_dim_mismatched():
  q, _, _ = make_qkv(22, h=8)
  _, kk, v = make_qkv(22, h=4)
  with pytest.raises(ValueError, match=r"\(2, 5, 4, 8\).*\(2, 7, 4, 4\)"):
    attn(q, kk, v)


def test_shape_error_names_shapes_when_k_v_differ():
  q, kk, _ = make_qkv(23)
  _, _, v = make_qkv(23, s=6)
  with pytest.raises(ValueError, match=r"\(2, 7, 4, 8\).*\(2, 6, 4, 8\)"):
    attn(q, kk, v)


def test_shape_error_names_shapes_when_not_4d():
  q, kk, v = make_qkv(24)
  with pytest.raises(ValueError, match=r"\(5, 4, 8\)"):
    attn(q[0], kk, v)


# --------------------------------------------------------------------------------------------------
# Against jax.nn.dot_product_attention.


@pytest.mark.parametrize("n,k,causal", [(4, 4, True), (8, 2, False)])
def test_matches_jax_nn_dot_product_attention(n, k, causal):
  q, kk, v = make_qkv(25, t=6, s=6, n=n, k=k)
  got = attn(q, kk, v, causal=causal)
  want = jax.nn.dot_product_attention(q, kk, v, is_causal=causal)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_matches_jax_nn_dot_product_attention_with_mask_and_bias():
  q, kk, v = make_qkv(26, n=4, k=2)
  rng = np.random.default_rng(27)
  mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.7).at[..., 0].set(True)
  bias = jnp.asarray(rng.standard_normal((1, 4, T, S)), jnp.float32)
  got = attn(q, kk, v, mask=mask, bias=bias)
  want = jax.nn.dot_product_attention(q, kk, v, mask=mask, bias=bias)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# Dropout on the attention weights.


def test_attention_dropout_deterministic_given_key():
  q, kk, v = make_qkv(28)
  key = jax.random.key(0)
  a = attn(q, kk, v, dropout_rate=0.5, dropout_rng=key)
  b = attn(q, kk, v, dropout_rate=0.5, dropout_rng=key)
  c = attn(q, kk, v, dropout_rate=0.5, dropout_rng=jax.random.key(1))
  plain = attn(q, kk, v)
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert not np.allclose(a, plain)


def test_attention_dropout_rate_zero_equals_no_dropout():
  q, kk, v = make_qkv(29, n=4, k=2)
  plain = attn(q, kk, v, causal=True)
  np.testing.assert_array_equal(
    attn(q, kk, v, causal=True, dropout_rate=0.0, dropout_rng=jax.random.key(3)), plain
  )
  np.testing.assert_array_equal(  # no key: dropout disabled
    attn(q, kk, v, causal=True, dropout_rate=0.5, dropout_rng=None), plain
  )


def test_attention_dropout_preserves_mean_output():
  q, kk, v = make_qkv(30, b=1, t=2, s=4, n=2, k=2, h=4)
  keys = jax.random.split(jax.random.key(4), 4000)
  outs = jax.vmap(lambda key: attn(q, kk, v, dropout_rate=0.3, dropout_rng=key))(keys)
  ref, _ = attention_ref(q, kk, v)
  np.testing.assert_allclose(np.asarray(outs).mean(0), ref, atol=0.06)


def test_attention_dropout_zeroes_about_rate_of_weights():
  # With v = identity over keys, out[..., j] is exactly the (dropped, rescaled) weight on key j.
  t = s = 16
  q, kk, _ = make_qkv(31, b=2, t=t, s=s, n=4, k=4, h=s)
  v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (2, s, 4, s))
  out, w = attn(q, kk, v, dropout_rate=0.25, dropout_rng=jax.random.key(5), return_weights=True)
  dropped = np.transpose(np.asarray(out), (0, 2, 1, 3))  # [B, N, T, S]
  w = np.asarray(w)
  zero_frac = np.mean(dropped == 0.0)
  assert abs(zero_frac - 0.25) < 0.04  # ~4 standard errors
  kept = dropped != 0.0
  np.testing.assert_allclose(dropped[kept], w[kept] / 0.75, rtol=1e-5, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Transformations.


def test_jit_matches_eager_with_all_options():
  q, kk, v = make_qkv(32, n=6, k=2)
  mask = jnp.asarray(np.random.default_rng(33).random((B, 1, T, S)) < 0.7)
  bias = alibi_bias(6, T, S)
  kwargs = dict(mask=mask, bias=bias, causal=True, scale=0.4, return_weights=True)
  eager = dot_product_attention(q, kk, v, **kwargs)
  jitted = attn(q, kk, v, **kwargs)
  ref = attention_ref(
    q, kk, v, mask=np.asarray(mask), bias=np.asarray(bias), causal=True, scale=0.4
  )
  for e, j, r in zip(eager, jitted, ref):
    np.testing.assert_allclose(e, j, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(e, r, atol=1e-5, rtol=1e-5)


def test_vmap_over_extra_axis_equals_loop():
  rng = np.random.default_rng(34)
  e = 3
  q = jnp.asarray(rng.standard_normal((e, B, T, 4, H)), jnp.float32)
  kk = jnp.asarray(rng.standard_normal((e, B, S, 2, H)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((e, B, S, 2, H)), jnp.float32)
  mask = jnp.asarray(rng.random((e, B, 1, T, S)) < 0.7)

  def f(q_, k_, v_, m_):
    return attn(q_, k_, v_, mask=m_, causal=True)

  batched = jax.jit(jax.vmap(f))(q, kk, v, mask)
  for i in range(e):
    np.testing.assert_allclose(batched[i], f(q[i], kk[i], v[i], mask[i]), atol=1e-6, rtol=1e-6)
    ref, _ = attention_ref(q[i], kk[i], v[i], mask=np.asarray(mask[i]), causal=True)
    np.testing.assert_allclose(batched[i], ref, atol=1e-5, rtol=1e-5)


def test_gradients_match_numerical():
  with jax.enable_x64(True):
    q, kk, v = make_qkv(35, b=1, t=3, s=4, n=4, k=2, h=4, dtype=jnp.float64)
    bias = jnp.asarray(np.random.default_rng(36).standard_normal((1, 4, 3, 4)))
    f = jax.jit(lambda q_, k_, v_, b_: dot_product_attention(q_, k_, v_, bias=b_, causal=True))
    check_grads(f, (q, kk, v, bias), order=1, modes=["rev"], atol=1e-2, rtol=1e-2, eps=1e-3)


def test_gradients_with_mask_bias_and_gqa_match_numerical():
  # The dense kernel's written-out backward (dS = P * (dP - rowsum(dO * O))), bias gradient
  # summed over its broadcast axes, a fully masked query row included.
  with jax.enable_x64(True):
    q, kk, v = make_qkv(40, b=2, t=3, s=5, n=4, k=2, h=4, dtype=jnp.float64)
    bias = jnp.asarray(np.random.default_rng(41).standard_normal((1, 4, 3, 5)))
    mask = np.random.default_rng(42).random((2, 1, 3, 5)) > 0.3
    mask[:, :, :, 0] = True
    mask[1, 0, 2] = False  # row (1, 2) sees no key
    f = jax.jit(
      lambda q_, k_, v_, b_: dot_product_attention(q_, k_, v_, bias=b_, mask=jnp.asarray(mask))
    )
    check_grads(f, (q, kk, v, bias), order=1, modes=["rev"], atol=1e-5, rtol=1e-5, eps=1e-5)
    # And against differentiating the forward formulas (the path that returns the weights).
    g = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2, 3))(q, kk, v, bias)
    ref = jax.grad(
      lambda q_, k_, v_, b_: jnp.sum(
        jnp.sin(
          dot_product_attention(
            q_, k_, v_, bias=b_, mask=jnp.asarray(mask), implementation="xla", return_weights=True
          )[0]
        )
      ),
      argnums=(0, 1, 2, 3),
    )(q, kk, v, bias)
    for a, b in zip(g, ref):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_gradients_match_reference_gradients():
  # Analytic gradient of the op vs finite differences of the float64 NumPy reference.
  q, kk, v = make_qkv(37, b=1, t=3, s=4, n=2, k=1, h=4)
  w = np.random.default_rng(38).standard_normal((1, 3, 2, 4))
  gq = np.asarray(
    jax.jit(jax.grad(lambda q_: jnp.sum(dot_product_attention(q_, kk, v, causal=True) * w)))(q)
  )

  def ref_loss(q_):
    return np.sum(attention_ref(q_, kk, v, causal=True)[0] * w)

  q64 = np.asarray(q, np.float64)
  num = np.zeros_like(q64)
  eps = 1e-6
  for idx in np.ndindex(q64.shape):
    dq = np.zeros_like(q64)
    dq[idx] = eps
    num[idx] = (ref_loss(q64 + dq) - ref_loss(q64 - dq)) / (2 * eps)
  np.testing.assert_allclose(gq, num, atol=1e-4, rtol=1e-4)


def test_attention_works_under_strict_rank_promotion():
  # STYLE.md: tests run with jax_numpy_rank_promotion="raise". Tracing (eval_shape) is enough to
  # hit the check, without compiling.
  q, kk, v = make_qkv(39, n=4, k=2)
  mask = padding_mask(jnp.ones((B, S), bool))
  with jax.numpy_rank_promotion("raise"):
    out = jax.eval_shape(
      lambda: dot_product_attention(
        q,
        kk,
        v,
        mask=mask,
        bias=alibi_bias(4, T, S),
        causal=True,
        dropout_rate=0.1,
        dropout_rng=jax.random.key(0),
      )
    )
  assert out.shape == q.shape
