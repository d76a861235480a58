"""``backends.splash``, the Pallas TPU splash-attention kernel, against a float64 NumPy reference.

Off TPU the kernel runs in Pallas interpret mode: the same kernel body, block structure and custom
backward (separate dq and dkv kernels), executed by XLA. The cases cross several 128-row blocks, so
fully masked blocks are skipped and partial blocks are masked element by element, forward and
backward, for causal, sliding-window, segment-id, grouped- and multi-query attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.backends import splash

# Float32 kernel against float64: max |error| / max |reference| per array.
TOL = 1e-5
# bfloat16 inputs and output (8-bit mantissa, ulp 2**-7 near 1), and bfloat16 probabilities in the
# kernel's products with v and do: about half an ulp (2e-3 to 4e-3 in test_bfloat16).
BF16_TOL = 1e-2


def valid_mask(b, t, s, *, causal=False, window=None, q_seg=None, kv_seg=None):
  """``[B, T, S]`` bool, True = attend; query ``i`` sits at position ``S - T + i``, key ``j`` at
  ``j``."""
  q_pos = (np.arange(t) + s - t)[:, None]
  k_pos = np.arange(s)[None, :]
  valid = np.ones((b, t, s), bool)
  if causal:
    valid &= k_pos <= q_pos
  if window is not None:
    valid &= np.abs(q_pos - k_pos) < window
  if q_seg is not None:
    kv_seg = q_seg if kv_seg is None else kv_seg
    valid &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
  return valid


def reference(q, k, v, do, valid, scale=None):
  """Float64 ``out = softmax(scale q k^T, masked) v`` and the gradients of ``sum(out * do)``."""
  q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
  b, t, n, h = q.shape
  g = n // k.shape[2]
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head n reads kv head n // G
  scale = h**-0.5 if scale is None else scale
  assert valid.any(-1).all(), "every query must see a key"
  logits = np.where(valid[:, None], np.einsum("btnh,bsnh->bnts", q, kr) * scale, -np.inf)
  e = np.exp(logits - logits.max(-1, keepdims=True))
  p = e / e.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsnh->btnh", p, vr)
  dp = np.einsum("btnh,bsnh->bnts", do, vr)
  ds = p * (dp - (p * dp).sum(-1, keepdims=True))
  dq = np.einsum("bnts,bsnh->btnh", ds, kr) * scale
  dk = np.einsum("bnts,btnh->bsnh", ds, q).reshape(b, -1, n // g, g, h).sum(3) * scale
  dv = np.einsum("bnts,btnh->bsnh", p, do).reshape(b, -1, n // g, g, h).sum(3)
  return out, dq, dk, dv


def inputs(seed, *, b=1, t=256, s=256, n=4, kh=2, h=64, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  arrs = (
    r.standard_normal((b, t, n, h)),
    r.standard_normal((b, s, kh, h)),
    r.standard_normal((b, s, kh, h)),
    r.standard_normal((b, t, n, h)),
  )
  return tuple(jnp.asarray(a, dtype) for a in arrs)


def splash_value_and_grads(q, k, v, do, **kw):
  """``out`` and the gradients of ``sum(out * do)`` wrt q, k and v (jitted, like a model step)."""

  def loss(q, k, v):
    out = splash.splash_attention(q, k, v, **kw)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def assert_close(actual, expected, tol=TOL, name=""):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
  assert np.all(np.isfinite(actual)), name
  err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
  assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def check(
  q, k, v, do, *, causal=False, window=None, q_seg=None, kv_seg=None, scale=None, tol=TOL, **kw
):
  b, t, _, _ = q.shape
  s = k.shape[1]
  out, (dq, dk, dv) = splash_value_and_grads(
    q,
    k,
    v,
    do,
    causal=causal,
    window=window,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    scale=scale,
    **kw,
  )
  assert out.dtype == q.dtype
  valid = valid_mask(b, t, s, causal=causal, window=window, q_seg=q_seg, kv_seg=kv_seg)
  ref = reference(q, k, v, do, valid, scale=scale)
  for name, a, e in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), ref):
    assert_close(a, e, tol, name)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_causal_and_bidirectional_gqa(causal):
  check(*inputs(0, b=2, n=4, kh=2), causal=causal)


def test_causal_mqa():
  check(*inputs(1, n=4, kh=1), causal=True)


def test_causal_sliding_window_skips_blocks():
  # Query block 2 (rows 256..383) sees keys 157.. only: key block 0 is skipped, 1 is partial.
  check(*inputs(2, t=384, s=384, n=2, kh=1, h=128), causal=True, window=100)


def test_two_sided_window():
  check(*inputs(3, t=384, s=384, n=2, kh=2), window=100)


@pytest.mark.slow
def test_packed_segments_with_causal_gqa():
  # Document boundaries off the block edges, different per example.
  q_seg = np.zeros((2, 256), np.int32)
  q_seg[0, 90:] = 1
  q_seg[0, 200:] = 2
  q_seg[1, 150:] = 7
  check(*inputs(4, b=2, n=4, kh=2), causal=True, q_seg=jnp.asarray(q_seg))


def test_queries_aligned_to_the_end_of_longer_keys():
  # T=128 queries at key positions 128..255, as when attending to a cache: causal and window.
  check(*inputs(5, t=128, s=256, n=2, kh=1), causal=True, window=160)
  kv_seg = np.repeat(np.array([[0, 1]], np.int32), 128, axis=1)
  check(
    *inputs(6, t=128, s=256, n=2, kh=1),
    q_seg=jnp.ones((1, 128), jnp.int32),
    kv_seg=jnp.asarray(kv_seg),
  )


def test_scale_and_explicit_block_sizes():
  from jax.experimental.pallas.ops.tpu.splash_attention import BlockSizes

  data = inputs(7, n=2, kh=2)
  check(*data, causal=True, scale=0.3, block_sizes=(128, 256))
  # splash's own BlockSizes without backward blocks: they are filled from the forward ones.
  check(*data, causal=True, block_sizes=BlockSizes(block_q=256, block_kv=128))


def test_bfloat16():
  q, k, v, do = inputs(8, n=2, kh=1, dtype=jnp.bfloat16)
  check(q, k, v, do, causal=True, tol=BF16_TOL)


def test_default_blocks_divide_the_lengths():
  assert splash._default_block(384, "T") == 384
  assert splash._default_block(640, "T") == 128
  assert splash._default_block(1536, "S") == 512
  assert splash._default_block(768, "S") == 384


@pytest.mark.parametrize(
  "part,words",
  [
    (dict(bias=jnp.zeros((1, 2, 256, 256))), "bias"),
    (dict(kv_valid=jnp.ones((1, 256), bool)), "kv_valid"),
    (dict(q_positions=jnp.arange(256)), "q_positions"),
    (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "attention dropout"),
    (dict(return_weights=True), "return_weights"),
  ],
)
def test_the_attention_entry_names_the_parts_splash_does_not_take(part, words):
  q, k, v, _ = inputs(10, n=2, kh=2)
  with pytest.raises(ValueError, match=f"implementation='splash' does not take {words}"):
    splash.attention(q, k, v, causal=True, **part)


def test_the_attention_entry_is_the_kernel_on_the_parts_it_takes():
  q, k, v, _ = inputs(11, n=2, kh=2)
  ids = jnp.asarray(np.repeat(np.array([[0, 1]]), 128, axis=1), jnp.int32)
  np.testing.assert_array_equal(
    np.asarray(splash.attention(q, k, v, causal=True, q_segment_ids=ids)),
    np.asarray(splash.splash_attention(q, k, v, causal=True, q_segment_ids=ids)),
  )


def test_clear_errors():
  q, k, v, _ = inputs(9, n=2, kh=2)
  with pytest.raises(ValueError, match="T to be a multiple of 128; got T=200"):
    splash.splash_attention(q[:, :200], k[:, :200], v[:, :200])
  with pytest.raises(ValueError, match="S to be a multiple of 128; got S=200"):
    splash.splash_attention(q, k[:, :200], v[:, :200])
  with pytest.raises(
    ValueError, match="block_q=96 must be a positive multiple of 128 that divides T=256"
  ):
    splash.splash_attention(q, k, v, block_sizes=96)
  with pytest.raises(ValueError, match="block_kv=384 .* divides S=256"):
    splash.splash_attention(q, k, v, block_sizes=(128, 384))
  with pytest.raises(ValueError, match="block_sizes must be"):
    splash.splash_attention(q, k, v, block_sizes="big")
  with pytest.raises(ValueError, match=r"N=2 must be a multiple of key/value heads K=3"):
    splash.splash_attention(q, jnp.zeros((1, 256, 3, 64)), jnp.zeros((1, 256, 3, 64)))
  with pytest.raises(ValueError, match="float32 or bfloat16; got q.dtype=float16"):
    splash.splash_attention(q.astype(jnp.float16), k, v)
  with pytest.raises(ValueError, match="window=0 must be an int >= 1"):
    splash.splash_attention(q, k, v, causal=True, window=0)
  with pytest.raises(ValueError, match="T=256 > S=128"):
    splash.splash_attention(q, k[:, :128], v[:, :128], causal=True)
  with pytest.raises(ValueError, match=r"q_segment_ids must be \[1, 256\]; got shape \(256,\)"):
    splash.splash_attention(q, k, v, q_segment_ids=jnp.zeros((256,), jnp.int32))
  with pytest.raises(ValueError, match="kv_segment_ids needs q_segment_ids"):
    splash.splash_attention(q, k, v, kv_segment_ids=jnp.zeros((1, 256), jnp.int32))
  with pytest.raises(ValueError, match="q_segment_ids must be integer"):
    splash.splash_attention(q, k, v, q_segment_ids=jnp.zeros((1, 256), jnp.float32))
  if jax.default_backend() != "tpu":
    with pytest.raises(ValueError, match="interpret=False needs a TPU"):
      splash.splash_attention(q, k, v, interpret=False)


def test_missing_pallas_modules_raise_a_clear_import_error(monkeypatch):
  monkeypatch.setattr(splash, "_KERNEL_MODULE", "jax.experimental.pallas.ops.tpu.moved_away")
  q, k, v, _ = inputs(10, n=2, kh=2)
  with pytest.raises(ImportError, match="splash attention needs .*moved_away.*'chunked' or 'xla'"):
    splash.splash_attention(q, k, v)
