"""A mixture-of-experts GPT in the train step: router losses added to the loss and logged, tokens
per expert in the metrics, microbatches equal to the full batch, scan equal to the unrolled loop."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import transformer_jax as tj
from transformer_jax import lora
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks

CFG = tj.models.GPTConfig(
  vocab_size=64, d_model=16, num_layers=2, num_heads=2, d_ff=32, max_len=16, position="rope",
  norm="rmsnorm", activation="silu", gated=True, use_bias=False, tie_embeddings=False,
  num_experts=4, experts_per_token=2, expert_d_ff=8, router_aux_coef=0.1, router_z_coef=0.01,
  init_std=0.2,
)  # fmt: skip
B, T = 4, 12


def batch():
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 64, (B, T)), jnp.int32)
  mask = jnp.ones((B, T), bool).at[0, :5].set(False)
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  return dict(tokens=tok, labels=tok, segment_ids=jnp.ones_like(tok), positions=pos, loss_mask=mask)


def run_step(cfg, microbatches=1):
  graphdef, params = nnx.split(tj.models.GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  opt = optax.sgd(1.0)
  step = step_lib.make_train_step(graphdef, tasks.GPTTask(), opt, seed=0, microbatches=microbatches)
  state, metrics = jax.jit(step)(step_lib.create_state(params, opt), batch())
  return params, state.params, metrics


@pytest.fixture(scope="module")
def full():
  return run_step(CFG)


def test_router_losses_join_the_loss_and_metrics(full):
  _, _, m = full
  want = m["lm_loss"] + 0.1 * m["moe_balance_loss"] + 0.01 * m["moe_router_z_loss"]
  np.testing.assert_allclose(float(m["loss"]), float(want), rtol=1e-6)
  np.testing.assert_allclose(float(m["moe_aux_loss"]), float(want - m["lm_loss"]), rtol=1e-5)
  counts = np.asarray(m["moe_tokens_per_expert"])
  assert counts.shape == (2, 4)
  np.testing.assert_array_equal(counts.sum(-1), [B * T * 2] * 2)  # every copy of every token
  assert float(m["moe_dropped_fraction"]) == 0.0
  assert float(m["moe_balance_loss"]) >= 2.0 - 1e-6  # k at best: sum_e f_e P_e >= k / E


def test_balance_loss_moves_the_router(full):
  before, after, _ = full
  _, after_plain, _ = run_step(dataclasses.replace(CFG, router_aux_coef=0.0, router_z_coef=0.0))
  router = lambda p: np.asarray(p["blocks"]["layers"]["mlp"]["router"]["kernel"][...])  # noqa: E731
  step_aux = router(after) - router(before)
  step_plain = router(after_plain) - router(before)
  assert np.abs(step_aux - step_plain).max() > 1e-4  # the aux gradient reached the router
  # ...and not the last layer's experts (earlier layers feed its router through their output).
  gate = lambda p: np.asarray(p["blocks"]["layers"]["mlp"]["gate"][...])[-1]  # noqa: E731
  np.testing.assert_allclose(gate(after), gate(after_plain), rtol=1e-5, atol=1e-7)


def test_microbatches_match_the_full_batch_counts(full):
  _, _, m = full
  _, _, m2 = run_step(CFG, microbatches=2)
  np.testing.assert_array_equal(
    np.asarray(m2["moe_tokens_per_expert"]), np.asarray(m["moe_tokens_per_expert"])
  )
  np.testing.assert_allclose(float(m2["lm_loss"]), float(m["lm_loss"]), rtol=1e-6)


def test_scan_equals_unrolled_layers():
  tok = batch()["tokens"]
  out = {}
  for scan in (True, False):
    model = tj.models.GPT(dataclasses.replace(CFG, scan_layers=scan), rngs=nnx.Rngs(0))
    stats = []
    out[scan] = model(tok, moe_stats=stats), stats[0]
  np.testing.assert_allclose(np.asarray(out[True][0]), np.asarray(out[False][0]), atol=1e-6)
  for k in out[True][1]:
    np.testing.assert_allclose(np.asarray(out[True][1][k]), np.asarray(out[False][1][k]), rtol=1e-6)


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("num_experts", -1, "num_experts=-1"),
    ("experts_per_token", 5, "experts_per_token=5"),
    ("router_scoring", "tanh", "router_scoring='tanh'"),
    ("router_groups", 2, "router_groups=2 needs router_scoring"),
    ("capacity_factor", 0.0, "capacity_factor=0.0"),
    ("router_aux_coef", -0.1, "router_aux_coef=-0.1"),
    ("gated", False, "gated=True"),
    ("expert_d_ff", 0, "expert_d_ff=0"),
    ("mlp_bias", True, "mlp_bias=False"),
  ],
)
def test_bad_moe_fields_are_named(field, value, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(CFG, **{field: value})


@pytest.mark.parametrize("dense", [False, True], ids=["experts", "dense_layers"])
def test_lora_adapts_the_experts_and_merges_exactly(dense):
  """Dense layers among the expert layers (``dense_layers``): their MLP projections take the
  ``mlp_in``/``mlp_out`` adapters in their own stack, the expert layers the experts' adapters."""
  config = dataclasses.replace(CFG, dense_layers=[0]) if dense else CFG
  model = tj.models.GPT(config, rngs=nnx.Rngs(0))
  tok = batch()["tokens"]
  base = np.asarray(model(tok))
  targets = ("experts_in", "experts_out", "router") + (("mlp_in", "mlp_out") if dense else ())
  lora.add_adapters(model, lora.LoRAConfig(rank=2, targets=targets), rngs=nnx.Rngs(1))
  np.testing.assert_array_equal(np.asarray(model(tok)), base)  # B = 0: the base model
  graphdef, trainable, frozen = lora.split(model)
  names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
  for w in ("gate", "up", "down"):
    assert f"blocks/layers/mlp/adapters/{w}/lora_b" in names
    if dense:
      assert f"blocks/dense_layers/mlp/{w}/lora/lora/lora_b" in names
  assert "blocks/layers/mlp/router/lora/lora/lora_b" in names
  assert not any("/adapters/" in n for n in names if n.startswith("blocks/dense_layers"))
  # Random B: the adapted model differs from the base and equals its merged weights.
  trainable = jax.tree.map(
    lambda x: jax.random.normal(jax.random.key(2), x.shape, x.dtype) * 0.1, trainable
  )
  adapted = nnx.merge(graphdef, trainable, frozen)
  out = np.asarray(adapted(tok))
  assert np.abs(out - base).max() > 1e-3
  merged = nnx.merge(tj.models.graphdef(config), lora.merged_params(graphdef, trainable, frozen))
  np.testing.assert_allclose(np.asarray(merged(tok)), out, rtol=1e-5, atol=1e-5)
