"""Resuming with another ``train.steps``: a decaying schedule is re-planned, and the run says so."""

import pytest

from transformer_jax.train import learning_rate_schedule, train
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.state import schedule_notice
from tests.train.test_reliability import _exp


def test_more_steps_on_a_cosine_schedule_print_the_learning_rate_change(
  tmp_path, text_dataset, capfd
):
  run_dir = tmp_path / "r"
  common = dict(schedule="cosine", warmup_steps=1, lr=3e-3, checkpoint_every=2, eval_every=2)
  train(_exp(run_dir, text_dataset, steps=2, **common), progress=False)
  capfd.readouterr()
  assert train(_exp(run_dir, text_dataset, steps=4, **common), progress=False)["step"] == 4
  out = capfd.readouterr().out
  before = float(learning_rate_schedule(TrainConfig(steps=2, **common))(2))
  after = float(learning_rate_schedule(TrainConfig(steps=4, **common))(2))
  assert before != pytest.approx(after)
  line = (
    "notice: train.steps changed from 2 to 4: the cosine schedule is re-planned over 4 "
    f"steps, so at the resume point (step 2) the learning rate goes from {before:.3e} to "
    f"{after:.3e}"
  )
  assert out.count(line) == 1, out


def test_schedule_notice_only_for_a_schedule_that_depends_on_the_steps():
  cosine = dict(schedule="cosine", warmup_steps=10, lr=1e-3)
  assert (
    schedule_notice(TrainConfig(steps=100, **cosine), TrainConfig(steps=100, **cosine), 100) is None
  )
  assert "from 1.000e-04 to 5.872e-04" in schedule_notice(
    TrainConfig(steps=100, **cosine), TrainConfig(steps=200, **cosine), 100
  )
  for schedule in ("constant", "rsqrt"):
    same = dict(cosine, schedule=schedule)
    assert (
      schedule_notice(TrainConfig(steps=100, **same), TrainConfig(steps=200, **same), 100) is None
    )
