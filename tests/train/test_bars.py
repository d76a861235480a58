"""check_bars: the bars that set a figure against a baseline, their figures and their lines."""

from types import SimpleNamespace

import pytest

from transformer_jax.train import bars as bars_lib


def test_over_baseline_bars_report_figure_baseline_margin_and_pass(monkeypatch, capsys):
  monkeypatch.setattr(bars_lib, "most_frequent_token_accuracy", lambda run: 0.2)
  run = SimpleNamespace(
    exp=SimpleNamespace(bars={"mlm_accuracy_over_baseline": 0.1, "accuracy_over_majority": "0.05"}),
    dataset=SimpleNamespace(meta={"majority_baseline": {"val_accuracy": 0.5}}),
  )
  results = bars_lib.check_bars(run, None, {"val_mlm_accuracy": 0.35, "val_accuracy": 0.52})
  assert list(results) == ["mlm_accuracy_over_baseline", "accuracy_over_majority"]
  mlm = results["mlm_accuracy_over_baseline"]
  assert list(mlm) == ["mlm_accuracy", "most_frequent_token_baseline", "required_margin", "passed"]
  assert mlm == {
    "mlm_accuracy": 0.35,
    "most_frequent_token_baseline": 0.2,
    "required_margin": 0.1,
    "passed": True,
  }
  majority = results["accuracy_over_majority"]
  assert list(majority) == ["val_accuracy", "majority_baseline", "required_margin", "passed"]
  assert majority["required_margin"] == pytest.approx(0.05) and majority["passed"] is False
  out = capsys.readouterr().out.splitlines()
  assert out == [
    "learning bar mlm_accuracy_over_baseline: reached (mlm_accuracy=0.35, "
    "most_frequent_token_baseline=0.2, required_margin=0.1)",
    "learning bar accuracy_over_majority: NOT reached (val_accuracy=0.52, "
    "majority_baseline=0.5, required_margin=0.05)",
  ]
