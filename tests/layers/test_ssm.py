"""Stacks of Mamba blocks (``layers.ssm.MixerStack``) in bfloat16: the scan over the layers
carries the float32 residual stream from a bfloat16 input, and gives the unrolled stack's result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax.layers.ssm import MambaKind, MixerBlockConfig, MixerStack

LAYERS = 2
U_BF16 = 2.0**-8  # bfloat16 keeps 8 significant bits


def _run(version, unroll, x):
  """The stack's output on ``x``, jitted (one program: no op-by-op dispatch)."""
  bf16 = dict(dtype="bfloat16", param_dtype="bfloat16")
  kind = MambaKind(version, 16, 32, 4, 4, head_dim=8, chunk_size=4, **bf16)
  cfg = MixerBlockConfig(d_model=16, norm_eps=1e-5, mamba=kind, **bf16)
  stack = MixerStack(cfg, ("mamba",) * LAYERS, unroll=unroll, rngs=nnx.Rngs(0))
  return nnx.jit(lambda m, x: m(x)[0])(stack, x)


@pytest.mark.parametrize("version", [1, 2])
def test_scanned_bfloat16_stack_carries_the_float32_residual(version):
  x = jax.random.normal(jax.random.key(1), (2, 6, 16), jnp.bfloat16)  # the embedding's dtype
  scanned = _run(version, False, x)
  unrolled = _run(version, True, x)
  assert scanned.dtype == unrolled.dtype == jnp.float32  # residual_in_fp32
  assert np.all(np.isfinite(np.asarray(scanned)))
  # The same operations, looped or not: where their float32 values differ in the last bits, a
  # bfloat16 rounding of an activation can land one unit (up to 2 * U_BF16 relative) apart; about
  # four such roundings per block (normed input, projections, mixer output), and blocks add up.
  want = np.asarray(unrolled)
  atol = 2 * U_BF16 * 4 * LAYERS * np.abs(want).max()
  np.testing.assert_allclose(np.asarray(scanned), want, atol=atol, rtol=0)
