"""The trainer's own pieces on 8 devices: data parallelism equals one device.

The run's plan (dataset, loader, the experiment's optimizer), dropout and gradient accumulation
(``train.microbatches``), one device against all 8 on a ``data`` mesh, for each task.
"""

import jax
import numpy as np
import pytest

from transformer_jax import models, parallel
from transformer_jax.train import load_experiment, make_plan
from transformer_jax.train import step as step_lib

MODELS = {
  "gpt": {
    "preset": "gpt2-tiny",
    "d_model": 32,
    "num_layers": 2,
    "num_heads": 2,
    "d_ff": 64,
    "max_len": 32,
    "dropout_rate": 0.1,
  },
  "bert": {"preset": "bert-tiny", "d_model": 32, "num_heads": 2, "d_ff": 64, "max_len": 32},
  "seq2seq": {"preset": "t5-tiny", "d_model": 32, "d_ff": 64},
}


def _train(exp, plan, devices, steps=4):
  """Losses of ``steps`` steps and the sum of |params| after them, on a data mesh of ``devices``."""
  mesh = parallel.make_mesh({"data": -1}, devices)
  loader = plan.loader
  params = models.init(plan.model_config, jax.random.key(0))
  state = jax.device_put(step_lib.create_state(params, plan.optimizer), step_lib.replicated(mesh))
  graphdef = models.graphdef(plan.model_config, mesh)  # the layers run on this mesh
  step = step_lib.jit_train_step(
    step_lib.make_train_step(
      graphdef, plan.task, plan.optimizer, seed=0, microbatches=exp.train.microbatches
    ),
    mesh,
    state,
  )
  losses = []
  for s in range(steps):
    state, m = step(state, step_lib.shard_batch(loader.batch_at(s), mesh, plan.task.keys))
    losses.append(float(m["loss"]))
  param_sum = float(sum(np.abs(np.asarray(x)).sum() for x in jax.tree.leaves(state.params)))
  return np.array(losses), param_sum


@pytest.mark.parametrize("task", list(MODELS))
def test_data_parallel_on_8_devices_equals_one_device(
  tmp_path, text_dataset, reverse_dataset, task
):
  dataset = reverse_dataset if task == "seq2seq" else text_dataset
  exp = load_experiment(
    None,
    raw={
      "run_dir": str(tmp_path / "r"),
      "model": MODELS[task],
      "data": {"path": dataset, "task": task},
      "train": {"batch_size": 16, "seq_len": 32, "lr": 3e-3, "warmup_steps": 1, "microbatches": 2},
    },
  )
  plan = make_plan(exp)
  one_losses, one_sum = _train(exp, plan, jax.devices()[:1])
  eight_losses, eight_sum = _train(exp, plan, jax.devices())
  assert len(jax.devices()) == 8
  np.testing.assert_allclose(eight_losses, one_losses, rtol=1e-5)
  np.testing.assert_allclose(eight_sum, one_sum, rtol=1e-5)
  assert one_losses[-1] < one_losses[0]
