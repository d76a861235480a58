"""The CPU backend's row-major dense core (``backends.cpu.attention``) against float64, and where
the backend gives it to the dense kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import backends, ops
from transformer_jax.backends import CpuBackend
from transformer_jax.backends.cpu import attention as cpu_attention
from transformer_jax.ops import dispatch
from tests.backends import only_on
from tests.backends.cpu.test_matmul import assert_bf16_dots_in_library_kernel
from tests.ops.test_attention import _grads_f64, make_qkv

BF16_UNITS = CpuBackend(bf16_units=True)


@pytest.mark.slow
@only_on("cpu", "XLA:CPU's bfloat16 kernel (the row-major core)")
@pytest.mark.parametrize("n,k,causal,h", [(4, 4, True, 16), (4, 2, True, 12), (4, 1, False, 16)])
def test_bf16_rowmajor_core_matches_float64(n, k, causal, h):
  # The bfloat16 CPU path (every product row-major, four of them transposed, the weights kept in
  # bfloat16): values and the gradients of q, k, v and the bias against float64, within
  # bfloat16's rounding, with a padding mask that leaves one query row with no key. The scale
  # 1 / sqrt(h) is a power of two (folded into q) for h = 16, not for h = 12.
  b, t, s = 2, 6, 8
  q, kk, v = make_qkv(50 + n + k, b=b, t=t, s=s, n=n, k=k, h=h, dtype=jnp.bfloat16)
  rng = np.random.default_rng(51)
  bias = jnp.asarray(rng.standard_normal((1, n, t, s)), jnp.float32)
  mask = np.ones((b, 1, t, s), bool)
  mask[1, :, :, :3] = False
  mask[1, 0, 0] = False  # row (1, 0) sees no key
  mask = jnp.asarray(mask)
  w = rng.standard_normal((b, t, n, h))
  core = BF16_UNITS.dense_core(q, kk, v)
  assert core is cpu_attention.rowmajor_attention

  def loss(q_, k_, v_, b_):
    out = ops.dot_product_attention(
      q_, k_, v_, bias=b_, mask=mask, causal=causal, implementation="xla", dense_core=core
    )
    return jnp.sum(out.astype(jnp.float32) * jnp.asarray(w, jnp.float32)), out

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
  (_, out), grads = grad(q, kk, v, bias)
  ref_out, ref_grads = _grads_f64(q, kk, v, bias, mask, w, causal)
  assert out.dtype == jnp.bfloat16 and [g.dtype for g in grads[:3]] == [jnp.bfloat16] * 3
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, atol=3e-2, rtol=3e-2)
  for name, g, ref in zip("qkvb", grads, ref_grads):
    scale = np.abs(ref).max()
    err = np.abs(np.asarray(g, np.float32) - ref).max()
    assert err <= 2e-2 * scale, (name, err, scale)
  assert np.all(np.asarray(out, np.float32)[1, 0, 0] == 0.0)  # the row with no key
  # Every product stays bfloat16 in XLA:CPU's kernel.
  assert_bf16_dots_in_library_kernel(grad.lower(q, kk, v, bias).compile().as_text(), 6)


def test_bf16_rowmajor_core_only_where_its_copies_exist():
  # The row-major copies split a dim by a small factor: a prime length keeps the heads-major core.
  q, kk, v = make_qkv(52, t=6, s=8, dtype=jnp.bfloat16)
  takes = functools.partial(cpu_attention.rowmajor_core_takes, bf16_units=True)
  assert takes(q, kk, v)
  assert not takes(*make_qkv(52, t=5, s=7, n=4, k=4, dtype=jnp.bfloat16))
  assert not takes(q.astype(jnp.float32), kk.astype(jnp.float32), v.astype(jnp.float32))
  assert not takes(q, kk, v.astype(jnp.float32))
  assert not cpu_attention.rowmajor_core_takes(q, kk, v, bf16_units=False)
  assert BF16_UNITS.dense_core(q, kk, v) is cpu_attention.rowmajor_attention
  assert CpuBackend(bf16_units=False).dense_core(q, kk, v) is None
  for platform in ("gpu", "tpu"):  # the CPU core is never given elsewhere
    assert backends.for_platform(platform).dense_core(q, kk, v) is None


def test_the_table_keeps_bf16_dense_past_the_chunked_threshold(monkeypatch):
  # Where the row-major core runs (bfloat16, bf16 units), the backend's choice stays "xla" past
  # AUTO_CHUNKED_MIN_TS while the weights fit AUTO_DENSE_BF16_MAX_BYTES, and without dropout.
  monkeypatch.setattr(dispatch, "AUTO_CHUNKED_MIN_TS", 6 * 8)
  monkeypatch.setattr(CpuBackend, "chunk_block", 4)  # several blocks of the short inputs
  q, kk, v = make_qkv(53, b=2, t=6, s=8, n=4, k=2, dtype=jnp.bfloat16)

  def attend(q_, k_, v_, **kw):
    return np.asarray(
      jax.jit(lambda q_, k_, v_: BF16_UNITS.attention(q_, k_, v_, causal=True, **kw))(q_, k_, v_),
      np.float32,
    )

  xla = attend(q, kk, v, implementation="xla")
  by_blocks = attend(q, kk, v, implementation="chunked")
  assert not np.array_equal(xla, by_blocks)  # the kernels round bfloat16 differently
  np.testing.assert_array_equal(attend(q, kk, v), xla)
  monkeypatch.setattr(dispatch, "AUTO_DENSE_BF16_MAX_BYTES", 2 * 4 * 6 * 8 * 2 - 1)
  np.testing.assert_array_equal(attend(q, kk, v), by_blocks)
  choose = functools.partial(BF16_UNITS.choose_attention, causal=True)
  monkeypatch.setattr(dispatch, "AUTO_DENSE_BF16_MAX_BYTES", 2 * 4 * 6 * 8 * 2)
  assert choose(q, kk, v, dropout=False) == "xla"
  assert choose(q, kk, v, dropout=True) == "chunked"
  f32 = [x.astype(jnp.float32) for x in (q, kk, v)]
  assert choose(*f32, dropout=False) == "chunked"
  assert CpuBackend(bf16_units=False).choose_attention(q, kk, v, causal=True) == "chunked"
