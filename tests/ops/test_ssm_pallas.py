"""The Pallas TPU kernel of Mamba-2's chunked scan (``ops.ssm_pallas``), run in Pallas' TPU
interpreter: the numbers of ``ops.ssd`` forward and backward, and a Mamba-2 model asking for it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax import models, ops
from transformer_jax.ops import ssm_pallas
from tests.ops.test_ssm import m2_inputs


@pytest.mark.slow
def test_the_kernel_equals_the_pure_form_with_every_mask_and_a_ragged_tail():
  """Groups, a clamp, an initial state, padding, packed segments and 13 positions in chunks of 4:
  outputs, final state and gradients as ``ops.ssd``. (About 15 s on 2 busy cores: the
  interpreter runs every program of the grid.)"""
  x, dt, A, B, C, D = m2_inputs(3, t=13)
  seg = np.zeros((2, 13), np.int32)
  seg[0, 7:] = 1
  seg[1, 10:] = 4
  valid = np.ones((2, 13), bool)
  valid[1, 11:] = False
  h0 = np.random.default_rng(0).standard_normal((2, 4, 3, 5)).astype(np.float32)
  kw = dict(
    chunk_size=4,
    return_state=True,
    time_step_limit=(0.05, 1.5),
    initial_state=h0,
    valid=valid,
    segment_ids=seg,
  )
  w = np.random.default_rng(1).standard_normal(x.shape).astype(np.float32)

  def loss(fn):
    def f(x, dt, B, C):
      y, h = fn(x, dt, A, B, C, D, **kw)
      return jnp.sum(y * w) + jnp.sum(h)

    return f

  # Each compiled whole: op by op, JAX would compile every operation of the grid on its own.
  (y1, h1), (y2, h2) = (
    jax.jit(lambda *a: ssm_pallas.ssd(*a, interpret=True, **kw))(x, dt, A, B, C, D),
    jax.jit(lambda *a: ops.ssd(*a, **kw))(x, dt, A, B, C, D),
  )
  np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h1, h2, rtol=1e-5, atol=1e-5)
  g1 = jax.jit(
    jax.grad(loss(lambda *a, **k: ssm_pallas.ssd(*a, interpret=True, **k)), argnums=(0, 1, 2, 3))
  )(x, dt, B, C)
  g2 = jax.jit(jax.grad(loss(ops.ssd), argnums=(0, 1, 2, 3)))(x, dt, B, C)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_mamba2_model_with_the_kernel_computes_what_xla_does():
  config = models.get_config("mamba2-tiny", vocab_size=61, num_layers=1, ssm_chunk=8, init_std=0.3)
  params = models.init(config, jax.random.key(0))
  toks = np.random.default_rng(2).integers(0, 61, (1, 19))
  xla = models.apply(config, params, toks)
  pallas = models.apply(
    models.get_config(
      "mamba2-tiny", vocab_size=61, num_layers=1, ssm_chunk=8, init_std=0.3, ssm_impl="pallas"
    ),
    params,
    toks,
  )
  np.testing.assert_allclose(pallas, xla, rtol=1e-5, atol=1e-5)
  assert ssm_pallas.choose_ssd_implementation("tpu") in ssm_pallas.SSD_IMPLEMENTATIONS


@pytest.mark.slow
def test_bad_shapes_are_refused_by_name():
  x, dt, A, B, C, D = m2_inputs(4, t=8)
  with pytest.raises(ValueError, match="ssd shapes"):
    ssm_pallas.ssd(x, dt[:, :, :3], A, B, C, D, interpret=True)


@pytest.mark.slow
def test_the_kernel_differentiates_inside_a_scan_with_traced_masks():
  """Layers scanned (``jax.lax.scan``, what a TPU does with a stack of layers) with the masks
  traced in the loop: the gradient of two steps of the kernel equals the pure form's."""
  x, dt, A, B, C, D = m2_inputs(5, b=1, t=8, n=2, hd=3, g=1, s=4)
  seg = np.zeros((1, 8), np.int32)
  seg[0, 5:] = 1

  def loss(fn):
    def f(x, seg, valid):
      def body(h, _):
        y = fn(h, dt, A, B, C, D, chunk_size=4, valid=valid, segment_ids=seg)
        return jnp.tanh(y), None

      return jnp.sum(jax.lax.scan(body, x, None, length=2)[0] ** 2)

    return jax.jit(jax.grad(f))

  valid = np.ones((1, 8), bool)
  got = loss(lambda *a, **k: ssm_pallas.ssd(*a, interpret=True, **k))(x, seg, valid)
  np.testing.assert_allclose(got, loss(ops.ssd)(x, seg, valid), rtol=1e-5, atol=1e-5)
