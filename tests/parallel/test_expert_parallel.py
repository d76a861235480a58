"""Expert parallelism on 8 simulated devices: experts split over the ``expert`` mesh axis, tokens
exchanged by all-to-all, equal to one device (forward, gradients, a train step)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import transformer_jax as tj
from tests.parallel.test_dry_run import _config, _tjax
from transformer_jax import parallel
from transformer_jax.layers.moe import MoE, MoEKind
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks

D, F, E = 8, 12, 8


def layer(mesh, top_k=2):
  kind = MoEKind(num_experts=E, top_k=top_k, d_ff=F)
  return MoE(
    D, kind, activation="silu", init_std=0.3, out_init_std=0.3, dtype=jnp.float32,
    param_dtype=jnp.float32, rngs=nnx.Rngs(0), mesh=mesh,
  )  # fmt: skip


def test_a_mesh_has_the_expert_axis_only_where_it_splits_something():
  """A dense model's mesh keeps the four axes it had before experts existed, so its programs
  (sharding annotations included) stay the same; an expert mesh has the fifth axis."""
  dense = parallel.make_mesh({"data": 2, "fsdp": 4})
  assert dense.axis_names == ("data", "fsdp", "tensor", "sequence")
  assert parallel.batch_sharding(dense).spec == jax.sharding.PartitionSpec(("data", "fsdp"))
  assert parallel.batch_shards(dense.shape) == 8
  moe = parallel.make_mesh({"data": 2, "expert": 4})
  assert moe.axis_names == ("data", "fsdp", "tensor", "sequence", "expert")
  assert moe.shape["expert"] == 4 and parallel.batch_shards(moe.shape) == 8
  spec = parallel.batch_sharding(moe).spec
  assert spec == jax.sharding.PartitionSpec(("data", "fsdp", "expert"))


@pytest.mark.parametrize(
  "shape", [{"expert": 8}, {"data": 2, "expert": 4}, {"expert": 2, "tensor": 4}]
)
def test_expert_parallel_layer_equals_one_device(shape):
  mesh = parallel.make_mesh({"data": 1, **shape})
  x = jnp.asarray(np.random.default_rng(1).standard_normal((8, 6, D)), jnp.float32)
  cot = jnp.asarray(np.random.default_rng(2).standard_normal((8, 6, D)), jnp.float32)
  one, split = layer(None), layer(mesh)

  def grads(gdef):
    def loss(state, x):
      y, stats = nnx.merge(gdef, state)(x)
      return jnp.sum(y * cot), (y, stats)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))

  gdef1, state1 = nnx.split(one)
  (_, (y1, s1)), g1 = grads(gdef1)(state1, x)
  gdef, state = nnx.split(split)
  state = jax.device_put(state, parallel.param_shardings(state, mesh))
  assert state["gate"][...].sharding.spec[0] == "expert"
  x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
    tuple(a for a in ("data", "expert") if mesh.shape.get(a, 1) > 1)
  )))  # fmt: skip

  (_, (y8, s8)), g8 = grads(gdef)(state, x_sharded)
  # The same products in another order of rows: float32 rounding only.
  np.testing.assert_allclose(np.asarray(y8), np.asarray(y1), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(
    np.asarray(s8["tokens_per_expert"]), np.asarray(s1["tokens_per_expert"])
  )
  for name in ("gate", "up", "down"):
    np.testing.assert_allclose(
      np.asarray(g8[name][...]), np.asarray(g1[name][...]), rtol=1e-4, atol=1e-6
    )
  np.testing.assert_allclose(
    np.asarray(g8["router"]["kernel"][...]), np.asarray(g1["router"]["kernel"][...]), rtol=1e-4,
    atol=1e-6,
  )  # fmt: skip


def test_expert_parallel_sends_by_all_to_all():
  mesh = parallel.make_mesh({"data": 1, "expert": 8})
  gdef, state = nnx.split(layer(mesh))
  x = jnp.zeros((16, 4, D))
  hlo = jax.jit(lambda s, x: nnx.merge(gdef, s)(x)[0]).lower(state, x).as_text()
  assert "all_to_all" in hlo or "all-to-all" in hlo


def test_train_step_on_expert_mesh_equals_one_device():
  cfg = tj.models.GPTConfig(
    vocab_size=64, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_len=16, position="rope",
    norm="rmsnorm", activation="silu", gated=True, use_bias=False, tie_embeddings=False,
    num_experts=8, experts_per_token=2, expert_d_ff=8, init_std=0.2,
  )  # fmt: skip
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 12)), jnp.int32)
  batch = dict(
    tokens=tok, labels=tok, segment_ids=jnp.ones_like(tok),
    positions=jnp.broadcast_to(jnp.arange(12), (8, 12)), loss_mask=jnp.ones((8, 12), bool),
  )  # fmt: skip
  opt = optax.adam(1e-2)
  out = {}
  for shape in ({"data": 1}, {"data": 2, "expert": 4}):
    mesh = parallel.make_mesh(shape, jax.devices()[: 1 if len(shape) == 1 else 8])
    parallel.check_config(cfg, mesh, batch_size=8)
    graphdef = tj.models.graphdef(cfg, mesh)
    state = step_lib.init_state(cfg, opt, mesh, jax.random.key(0))
    step = step_lib.jit_train_step(
      step_lib.make_train_step(graphdef, tasks.GPTTask(), opt, seed=0), mesh, state
    )
    for _ in range(2):
      state, metrics = step(state, step_lib.shard_batch(batch, mesh))
    out[len(shape)] = jax.device_get((state.params, metrics))
  (p1, m1), (p8, m8) = out[1], out[2]
  np.testing.assert_allclose(m8["loss"], m1["loss"], rtol=1e-5)
  np.testing.assert_array_equal(m8["moe_tokens_per_expert"], m1["moe_tokens_per_expert"])
  for a, b in zip(jax.tree.leaves(p8), jax.tree.leaves(p1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_experts_must_divide_over_the_expert_axis():
  mesh = parallel.make_mesh({"data": 1, "expert": 8})
  cfg = dataclasses.replace(
    tj.models.get_config("gpt2-small"), gated=True, num_experts=6, activation="silu", use_bias=False
  )
  with pytest.raises(ValueError, match="num_experts=6 is not divisible by mesh.expert=8"):
    parallel.check_config(cfg, mesh)


def test_dry_run_shows_the_expert_exchange(tmp_path):
  moe = {
    "gated": True,
    "activation": "silu",
    "mlp_bias": False,
    "num_experts": 8,
    "expert_d_ff": 64,
  }
  config = _config(tmp_path, {"data": 2, "expert": 4}, moe)
  out = _tjax("train", config, "--dry-run")
  assert out.returncode == 0, out.stderr
  assert "mesh data=2 x fsdp=1 x tensor=1 x sequence=1 x expert=4 on 8 simulated devices" in (
    out.stdout
  )
  # 16 x 64 tokens over 8 devices: 128 each, 2 copies each, 4 chunks of 256 rows.
  assert "experts: 8 (2 per device), top-2 of 128 tokens per device; all-to-all of [4, 256, D]" in (
    out.stdout
  )
