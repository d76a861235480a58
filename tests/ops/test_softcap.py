"""Soft-capped attention logits (Gemma 2: ``c * tanh(x / c)`` before the bias and the mask) in the
"xla" and "chunked" kernels and splash attention (Pallas interpret mode off TPU), forward and
backward, against a float64 NumPy reference whose gradients are written out; and the kernel
table's fall-back from cuDNN, which takes no soft-cap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import backends, ops
from transformer_jax.backends import splash

# Float32 kernels against float64: max |error| / max |reference| per array (float32 products
# over H = 8 and softmax over S <= 37 lose a few ulps; 1e-5 is ~100 float32 ulps).
TOL = 1e-5


def reference(q, k, v, do, *, cap, valid, bias=None):
  """Float64 ``out = softmax(cap * tanh(scale q k^T / cap) + bias, valid) V`` and the gradients
  of ``sum(out * do)`` wrt q, k, v and the bias, by hand."""
  q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  raw = np.einsum("btnh,bsnh->bnts", q, kr) * h**-0.5
  th = np.tanh(raw / cap)
  logits = cap * th + (0.0 if bias is None else np.asarray(bias, np.float64))
  logits = np.where(valid, logits, -np.inf)
  e = np.where(valid, np.exp(logits - logits.max(-1, keepdims=True)), 0.0)
  p = e / e.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p, vr)
  dp = np.einsum("btnh,bsnh->bnts", do, vr)
  ds = p * (dp - (p * dp).sum(-1, keepdims=True))  # d(capped + bias): the bias's gradient
  dr = ds * (1.0 - th**2) * h**-0.5  # through the cap and the scale
  dq = np.einsum("bnts,bsnh->btnh", dr, kr)
  dk = np.einsum("bnts,btnh->bsnh", dr, q).reshape(b, -1, n // g, g, h).sum(3)
  dv = np.einsum("bnts,btnh->bsnh", p, do).reshape(b, -1, n // g, g, h).sum(3)
  return out, dq, dk, dv, ds


def _rel(x, ref):
  return float(np.max(np.abs(np.asarray(x, np.float64) - ref)) / np.max(np.abs(ref)))


def _inputs(t=37, n=4, kh=2, h=8, big=4.0):
  rng = np.random.default_rng(0)
  # Large logits (|scale q k| up to ~30) so the cap bends them: tanh is far from linear there.
  q = rng.normal(size=(2, t, n, h)).astype(np.float32) * big
  k = rng.normal(size=(2, t, kh, h)).astype(np.float32) * big
  v = rng.normal(size=(2, t, kh, h)).astype(np.float32)
  do = rng.normal(size=(2, t, n, h)).astype(np.float32)
  return q, k, v, do


@pytest.mark.parametrize("impl", ["xla", "chunked"])
@pytest.mark.parametrize("window", [None, 7])
def test_softcap_matches_float64_reference_with_gradients(impl, window):
  q, k, v, do = _inputs()
  t = q.shape[1]
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  valid = (j <= i) & ((i - j) < window if window else True)
  bias = np.random.default_rng(1).normal(size=(1, 4, t, t)).astype(np.float32)
  cap = 5.0
  *ref, ds = reference(q, k, v, do, cap=cap, valid=valid[None, None], bias=bias)
  ref.append(ds.sum(0, keepdims=True))  # the bias broadcasts over the batch

  def f(q, k, v, bias):
    out = ops.dot_product_attention(
      q,
      k,
      v,
      bias=bias,
      causal=True,
      window=window,
      softcap=cap,
      implementation=impl,
      block_q=8,
      block_k=5,
    )
    return jnp.sum(out * do), out

  grads, out = jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
  for got, want in zip((out, *grads), ref):
    assert _rel(got, want) < TOL


def test_softcap_changes_the_output():
  """The cap is applied: the same call without it differs by far more than the tolerance."""
  q, k, v, _ = _inputs()
  capped = ops.dot_product_attention(q, k, v, causal=True, softcap=5.0, implementation="xla")
  plain = ops.dot_product_attention(q, k, v, causal=True, implementation="xla")
  assert _rel(capped, np.asarray(plain, np.float64)) > 1e-2


def test_softcap_weights_match_reference():
  q, k, v, do = _inputs(t=9)
  valid = np.tril(np.ones((9, 9), bool))[None, None]
  _, w = ops.dot_product_attention(
    q, k, v, causal=True, softcap=3.0, implementation="xla", return_weights=True
  )
  out = ops.dot_product_attention(q, k, v, causal=True, softcap=3.0, implementation="xla")
  assert _rel(out, reference(q, k, v, do, cap=3.0, valid=valid)[0]) < TOL
  assert np.allclose(np.asarray(w).sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("softcap", [0.0, -1.0])
def test_softcap_refuses_non_positive(softcap):
  q, k, v, _ = _inputs(t=4)
  with pytest.raises(ValueError, match="softcap"):
    ops.dot_product_attention(q, k, v, softcap=softcap)


def _shapes(t, dtype, h=64):
  q = jax.ShapeDtypeStruct((1, t, 4, h), dtype)
  return q, jax.ShapeDtypeStruct((1, t, 4, h), dtype)


def test_table_falls_back_from_cudnn_and_keeps_splash_under_softcap():
  q, k = _shapes(1024, jnp.bfloat16)
  assert ops.choose_implementation(q, k, k, platform="gpu", causal=True) == "cudnn"
  assert ops.choose_implementation(q, k, k, platform="gpu", causal=True, softcap=True) == "xla"
  assert ops.choose_implementation(q, k, k, platform="tpu", causal=True, softcap=True) == "splash"


def test_splash_softcap_matches_float64_reference_with_gradients():
  """Splash's ``attn_logits_soft_cap`` through the backend's call: 256 = two blocks of 128."""
  q, k, v, do = _inputs(t=256, n=2, kh=1, h=8, big=2.0)
  q, k, v, do = (x[:1] for x in (q, k, v, do))
  valid = np.tril(np.ones((256, 256), bool))[None, None]
  ref = reference(q, k, v, do, cap=5.0, valid=valid)[:4]

  def f(q, k, v):
    out = splash.attention(q, k, v, causal=True, softcap=5.0)
    return jnp.sum(out * do), out

  grads, out = jax.jit(jax.grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  for got, want in zip((out, *grads), ref):
    assert _rel(got, want) < TOL


def test_table_takes_no_ring_under_softcap():
  q, k = _shapes(256, jnp.float32)
  assert ops.choose_implementation(q, k, k, platform="gpu", sequence_shards=2) == "ring"
  assert ops.choose_implementation(q, k, k, platform="gpu", sequence_shards=2, softcap=True) in (
    "xla",
    "chunked",
  )


def test_backend_refuses_cudnn_with_softcap():
  q, k, v, _ = _inputs(t=4)
  with pytest.raises(ValueError, match="soft-cap"):
    backends.current().attention(q, k, v, softcap=5.0, implementation="cudnn")


def test_backend_passes_softcap_to_its_kernel():
  q, k, v, do = _inputs(t=11)
  valid = np.tril(np.ones((11, 11), bool))[None, None]
  out = backends.current().attention(q, k, v, causal=True, softcap=5.0)
  assert _rel(out, reference(q, k, v, do, cap=5.0, valid=valid)[0]) < TOL
