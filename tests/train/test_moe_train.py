"""Training a mixture of experts with ``tjax train``'s path: router metrics in metrics.jsonl, a
resumed run equal to an uninterrupted one, and experiments/moe_tiny.yaml valid as written."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest

from transformer_jax import models
from transformer_jax.train import load_experiment, train
from tests.train.test_mamba_train import _exp, _losses, _params

MODEL = {
  "preset": "moe-tiny", "d_model": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
  "num_experts": 4, "experts_per_token": 2, "expert_d_ff": 32, "max_len": 32,
  "router_aux_coef": 0.05, "router_z_coef": 0.01,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.long
def test_a_resumed_moe_run_equals_an_uninterrupted_one(tmp_path, text_dataset):
  """6 steps straight, and 4 steps then 2 more from the step-4 checkpoint: the same losses, router
  counts and bitwise the same parameters (three short runs)."""
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  assert train(_exp(straight, text_dataset, MODEL), progress=False)["step"] == 6
  assert train(_exp(resumed, text_dataset, MODEL, steps=4), progress=False)["step"] == 4
  assert train(_exp(resumed, text_dataset, MODEL), progress=False)["step"] == 6
  losses = _losses(straight)
  assert np.all(np.isfinite(losses)) and losses == _losses(resumed)
  (a, step_a), (b, step_b) = _params(straight), _params(resumed)
  assert step_a == step_b == 6
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with open(os.path.join(straight, "metrics.jsonl")) as f:
    lines = [r for r in map(json.loads, f) if "loss" in r]
  for r in lines:
    counts = np.asarray(r["moe_tokens_per_expert"])
    assert counts.shape == (2, 4) and (counts.sum(-1) == 4 * 32 * 2).all()  # B * T * k
    want = r["lm_loss"] + 0.05 * r["moe_balance_loss"] + 0.01 * r["moe_router_z_loss"]
    assert abs(r["loss"] - want) < 1e-4 * abs(want)
    assert r["moe_dropped_fraction"] == 0.0


def test_the_moe_yaml_loads_and_names_a_learning_bar():
  path = pathlib.Path(__file__).parents[2] / "experiments" / "moe_tiny.yaml"
  exp = load_experiment(str(path), [])
  config = exp.model_config(vocab_size=4096)
  assert isinstance(config, models.GPTConfig) and config.num_experts == 8
  assert exp.bars == {"val_loss_below_unigram": 1.0}
  pc = models.param_count(config)
  assert pc.active < pc.total
