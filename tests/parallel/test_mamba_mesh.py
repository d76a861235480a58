"""Mamba, Mamba-2 and hybrid models train on a mesh exactly as on one device (the rules table
shards every parameter by its logical axes), and the dry run names what each layer runs."""

import functools

import jax
import numpy as np
import optax
import pytest

from transformer_jax import models, parallel
from transformer_jax.train import load_experiment
from transformer_jax.train import dry_run as dry
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from tests.parallel.test_strategies import MESHES, STEPS, VOCAB, _batch

CONFIGS = {
  "mamba": ("mamba-tiny", dict(d_model=32, ssm_chunk=8)),
  "mamba2": ("mamba2-tiny", dict(d_model=32, ssm_head_dim=8, ssm_groups=2, ssm_chunk=8)),
  "hybrid": ("hybrid-tiny", dict(d_model=32, num_heads=4, num_kv_heads=2, d_ff=48, ssm_chunk=8)),
}
MATRIX = [
  ("mamba", "data2_fsdp2_tensor2"),
  ("mamba2", "fsdp8"),
  ("hybrid", "data2_fsdp2_tensor2"),
  ("hybrid", "sequence8"),
]


def _train(name, mesh):
  preset, overrides = CONFIGS[name]
  config = models.get_config(preset, vocab_size=VOCAB, **overrides)
  task = tasks_lib.get_task("gpt")
  optimizer = optax.sgd(0.5)
  state = step_lib.place_state(
    step_lib.create_state(models.init(config, jax.random.key(0)), optimizer), mesh
  )
  fn = step_lib.jit_train_step(
    step_lib.make_train_step(models.graphdef(config, mesh), task, optimizer, seed=0), mesh, state
  )
  losses = []
  for s in range(STEPS):
    state, metrics = fn(state, step_lib.shard_batch(_batch("gpt", s), mesh, task.keys))
    losses.append(float(metrics["loss"]))
  return np.array(losses), jax.device_get(state.params), state


@functools.lru_cache(maxsize=None)
def _reference(name):
  return _train(name, parallel.make_mesh({"data": 1}, jax.devices()[:1]))


@pytest.mark.parametrize("name,mesh_name", MATRIX)
def test_same_training_as_one_device(name, mesh_name):
  ref_losses, ref_params, _ = _reference(name)
  losses, params, state = _train(name, parallel.make_mesh(MESHES[mesh_name]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  for (path, got), want in zip(
    jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref_params)
  ):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  if "tensor" in MESHES[mesh_name] and name == "mamba":
    # Mamba-1's channels are split over tensor like an MLP's columns.
    flat = {
      jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state.params)
    }
    kernel = next(v for k, v in flat.items() if "in_proj" in k and "kernel" in k)
    assert "tensor" in str(kernel.sharding.spec)


def test_dry_run_names_the_mixer_of_each_layer(tmp_path):
  raw = {
    "run_dir": str(tmp_path / "run"),
    "model": {"preset": "hybrid-tiny", "layer_types": ["mamba", "attention", "mamba"]},
    "data": {"path": str(tmp_path / "no-data"), "task": "gpt"},
    "train": {"batch_size": 8, "seq_len": 64},
    "mesh": {"fsdp": 8},
  }
  report = dry.dry_run(load_experiment(None, [], raw=raw))
  text = dry.format_report(report)
  assert "layers 0, 2: mamba1 mixer, ops.selective_scan" in text
  assert "ops.causal_conv1d, width 4" in text
  assert "self-attention" in text
  assert not (tmp_path / "run").exists()
