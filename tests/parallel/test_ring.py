"""Tests for ``transformer_jax.parallel.ring``: ring attention equals full attention.

Compared with ``ops.dot_product_attention`` run unsharded (outputs and gradients) and with an
independent float64 NumPy reference, on 8 simulated CPU devices (see conftest.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from transformer_jax import ops
from transformer_jax.parallel.ring import ring_attention

TOL = dict(rtol=1e-5, atol=1e-5)


def make_mesh(axis_types=None, **sizes: int) -> Mesh:
  devices = np.asarray(jax.devices()).reshape(tuple(sizes.values()))
  if axis_types is None:
    return Mesh(devices, tuple(sizes))
  return Mesh(devices, tuple(sizes), axis_types=(axis_types,) * len(sizes))


def make_qkv(seed: int, *, b: int, t: int, n: int, k: int, h: int, dtype=jnp.float32):
  """Random q ``[B,T,N,H]``, k and v ``[B,T,K,H]`` and an output cotangent ``[B,T,N,H]``."""
  rng = np.random.default_rng(seed)
  shapes = ((b, t, n, h), (b, t, k, h), (b, t, k, h), (b, t, n, h))
  return tuple(jnp.asarray(rng.standard_normal(s), dtype) for s in shapes)


def out_and_grads(attn, q, k, v, cotangent):
  """``attn(q, k, v)`` and the gradients of ``sum(out * cotangent)`` wrt q, k and v, jitted."""

  def loss(q, k, v):
    out = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32) * cotangent), out

  grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


def full_attention(*, causal=False, kv_mask=None, segment_ids=None):
  """``ops.dot_product_attention`` with the masks ring attention takes, on unsharded arrays."""
  mask = None
  if kv_mask is not None:
    mask = ops.padding_mask(kv_mask)
  if segment_ids is not None:
    mask = ops.and_masks(mask, ops.segment_mask(segment_ids))
  return lambda q, k, v: ops.dot_product_attention(q, k, v, mask=mask, causal=causal)


def ring(mesh, **kw):
  return lambda q, k, v: ring_attention(q, k, v, mesh=mesh, **kw)


def assert_matches_full(mesh, q, k, v, cotangent, **kw):
  """Ring and full attention agree on the output and on the gradients wrt q, k and v."""
  out, grads = out_and_grads(ring(mesh, **kw), q, k, v, cotangent)
  ref_out, ref_grads = out_and_grads(
    full_attention(
      causal=kw.get("causal", False),
      kv_mask=kw.get("kv_mask_BS"),
      segment_ids=kw.get("segment_ids_BT"),
    ),
    q,
    k,
    v,
    cotangent,
  )
  np.testing.assert_allclose(out, ref_out, **TOL)
  for name, g, ref_g in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(g, ref_g, **TOL, err_msg=f"gradient wrt {name}")
  return out, grads


def attention_f64(q, k, v, *, kv_mask=None, causal=False):
  """softmax(q k^T / sqrt(H)) v in float64 with K/V heads repeated; a row with no key gives 0."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  b, t, n, h = q.shape
  k = np.repeat(k, n // k.shape[2], axis=2)  # query head i uses kv head i // G
  v = np.repeat(v, n // v.shape[2], axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
  allowed = np.ones((b, 1, t, t), bool)
  if kv_mask is not None:
    allowed = allowed & np.asarray(kv_mask, bool)[:, None, None, :]
  if causal:
    allowed = allowed & np.tri(t, dtype=bool)
  logits = np.where(allowed, logits, -np.inf)
  row_max = logits.max(-1, keepdims=True)
  e = np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0)) * allowed
  denom = e.sum(-1, keepdims=True)
  weights = e / np.where(denom > 0, denom, 1.0)
  return np.einsum("bnts,bsnh->btnh", weights, v)


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_matches_full_attention(causal):
  # 4096 tokens in 8 blocks of 512, on a mesh with every project axis (the others of size 1).
  mesh = make_mesh(data=1, fsdp=1, tensor=1, sequence=8)
  q, k, v, cot = make_qkv(0, b=1, t=4096, n=2, k=2, h=16)
  assert_matches_full(mesh, q, k, v, cot, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_matches_float64_reference_with_gqa_and_padding(causal):
  mesh = make_mesh(sequence=8)  # no batch or head axes at all: they are left out of the specs
  q, k, v, _ = make_qkv(1, b=2, t=64, n=4, k=2, h=8)
  kv_mask = np.random.default_rng(1).random((2, 64)) > 0.25
  out = ring_attention(q, k, v, mesh=mesh, causal=causal, kv_mask_BS=jnp.asarray(kv_mask))
  np.testing.assert_allclose(out, attention_f64(q, k, v, kv_mask=kv_mask, causal=causal), **TOL)


# MQA under causal masking is also covered by test_heads_over_tensor_axis[mqa-heads-replicated].
@pytest.mark.parametrize("kv_heads,causal", [(2, True), (1, False)], ids=["gqa-causal", "mqa"])
def test_gqa_and_mqa_match_full_attention(kv_heads, causal):
  mesh = make_mesh(sequence=8)
  q, k, v, cot = make_qkv(2, b=2, t=256, n=4, k=kv_heads, h=8)
  assert_matches_full(mesh, q, k, v, cot, causal=causal)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask_and_fully_padded_rows_give_zeros(causal):
  mesh = make_mesh(sequence=8)
  q, k, v, cot = make_qkv(3, b=3, t=128, n=2, k=2, h=8)
  kv_mask = np.ones((3, 128), bool)
  kv_mask[0, :40] = False  # causal: queries 0..39 of row 0 see no real key (past one block)
  kv_mask[1, 100:] = False  # right padding
  kv_mask[2] = False  # every key padded
  out, grads = assert_matches_full(
    mesh, q, k, v, cot, causal=causal, kv_mask_BS=jnp.asarray(kv_mask)
  )
  np.testing.assert_array_equal(out[2], 0.0)
  for g in grads:
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(g[2], 0.0)
  if causal:
    np.testing.assert_array_equal(out[0, :40], 0.0)


def test_segment_ids_match_segment_mask():
  mesh = make_mesh(sequence=8)
  q, k, v, cot = make_qkv(4, b=2, t=128, n=2, k=1, h=8)
  # Packed sequences whose boundaries fall inside and across the 16-token blocks.
  segments = np.stack([np.repeat([0, 1, 2], [50, 30, 48]), np.repeat([0, 1], [7, 121])])
  assert_matches_full(mesh, q, k, v, cot, causal=True, segment_ids_BT=jnp.asarray(segments))


def test_batch_sharded_over_data_axis_under_jit():
  mesh = make_mesh(data=2, sequence=4)
  q, k, v, cot = make_qkv(5, b=4, t=256, n=2, k=2, h=8)
  # Inputs laid out the way GSPMD activations would be; the function is called inside jit.
  q, k, v = (jax.device_put(a, NamedSharding(mesh, P("data", "sequence"))) for a in (q, k, v))
  out, _ = assert_matches_full(mesh, q, k, v, cot, causal=True)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "sequence")), 4)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["heads-sharded", "mqa-heads-replicated"])
def test_heads_over_tensor_axis(kv_heads):
  mesh = make_mesh(data=1, tensor=2, sequence=4)
  q, k, v, cot = make_qkv(6, b=2, t=128, n=4, k=kv_heads, h=8)
  out, _ = assert_matches_full(mesh, q, k, v, cot, causal=True)
  head = "tensor" if kv_heads == 2 else None  # one kv head cannot be split over 2 devices
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "sequence", head)), 4)


def test_explicit_mesh_returns_output_sharded_like_q():
  mesh = make_mesh(AxisType.Explicit, data=2, sequence=4)
  q, k, v, _ = make_qkv(7, b=2, t=64, n=2, k=2, h=8)
  q = jax.device_put(q, NamedSharding(mesh, P("data")))
  out = jax.jit(ring(mesh, causal=True))(q, k, v)
  np.testing.assert_allclose(out, full_attention(causal=True)(q, k, v), **TOL)
  assert out.sharding.is_equivalent_to(q.sharding, 4)


def test_mesh_from_set_mesh_and_bfloat16():
  mesh = make_mesh(data=2, sequence=4)
  q, k, v, _ = make_qkv(8, b=2, t=64, n=2, k=2, h=8, dtype=jnp.bfloat16)
  with jax.set_mesh(mesh):
    out = jax.jit(lambda q, k, v: ring_attention(q, k, v, causal=True))(q, k, v)
  assert out.dtype == jnp.bfloat16
  ref = attention_f64(q, k, v, causal=True)
  np.testing.assert_allclose(out.astype(jnp.float32), ref, rtol=2e-2, atol=2e-2)


def test_length_not_divisible_by_sequence_axis_raises():
  mesh = make_mesh(sequence=8)
  q, k, v, _ = make_qkv(9, b=1, t=100, n=2, k=2, h=8)
  with pytest.raises(ValueError, match=r"T=100 .*size 8 .*'sequence'"):
    ring_attention(q, k, v, mesh=mesh)


@pytest.mark.parametrize(
  "shapes,kw,message",
  [
    (((1, 16, 2, 8), (1, 16, 2, 8), (1, 16, 1, 8)), {}, "must be equal"),
    (((1, 16, 2, 8), (1, 32, 2, 8), (1, 32, 2, 8)), {}, "T=16 must equal key length S=32"),
    (((1, 16, 3, 8), (1, 16, 2, 8), (1, 16, 2, 8)), {}, "multiple of key/value heads"),
    (((2, 16, 2, 8), (1, 16, 2, 8), (1, 16, 2, 8)), {}, "share batch B and head dim H"),
    (((1, 16, 2, 8), (1, 16, 2), (1, 16, 2)), {}, "must be 4-D"),
    (
      ((1, 16, 2, 8), (1, 16, 2, 8), (1, 16, 2, 8)),
      {"kv_mask_BS": np.ones((1, 8), bool)},
      r"kv_mask_BS.shape=\(1, 8\)",
    ),
    (
      ((1, 16, 2, 8), (1, 16, 2, 8), (1, 16, 2, 8)),
      {"segment_ids_BT": np.zeros((16,), int)},
      r"segment_ids_BT.shape=\(16,\)",
    ),
  ],
  ids=["k-v", "t-s", "heads", "batch", "ndim", "kv-mask", "segments"],
)
def test_mismatched_shapes_raise(shapes, kw, message):
  q, k, v = (jnp.zeros(s) for s in shapes)
  with pytest.raises(ValueError, match=message):
    ring_attention(q, k, v, mesh=make_mesh(sequence=8), **kw)


def test_mesh_problems_raise():
  q, k, v, _ = make_qkv(10, b=3, t=16, n=2, k=2, h=8)
  with pytest.raises(ValueError, match="seq_axis='sequence' is not an axis"):
    ring_attention(q, k, v, mesh=make_mesh(data=8))
  with pytest.raises(ValueError, match=r"batch B=3 is not divisible by 2"):
    ring_attention(q, k, v, mesh=make_mesh(data=2, sequence=4))
  with pytest.raises(ValueError, match="cannot also be a batch axis"):
    ring_attention(q, k, v, mesh=make_mesh(sequence=8), batch_axes=("sequence",))
  with pytest.raises(ValueError, match="needs a mesh"):
    ring_attention(q, k, v)
