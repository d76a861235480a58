"""Linformer attention (``ops.linformer``) against float64 NumPy, and full attention at R = S."""

import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import ops
from transformer_jax.ops.linformer import linformer_attention
from tests.ops.test_chunked_attention import assert_close, inputs


def reference(q, k, v, e, f, kv_valid=None):
  q, k, v, e, f = (np.asarray(a, np.float64) for a in (q, k, v, e, f))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  if kv_valid is not None:
    keep = np.asarray(kv_valid, np.float64)[:, :, None, None]
    k, v = k * keep, v * keep
  s = k.shape[1]
  kp = np.repeat(np.einsum("rs,bskh->brkh", e[:, :s], k), g, axis=2)
  vp = np.repeat(np.einsum("rs,bskh->brkh", f[:, :s], v), g, axis=2)
  logits = np.einsum("btnh,brnh->bntr", q, kp) / np.sqrt(h)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bntr,brnh->btnh", p, vp)


def test_identity_projections_at_full_rank_equal_full_attention():
  q, k, v, _ = inputs(0, t=24, s=24)
  eye = jnp.eye(24)
  got = linformer_attention(q, k, v, eye)
  assert_close(got, ops.dot_product_attention(q, k, v, implementation="xla"))
  assert_close(got, reference(q, k, v, np.eye(24), np.eye(24)))


def test_projections_padding_and_a_longer_table_match_numpy():
  q, k, v, _ = inputs(1, t=20, s=20)
  r = np.random.default_rng(1)
  e, f = r.standard_normal((6, 32)) * 0.2, r.standard_normal((6, 32)) * 0.2
  kv_valid = np.arange(20)[None] < np.array([[20], [13]])
  got = linformer_attention(
    q,
    k,
    v,
    jnp.asarray(e, jnp.float32),
    jnp.asarray(f, jnp.float32),
    kv_valid=jnp.asarray(kv_valid),
  )
  assert_close(got, reference(q, k, v, e, f, kv_valid))


def test_bad_projections_are_named():
  q, k, v, _ = inputs(2, t=20, s=20)
  with pytest.raises(ValueError, match="e_RS must be"):
    linformer_attention(q, k, v, jnp.ones((4, 10)))
  with pytest.raises(ValueError, match="same rows"):
    linformer_attention(q, k, v, jnp.ones((4, 20)), jnp.ones((5, 20)))
