"""The conformance suite's 1 vs 8 devices, for every registered kind (tests/conformance/kinds.py):
the forward pass of a ragged, padded batch on 8 simulated devices (data x fsdp x tensor, the
parameters sharded by the rules table, the batch over data and fsdp) equals one device's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.conformance import harness as h
from tests.conformance.kinds import DECODER, KINDS, MASK
from transformer_jax import models, parallel

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
ROWS = 8


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_eight_devices_give_one_devices_logits(kind):
  config = kind.config()
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, h.WIDTH + 1, ROWS)
  tokens, mask, positions = h.ragged(rng, lengths)
  if not kind.has(MASK):
    mask = None
  kw = dict(positions=positions) if kind.has(DECODER) else {}
  params = h.params(config)
  one = h.forward(kind, config, tokens, mask, **kw)

  mesh = parallel.make_mesh(MESH)
  shardings = parallel.param_shardings(params, mesh)
  graphdef = models.graphdef(config, mesh)
  batch = parallel.batch_sharding(mesh)

  @jax.jit
  def run(p, tokens, mask, positions):
    return h.call(
      kind, nnx.merge(graphdef, p), tokens, mask, positions=positions if kind.has(DECODER) else None
    )

  def put(x):
    return None if x is None else jax.device_put(jnp.asarray(x), batch)

  eight = run(jax.device_put(params, shardings), put(tokens), put(mask), put(positions))
  assert len(eight.sharding.device_set) == 8
  real = np.ones_like(tokens, bool) if mask is None else mask
  # Sharded sums add their partial sums in another order: harness.bound says by how much.
  np.testing.assert_allclose(
    np.asarray(eight)[real], one[real], atol=h.bound(config, one[real]), rtol=0
  )
