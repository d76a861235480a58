"""The divergence guard: the checkpoint a stopped run calls good evaluates to a finite loss.

A learning rate of 1e9 on a tiny GPT: Adam's first update moves every weight by about 1e9, the loss
of the next step is NaN. Those parameters are finite, so only their loss shows they are bad.
"""

import math
import os
import re

import pytest

from transformer_jax import runs
from transformer_jax.train import TrainingDiverged, evaluate_run, train
from tests.train.test_reliability import _exp


def _diverge(run_dir, dataset, **overrides):
  exp = _exp(
    run_dir,
    dataset,
    steps=20,
    lr=1e9,
    schedule="constant",
    checkpoint_every=1,
    log_every=1,
    eval_every=1000,
    **overrides,
  )
  with pytest.raises(TrainingDiverged) as info:
    train(exp, progress=False)
  return str(info.value)


def test_the_checkpoint_whose_parameters_gave_the_nan_is_set_aside(tmp_path, text_dataset):
  run_dir = tmp_path / "r"
  message = _diverge(run_dir, text_dataset, warmup_steps=0)
  # Step 1's parameters (finite, of order 1e9) gave the NaN loss of step 2: not a good checkpoint.
  assert message.startswith(
    "loss became nan at step 2; stopping. Checkpoint step 1 gives "
    "non-finite losses: set aside as diverged-1 in "
  ), message
  assert message.endswith("No good checkpoint remains."), message
  assert runs.RunDir(run_dir).checkpoint_steps() == []
  assert os.path.isdir(run_dir / "checkpoints" / "diverged-1")
  with pytest.raises(ValueError, match="no checkpoint found"):
    evaluate_run(str(run_dir))


def test_the_last_good_checkpoint_named_evaluates_to_a_finite_loss(tmp_path, text_dataset):
  # Two warmup steps: step 1 moves nothing (learning rate 0), step 2 by about 5e8.
  run_dir = tmp_path / "r"
  message = _diverge(run_dir, text_dataset, warmup_steps=2)
  match = re.search(
    r"at step (\d+).*\(step (\d+)\) is intact \(validation loss (\S+)\)\.$", message
  )
  assert match, message
  bad, good, val_loss = int(match[1]), int(match[2]), float(match[3])
  assert good < bad and runs.RunDir(run_dir).checkpoint_steps()[-1] == good
  result = evaluate_run(str(run_dir))
  assert result["step"] == good and math.isfinite(result["val_loss"])
  assert result["val_loss"] == pytest.approx(val_loss, rel=1e-3)
