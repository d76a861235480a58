"""The "chunked" attention kernel against a float64 NumPy reference with hand-written gradients.

Shapes are tiny and blocks small (block_q=8, block_k=5 over lengths like 37) so that every case
crosses many blocks, partial last blocks and the causal / window block skipping.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import ops

BQ, BK = 8, 5
# Float32 kernel against float64: max |error| / max |reference| per array.
TOL = 1e-5
# bfloat16 inputs (8-bit mantissa) rounded to bfloat16 output: a few bf16 ulps.
BF16_TOL = 2e-2


def reference(q, k, v, do, *, valid, bias=None, keep=None, rate=0.0, scale=None):
  """Float64 attention and its gradients, written out: ``out = (P * keep / (1 - rate)) V`` with
  ``P = softmax(scale q k^T + bias)`` over the valid keys (rows with none give zeros).

  Returns ``out [B,T,N,H]`` and the gradients of ``sum(out * do)`` wrt q, k, v and the bias
  (``dS [B,N,T,S]``, from which the bias-parameter gradients follow).
  """
  q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # head n uses kv head n // G
  scale = h**-0.5 if scale is None else scale
  valid = np.broadcast_to(valid, (b, n, t, k.shape[1]))
  logits = np.einsum("btnh,bsnh->bnts", q, kr) * scale
  if bias is not None:
    logits = logits + np.asarray(bias, np.float64)
  logits = np.where(valid, logits, -np.inf)
  row_max = logits.max(-1, keepdims=True)
  e = np.where(valid, np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
  denom = e.sum(-1, keepdims=True)
  p = e / np.where(denom > 0, denom, 1.0)
  mult = 1.0 if keep is None else np.asarray(keep, np.float64) / (1.0 - rate)
  pd = p * mult
  out = np.einsum("bnts,bsnh->btnh", pd, vr)
  dp = np.einsum("btnh,bsnh->bnts", do, vr) * mult
  ds = p * (dp - (p * dp).sum(-1, keepdims=True))
  dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
  dk = np.einsum("bnts,btnh->bsnh", ds, q).reshape(b, -1, n // g, g, h).sum(3) * scale
  dv = np.einsum("bnts,btnh->bsnh", pd, do).reshape(b, -1, n // g, g, h).sum(3)
  return out, dq, dk, dv, ds


def valid_mask(
  b, t, s, *, causal=False, window=None, kv_valid=None, q_seg=None, kv_seg=None, q_pos=None
):
  """``[B, 1, T, S]`` bool from the parts, by loops over positions."""
  q_pos = np.broadcast_to(np.arange(t) + s - t if q_pos is None else np.asarray(q_pos), (b, t))
  valid = np.ones((b, 1, t, s), bool)
  for bi in range(b):
    for i in range(t):
      for j in range(s):
        ok = not (causal and j > q_pos[bi, i])
        ok &= window is None or abs(q_pos[bi, i] - j) < window
        ok &= kv_valid is None or bool(kv_valid[bi, j])
        ok &= q_seg is None or q_seg[bi, i] == kv_seg[bi, j]
        valid[bi, 0, i, j] = ok
  return valid


def inputs(seed, *, b=2, t=37, s=37, n=4, kh=2, h=8, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  arrs = (
    r.standard_normal((b, t, n, h)),
    r.standard_normal((b, s, kh, h)),
    r.standard_normal((b, s, kh, h)),
    r.standard_normal((b, t, n, h)),
  )
  return tuple(jnp.asarray(a, dtype) for a in arrs)


@functools.partial(jax.jit, static_argnames=("causal", "window", "bias_fn", "rate"))
def chunked_value_and_grads(
  q, k, v, do, params, kw, *, causal=False, window=None, bias_fn=None, rate=0.0
):
  """``out`` and the gradients of ``sum(out * do)`` wrt q, k, v and the bias parameters."""

  def loss(q, k, v, params):
    out = ops.dot_product_attention(
      q,
      k,
      v,
      causal=causal,
      window=window,
      bias_fn=bias_fn,
      bias_params=params,
      implementation="chunked",
      block_q=BQ,
      block_k=BK,
      dropout_rate=rate,
      **kw,
    )
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

  grads, out = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, params)
  return out, grads


def assert_close(actual, expected, tol=TOL, name=""):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert np.all(np.isfinite(actual)), name
  err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
  assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def check(
  q,
  k,
  v,
  do,
  *,
  causal=False,
  window=None,
  kv_valid=None,
  q_seg=None,
  kv_seg=None,
  q_pos=None,
  tol=TOL,
):
  b, t, _, _ = q.shape
  s = k.shape[1]
  kw = {
    k_: x
    for k_, x in dict(
      kv_valid=kv_valid, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=q_pos
    ).items()
    if x is not None
  }
  out, (dq, dk, dv, _) = chunked_value_and_grads(
    q, k, v, do, None, kw, causal=causal, window=window
  )
  valid = valid_mask(
    b,
    t,
    s,
    causal=causal,
    window=window,
    kv_valid=kv_valid,
    q_seg=q_seg,
    kv_seg=kv_seg,
    q_pos=q_pos,
  )
  ref = reference(q, k, v, do, valid=valid)
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    assert_close(a, e, tol, name)
  return out, dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kh", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_matches_reference_causal_and_heads(causal, kh):
  check(*inputs(0, kh=kh), causal=causal)


@pytest.mark.parametrize("t,s", [(13, 37), (37, 21), (37, 40)])
def test_query_and_key_lengths_differ(t, s):
  check(*inputs(1, t=t, s=s), causal=True)
  check(*inputs(2, t=t, s=s))


def test_padding_and_fully_masked_rows_give_zeros_and_finite_grads():
  q, k, v, do = inputs(3)
  kv_valid = np.arange(37)[None] < np.array([[23], [0]])  # the second row has no real key
  out, dq, dk, dv = check(q, k, v, do, causal=True, kv_valid=jnp.asarray(kv_valid))
  np.testing.assert_array_equal(np.asarray(out[1]), 0.0)
  np.testing.assert_array_equal(np.asarray(dq[1]), 0.0)


def test_packed_segments():
  q, k, v, do = inputs(4)
  seg = np.sort(np.random.default_rng(4).integers(0, 4, (2, 37)), axis=1)
  check(q, k, v, do, causal=True, q_seg=jnp.asarray(seg), kv_seg=jnp.asarray(seg))
  # Cross-attention style: query and key segment ids of different lengths, not causal.
  q, k, v, do = inputs(5, t=11)
  q_seg = np.random.default_rng(5).integers(0, 3, (2, 11))
  kv_seg = np.random.default_rng(6).integers(0, 3, (2, 37))
  check(q, k, v, do, q_seg=jnp.asarray(q_seg), kv_seg=jnp.asarray(kv_seg))


@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(causal):
  check(*inputs(7), causal=causal, window=6)


def test_single_query_decoding_from_a_cache_with_positions():
  # T = 1 against a cache of 37 slots of which the first 20 are filled: the query sits at 19.
  q, k, v, do = inputs(8, t=1)
  kv_valid = jnp.asarray(np.arange(37)[None].repeat(2, 0) < 20)
  check(q, k, v, do, causal=True, kv_valid=kv_valid, q_pos=jnp.asarray([[19], [19]]))
  check(q, k, v, do, causal=True, q_pos=jnp.asarray([[5], [30]]), window=4)


@pytest.mark.parametrize("bias_kind", ["alibi", "t5", "dense"])
@pytest.mark.parametrize("causal", [False, True])
def test_biases_and_their_parameter_gradients(bias_kind, causal):
  q, k, v, do = inputs(9, t=29)
  b, t, n, _ = q.shape
  s = k.shape[1]
  q_pos = np.arange(t) + s - t
  rel = np.arange(s)[None, :] - q_pos[:, None]  # [T, S] key - query position
  kw = {}
  if bias_kind == "alibi":
    bias_fn, params = ops.AlibiBias(), ops.alibi_slopes(n)
    bias = -np.asarray(params, np.float64)[:, None, None] * np.abs(rel)[None]
  elif bias_kind == "t5":
    bias_fn = ops.RelativeBias(num_buckets=8, max_distance=20, bidirectional=not causal)
    params = jnp.asarray(np.random.default_rng(9).standard_normal((8, n)), jnp.float32)
    buckets = np.asarray(
      ops.relative_position_bucket(
        jnp.asarray(rel), bidirectional=not causal, num_buckets=8, max_distance=20
      )
    )
    bias = np.asarray(params, np.float64)[buckets].transpose(2, 0, 1)  # [N, T, S]
  else:
    bias_fn, params = None, None
    bias = np.random.default_rng(10).standard_normal((n, t, s))
    kw = {"bias": jnp.asarray(bias[None], jnp.float32)}
  out, (dq, dk, dv, dparams) = chunked_value_and_grads(
    q, k, v, do, params, kw, causal=causal, bias_fn=bias_fn
  )
  valid = valid_mask(b, t, s, causal=causal)
  ref = reference(q, k, v, do, valid=valid, bias=bias[None])
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    assert_close(a, e, name=name)
  ds = ref[4].sum(0)  # [N, T, S]
  if bias_kind == "alibi":
    assert_close(dparams, -(ds * np.abs(rel)[None]).sum((1, 2)), name="dslopes")
  elif bias_kind == "t5":
    dtable = np.zeros((8, n))
    np.add.at(dtable, buckets, ds.transpose(1, 2, 0))
    assert_close(dparams, dtable, name="dtable")
  else:
    dbias = jax.jit(
      jax.grad(
        lambda bias: jnp.sum(
          ops.dot_product_attention(
            q, k, v, bias=bias, causal=causal, implementation="chunked", block_q=BQ, block_k=BK
          )
          * do
        )
      )
    )(kw["bias"])
    assert_close(dbias[0], ds, name="dbias")


def test_bfloat16_inputs_accumulate_in_float32():
  q, k, v, do = inputs(11, kh=1, dtype=jnp.bfloat16)
  out, _ = chunked_value_and_grads(q, k, v, do, None, {}, causal=True)
  assert out.dtype == jnp.bfloat16
  check(q, k, v, do, causal=True, tol=BF16_TOL)


def test_dense_mask_and_parts_are_anded():
  q, k, v, do = inputs(12)
  mask = np.random.default_rng(12).random((2, 1, 37, 37)) > 0.3
  out, grads = chunked_value_and_grads(q, k, v, do, None, {"mask": jnp.asarray(mask)}, causal=True)
  ref = reference(q, k, v, do, valid=mask & valid_mask(2, 37, 37, causal=True))
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]), ref):
    assert_close(a, e, name=name)


def dropout_keep(rng, rate, b, n, t, s):
  """The kernel's dropout mask, assembled from its per-block draws (fold_in(rng, qi), ki). The
  block sizes are BQ and BK: the lengths used (37) split into blocks of exactly those sizes."""
  nq, nk = -(-t // BQ), -(-s // BK)

  def draw(qi, ki):
    return jax.random.bernoulli(
      jax.random.fold_in(jax.random.fold_in(rng, qi), ki), 1.0 - rate, (b, n, BQ, BK)
    )

  blocks = jax.jit(jax.vmap(jax.vmap(draw, (None, 0)), (0, None)))(jnp.arange(nq), jnp.arange(nk))
  keep = np.asarray(blocks).transpose(2, 3, 0, 4, 1, 5).reshape(b, n, nq * BQ, nk * BK)
  return keep[:, :, :t, :s]


def test_dropout_is_deterministic_and_matches_its_mask():
  q, k, v, do = inputs(13)
  rng, rate = jax.random.key(0), 0.3
  out, grads = chunked_value_and_grads(
    q, k, v, do, None, {"dropout_rng": rng}, causal=True, rate=rate
  )
  again, _ = chunked_value_and_grads(
    q, k, v, do, None, {"dropout_rng": rng}, causal=True, rate=rate
  )
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
  other, _ = chunked_value_and_grads(
    q, k, v, do, None, {"dropout_rng": jax.random.key(1)}, causal=True, rate=rate
  )
  assert not np.allclose(np.asarray(out), np.asarray(other))
  keep = dropout_keep(rng, rate, 2, 4, 37, 37)
  ref = reference(q, k, v, do, valid=valid_mask(2, 37, 37, causal=True), keep=keep, rate=rate)
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, *grads[:3]), ref):
    assert_close(a, e, name=name)


def test_dropout_mean_is_the_output_without_dropout():
  q, k, v, _ = inputs(14, b=1, t=9, s=9, n=2, kh=1)
  attend = jax.jit(
    jax.vmap(
      lambda key: ops.dot_product_attention(
        q,
        k,
        v,
        causal=True,
        dropout_rate=0.5,
        dropout_rng=key,
        implementation="chunked",
        block_q=4,
        block_k=4,
      )
    )
  )
  outs = attend(jax.random.split(jax.random.key(2), 4000))
  plain = ops.dot_product_attention(q, k, v, causal=True, implementation="xla")
  # Inverted dropout is unbiased: each entry's mean over the draws is within a few of its standard
  # errors of the output without dropout (5 of them: a false alarm among 144 entries is ~1e-4).
  outs = np.asarray(outs, np.float64)
  stderr = outs.std(0) / np.sqrt(outs.shape[0])
  assert np.all(np.abs(outs.mean(0) - np.asarray(plain)) <= 5 * stderr + 1e-6)
  assert stderr.max() > 1e-3  # dropout did act


def test_default_blocks_are_the_large_ones():
  # ops knows no platform: its default blocks are DEFAULT_BLOCK_Q / _K (a backend passes its own,
  # tests/backends), and the default is what an explicit block size of it gives.
  from transformer_jax.ops import chunked

  expected = (chunked.DEFAULT_BLOCK_Q, chunked.DEFAULT_BLOCK_K)
  assert chunked.default_block_sizes() == expected
  q, k, v, _ = inputs(17, b=1, t=600, s=600, n=2, kh=2, h=8)
  attend = jax.jit(
    lambda q, k, v, **kw: ops.dot_product_attention(
      q, k, v, causal=True, implementation="chunked", **kw
    ),
    static_argnames=("block_q", "block_k"),
  )
  np.testing.assert_array_equal(
    np.asarray(attend(q, k, v)),
    np.asarray(attend(q, k, v, block_q=expected[0], block_k=expected[1])),
  )
  assert not np.array_equal(
    np.asarray(attend(q, k, v)), np.asarray(attend(q, k, v, block_q=128, block_k=128))
  )


def test_clear_errors():
  q, k, v, _ = inputs(16, t=9, s=9)
  with pytest.raises(ValueError, match="return_weights"):
    ops.dot_product_attention(q, k, v, implementation="chunked", return_weights=True)
  with pytest.raises(ValueError, match="block_q=0"):
    ops.dot_product_attention(q, k, v, implementation="chunked", block_q=0)
  with pytest.raises(ValueError, match=r"bias must broadcast to \[B, N, T, S\]"):
    ops.dot_product_attention(q, k, v, implementation="chunked", bias=jnp.zeros((3, 9, 9)))
  with pytest.raises(ValueError, match="implementation='cudnn' is a platform's kernel"):
    ops.dot_product_attention(q, k, v, implementation="cudnn")
