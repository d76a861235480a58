"""``layers.Attention`` and ``layers.KVCache``: masks and biases by parts against a float64 NumPy
reference, the cache's slots, and cached attention against attention over the whole sequence."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import ops
from transformer_jax.layers import Attention, KVCache
from tests.conftest import FORCED_IMPL

D, N, K, H = 16, 4, 2, 8


def _attention(num_kv_heads=K, **kw):
  return Attention(
    D,
    N,
    num_kv_heads,
    H,
    use_bias=True,
    init_std=0.3,
    out_init_std=0.3,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(0),
    implementation=FORCED_IMPL,
    **kw,
  )


def _reference(attn, x, kv, allowed_BTS, bias_BNTS=None):
  """float64 NumPy: projections, softmax over allowed keys (zeros for a row with none), output."""

  def f(a):
    return np.asarray(a, np.float64)

  q = np.einsum("btd,dnh->btnh", f(x), f(attn.query.kernel[...])) + f(attn.query.bias[...])
  k = np.einsum("bsd,dkh->bskh", f(kv), f(attn.key.kernel[...])) + f(attn.key.bias[...])
  v = np.einsum("bsd,dkh->bskh", f(kv), f(attn.value.kernel[...])) + f(attn.value.bias[...])
  g = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
  if bias_BNTS is not None:
    logits = logits + bias_BNTS
  allowed = np.broadcast_to(allowed_BTS[:, None], logits.shape)
  logits = np.where(allowed, logits, -np.inf)
  peak = np.max(np.where(allowed, logits, -1e300), axis=-1, keepdims=True)
  weights = np.where(allowed, np.exp(logits - peak), 0.0)
  weights = weights / np.maximum(weights.sum(-1, keepdims=True), 1e-300)
  out = np.einsum("bnts,bsnh->btnh", weights, v)
  return np.einsum("btnh,nhd->btd", out, f(attn.out.kernel[...])) + f(attn.out.bias[...])


def test_mask_parts_and_alibi_match_float64_reference():
  attn = _attention()
  b, t = 2, 7
  x = jax.random.normal(jax.random.key(1), (b, t, D))
  valid = np.array([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], bool)
  segments = np.array([[0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0]], np.int32)
  window = 3
  slopes = np.asarray(ops.alibi_slopes(N), np.float64)
  out, cache = jax.jit(  # one compiled program, not each operation on its own
    lambda x: attn(
      x,
      causal=True,
      kv_valid=jnp.asarray(valid),
      segment_ids=jnp.asarray(segments),
      window=window,
      bias_fn=ops.AlibiBias(),
      bias_params=jnp.asarray(slopes, jnp.float32),
    )
  )(x)
  assert cache is None
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  allowed = (
    ((j <= i) & (np.abs(i - j) < window))[None]
    & valid[:, None, :]
    & (segments[:, :, None] == segments[:, None, :])
  )
  bias = -slopes[None, :, None, None] * np.abs(i - j)[None, None]
  np.testing.assert_allclose(out, _reference(attn, x, x, allowed, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_relative_bias_table_gets_gradient_through_bias_params():
  attn = _attention()
  fn = ops.RelativeBias(num_buckets=8, max_distance=16, bidirectional=True)
  x = jax.random.normal(jax.random.key(2), (1, 5, D))
  table = jax.random.normal(jax.random.key(3), (8, N))

  def summed(table):
    return jnp.sum(attn(x, bias_fn=fn, bias_params=table)[0] ** 2)

  loss = jax.jit(summed)  # compiled programs, not each operation on its own

  rel = np.arange(5)[None, :] - np.arange(5)[:, None]
  buckets = np.asarray(
    ops.relative_position_bucket(
      jnp.asarray(rel), bidirectional=True, num_buckets=8, max_distance=16
    )
  )
  bias = np.transpose(np.asarray(table, np.float64)[buckets], (2, 0, 1))[None]
  allowed = np.ones((1, 5, 5), bool)
  np.testing.assert_allclose(
    loss(table), np.sum(_reference(attn, x, x, allowed, bias) ** 2), rtol=1e-5
  )
  grad = jax.jit(jax.grad(summed))(table)
  # The directional derivative along a random direction, by central differences.
  u = jax.random.normal(jax.random.key(4), table.shape)
  eps = 1e-2
  numeric = (loss(table + eps * u) - loss(table - eps * u)) / (2 * eps)
  np.testing.assert_allclose(jnp.vdot(grad, u), numeric, rtol=2e-3)
  assert np.all(np.isfinite(grad)) and np.abs(grad).max() > 0


@pytest.mark.slow
@pytest.mark.parametrize("num_kv_heads", [K, 1])
def test_cached_attention_equals_attention_over_the_sequence(num_kv_heads, batch=3):
  """Prefill then one-token steps (RoPE, GQA/MQA, rows at different lengths) give the outputs of
  causal attention over each row's whole sequence. (Three rows: a batch of one is the same code
  path, and its row is one of these.)"""
  module = _attention(num_kv_heads, rope_theta=10000.0)
  # One compiled program per shape (whole, prefill, step), not each operation on its own.
  attn = nnx.jit(lambda x, cache=None: module(x, causal=True, cache=cache))
  total = 9
  x = jax.random.normal(jax.random.key(5), (batch, total, D))
  full, _ = attn(x)
  prompt = np.array([5, 3, 4][:batch])
  cache = KVCache.zeros(1, batch, 16, num_kv_heads, H, jnp.float32).layer(0)
  # Prefill the first 5 columns (rows shorter than 5 are right-padded: their tail is overwritten).
  out, cache = attn(x[:, :5], cache=cache)
  for row, n in enumerate(prompt):
    np.testing.assert_allclose(out[row, :n], full[row, :n], rtol=1e-5, atol=1e-5)
  cache = cache.replace(lengths=jnp.asarray(prompt, jnp.int32))
  pos = prompt.copy()
  for _ in range(3):
    x_step = jnp.stack([x[row, p] for row, p in enumerate(pos)])[:, None]
    out, cache = attn(x_step, cache=cache)
    for row, p in enumerate(pos):
      np.testing.assert_allclose(out[row, 0], full[row, p], rtol=1e-5, atol=1e-5)
    pos = pos + 1
    cache = cache.replace(lengths=cache.lengths + 1)


def test_read_only_cache_equals_cross_attention():
  attn = _attention()
  x = jax.random.normal(jax.random.key(6), (2, 3, D))
  enc = jax.random.normal(jax.random.key(7), (2, 6, D))
  valid = jnp.asarray([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
  want, _ = attn(x, enc, kv_valid=valid)
  k, v = attn.project_kv(enc)
  cache = KVCache.read_only(k[None], v[None], valid)
  got, same = attn(x, cache=cache.layer(0))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_equal(same, cache.layer(0))


@pytest.mark.parametrize("batch", [1, 3])
def test_kv_cache_write_read_and_take_rows(batch):
  s, kv = 8, 2
  cache = KVCache.zeros(1, batch, s, kv, H, jnp.float32).layer(0)
  lengths = np.array([2, 0, 5][:batch])
  cache = cache.replace(lengths=jnp.asarray(lengths, jnp.int32))
  new_k = np.random.RandomState(0).randn(batch, 3, kv, H).astype(np.float32)
  new_v = -new_k
  cache = cache.write(jnp.asarray(new_k), jnp.asarray(new_v))
  chex.assert_shape(cache.k[0], (batch * kv, s, H))
  k, v = cache.read()
  want = np.zeros((batch, s, kv, H), np.float32)
  for row, n in enumerate(lengths):
    want[row, n : n + 3] = new_k[row]
  np.testing.assert_array_equal(k, want)
  np.testing.assert_array_equal(v, -want)
  rows = np.array([batch - 1, 0, 0])
  picked = cache.take_rows(jnp.asarray(rows))
  assert picked.shape == (1, 3, s, kv, H)
  np.testing.assert_array_equal(picked.read()[0], want[rows])
  np.testing.assert_array_equal(picked.lengths, lengths[rows])
