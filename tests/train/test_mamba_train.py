"""Training Mamba and hybrid models with ``tjax train``'s path: packed batches (segment ids restart
the state), a run resumed from its checkpoint equal to an uninterrupted one, and the experiment
YAMLs under experiments/ valid as written."""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
import yaml

from transformer_jax import models
from transformer_jax.runs import restore_params
from transformer_jax.train import load_experiment, train
from tests.train.test_reliability import _raw

MODELS = {
  "hybrid": {
    "preset": "hybrid-tiny",
    "d_model": 32,
    "num_heads": 2,
    "num_kv_heads": 1,
    "d_ff": 48,
    "ssm_chunk": 8,
    "num_layers": 2,
    "layer_types": ["mamba", "attention"],
  },
}


def _exp(run_dir, dataset, model, **train_overrides):
  raw = _raw(run_dir, dataset, **train_overrides)
  raw["model"] = dict(model)
  return load_experiment(None, [], raw=raw)


def _losses(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _params(run_dir):
  with open(os.path.join(run_dir, "model.yaml")) as f:
    cfg = models.config_from_dict(yaml.safe_load(f))
  return restore_params(os.path.join(run_dir, "checkpoints"), cfg)


@pytest.mark.slow
@pytest.mark.long
def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path, text_dataset):
  """A hybrid (Mamba and attention blocks): 6 steps straight, and 4 steps then 2 more from the
  step-4 checkpoint: the same losses and bitwise the same parameters. (Three runs: about 40 s on
  2 busy cores.)"""
  model = MODELS["hybrid"]
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  assert train(_exp(straight, text_dataset, model), progress=False)["step"] == 6
  assert train(_exp(resumed, text_dataset, model, steps=4), progress=False)["step"] == 4
  assert train(_exp(resumed, text_dataset, model), progress=False)["step"] == 6
  losses = _losses(straight)
  assert np.all(np.isfinite(losses)) and losses == _losses(resumed)
  (a, step_a), (b, step_b) = _params(straight), _params(resumed)
  assert step_a == step_b == 6
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("yaml_name", ["mamba_tiny.yaml", "hybrid_tiny.yaml"])
def test_the_experiment_yamls_load_and_name_a_learning_bar(yaml_name):
  path = pathlib.Path(__file__).parents[2] / "experiments" / yaml_name
  exp = load_experiment(str(path), [])
  config = exp.model_config(vocab_size=4096)
  assert isinstance(config, models.MambaConfig)
  assert exp.bars == {"val_loss_below_unigram": 1.0}
  if yaml_name.startswith("hybrid"):
    assert set(config.layer_kinds) == {"mamba", "attention"}
