"""``train.make_step``: the library's tuned step trains as the plain jitted step does."""

import jax
import numpy as np
import pytest

import transformer_jax as tj
from transformer_jax import models
from transformer_jax.train import step as step_lib

CONFIG = models.get_config(
  "gpt2-tiny",
  d_model=32,
  num_layers=2,
  num_heads=2,
  d_ff=64,
  max_len=16,
  vocab_size=64,
  dropout_rate=0.0,
)


def _batch(seed=0, b=4, t=16):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, CONFIG.vocab_size, (b, t + 1), dtype=np.int32)
  segments = np.where(np.arange(t) < t // 2, 1, 2).astype(np.int32)  # two documents a row
  positions = np.where(segments == 1, np.arange(t), np.arange(t) - t // 2).astype(np.int32)
  return {
    "tokens": tokens[:, :-1],
    "labels": tokens[:, 1:],
    "segment_ids": np.tile(segments, (b, 1)),
    "positions": np.tile(positions, (b, 1)),
    "loss_mask": np.ones((b, t), bool),
  }


def _plain_steps(optimizer, params, batches):
  """The untuned reference: ``make_train_step`` under a bare ``jax.jit`` on the default backend's
  model, from ``params``; the losses and the final parameters."""
  step = jax.jit(
    step_lib.make_train_step(
      models.graphdef(CONFIG), step_lib.tasks_lib.get_task("gpt"), optimizer, seed=0
    )
  )
  state, losses = step_lib.create_state(params, optimizer), []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  return losses, state.params


@pytest.mark.parametrize("microbatches", [1, 2])
def test_make_step_trains_as_the_plain_step(microbatches):
  optimizer = tj.train.make_optimizer(tj.train.TrainConfig(lr=1e-2, warmup_steps=0, steps=10))
  step = tj.train.make_step(CONFIG, optimizer, microbatches=microbatches)
  state = step.init(jax.random.key(0))
  start = jax.device_get(state.params)
  batches = [_batch(s) for s in range(3)]
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
  assert step.microbatches == microbatches and step.compiled is not None
  want_losses, want_params = _plain_steps(optimizer, start, batches)
  np.testing.assert_allclose(losses, want_losses, rtol=2e-5)
  # Adam moves every parameter by about lr a step: oneDNN's rounding moves near-zero gradients'
  # updates by a small fraction of it.
  for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(want_params)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-3, atol=2e-4)
  # The first loss is the uniform guess's at initialisation, about log V.
  assert abs(losses[0] - np.log(CONFIG.vocab_size)) < 0.5


def test_make_step_resolves_auto_and_refuses_what_does_not_fit():
  optimizer = tj.train.make_optimizer(tj.train.TrainConfig(warmup_steps=0))
  step = tj.train.make_step(CONFIG, optimizer)
  assert step.microbatches == "auto"
  step.compile(step.init(jax.random.key(1)), _batch())
  assert step.microbatches == 1  # under pytest the allocator is glibc: no rule
  with pytest.raises(ValueError, match="microbatches=0: expected a count >= 1 or 'auto'"):
    tj.train.make_step(CONFIG, optimizer, microbatches=0)
  with pytest.raises(ValueError, match="task='bert' does not fit a GPTConfig"):
    tj.train.make_step(CONFIG, optimizer, task="bert")
  with pytest.raises(ValueError, match="the batch has no loss_mask: task 'gpt' takes"):
    step.shard({k: v for k, v in _batch().items() if k != "loss_mask"})
