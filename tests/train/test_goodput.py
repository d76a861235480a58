"""Where a run's time goes (``train.goodput``), its profile trace (``train.profile_steps``) and how
both reach ``final.json`` and the report."""

import glob
import json
import os
import shutil
import time

import pytest

from transformer_jax import runs
from transformer_jax.runs.schema import FieldError
from transformer_jax.train import goodput, load_experiment, train

MODEL = {
  "preset": "gpt2-tiny",
  "d_model": 32,
  "num_layers": 2,
  "num_heads": 2,
  "d_ff": 64,
  "max_len": 32,
  "dropout_rate": 0.0,
}
TRAIN = {
  "steps": 6,
  "batch_size": 4,
  "seq_len": 32,
  "warmup_steps": 2,
  "schedule": "constant",
  "log_every": 2,
  "eval_every": 6,
  "eval_batches": 2,
  "checkpoint_every": 2,
  "keep_checkpoints": 3,
  "samples": 0,
}


def _exp(run_dir, dataset, *overrides):
  raw = {
    "run_dir": str(run_dir),
    "model": dict(MODEL),
    "data": {"path": dataset, "task": "gpt"},
    "train": dict(TRAIN),
  }
  return load_experiment(None, list(overrides), raw=raw)


def _lines(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


class FakeTime:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_clock_splits_an_interval_and_the_step_is_what_is_left(monkeypatch):
  fake = FakeTime()
  monkeypatch.setattr(goodput.time, "perf_counter", fake)
  clock = goodput.Clock()
  with clock.timing("data"):
    fake.now += 2.0
  fake.now += 5.0  # dispatching and waiting for steps
  with clock.timing("eval"):
    fake.now += 3.0
  with clock.timing("checkpoint"):
    fake.now += 0.5
  assert clock.lap() == {
    "time_data": 2.0,
    "time_step": 5.0,
    "time_checkpoint": 0.5,
    "time_eval": 3.0,
    "time_log": 0.0,
  }
  with clock.timing("log"):
    fake.now += 1.0
  fake.now += 4.0
  assert clock.lap()["time_log"] == 1.0 and clock.lap()["time_step"] == 0.0
  with pytest.raises(ValueError, match="part='step'"):
    with clock.timing("step"):
      pass


def test_lost_and_summary_add_the_lines_by_hand():
  records = [
    {"step": 0, "time_startup": 4.0, "time_compile": 3.0, "time_lost": 0.0, "steps_lost": 0},
    {"step": 1, "loss": 2.0},
    {"step": 2, "loss": 2.0, "time_data": 1.0, "time_step": 3.0, "time_log": 0.5},
    {"step": 3, "loss": 2.0},
    {"step": 4, "loss": 2.0, "time_data": 0.25, "time_step": 2.0, "time_checkpoint": 1.0},
    {"step": 4, "val_loss": 2.0},
  ]
  assert goodput.lost(records, 2) == (2, 2.25)
  assert goodput.lost(records, 4) == (0, 0.0)
  records.append({"step": 2, "time_startup": 1.0, "time_lost": 2.25, "steps_lost": 2})
  s = goodput.summary(records)
  total = 4.0 + 1.25 + 5.0 + 1.0 + 0.5 + 1.0 + 2.25
  assert s["total_seconds"] == pytest.approx(total)
  assert s["goodput"] == pytest.approx(5.0 / total, abs=1e-4)
  assert s["seconds"] == {
    "startup": 5.0,
    "data": 1.25,
    "step": 5.0,
    "checkpoint": 1.0,
    "eval": 0.0,
    "log": 0.5,
    "lost": 2.25,
  }
  assert s["steps_lost"] == 2 and s["compile_seconds"] == 3.0
  assert goodput.summary([{"step": 1, "loss": 2.0}]) is None


@pytest.mark.parametrize("steps", [[3, 3], [4, 2], [0, 7], [-1, 2], [1]])
def test_profile_steps_outside_the_run_are_refused_by_name(steps, tmp_path, text_dataset):
  with pytest.raises(FieldError, match=r"train\.profile_steps=.*0 <= a < b <= train\.steps=6"):
    _exp(tmp_path / "r", text_dataset, f"train.profile_steps={json.dumps(steps)}")


@pytest.fixture(scope="module")
def run(tmp_path_factory, text_dataset):
  """A 6-step run with a trace of steps 3 and 4; the wall time of ``train`` around it."""
  run_dir = tmp_path_factory.mktemp("goodput") / "run"
  t = time.perf_counter()
  final = train(_exp(run_dir, text_dataset, "train.profile_steps=[2, 4]"), progress=False)
  return str(run_dir), final, time.perf_counter() - t


def test_final_json_holds_the_fractions_of_the_counted_time(run):
  run_dir, final, wall = run
  g = final["goodput"]
  assert runs.RunDir(run_dir).read_final()["goodput"] == g
  assert set(g["seconds"]) == set(goodput.ALL_PARTS)
  assert sum(g["fractions"].values()) == pytest.approx(1.0, abs=1e-3)
  assert g["goodput"] == pytest.approx(g["seconds"]["step"] / g["total_seconds"], abs=1e-3)
  # Every part was spent here, none twice: the whole fits in the wall time of train().
  assert 0 < g["total_seconds"] <= wall
  assert all(g["seconds"][p] > 0 for p in ("startup", "data", "step", "checkpoint", "eval", "log"))
  assert g["seconds"]["lost"] == 0 and g["steps_lost"] == 0
  assert 0 < g["compile_seconds"] <= g["seconds"]["startup"]


def test_the_time_fields_ride_on_the_last_line_of_each_write(run):
  lines = _lines(run[0])
  timed = [r["step"] for r in lines if "loss" in r and "time_step" in r]
  assert timed == [2, 4, 6]  # log_every=2: one write per two steps
  assert lines[0]["step"] == 0 and "time_startup" in lines[0]
  assert "time_checkpoint" in lines[-1] and "loss" not in lines[-1]  # the final save's wait
  assert goodput.summary(lines) == run[1]["goodput"]


def test_a_profile_trace_is_written_for_the_steps_asked(run):
  traces = glob.glob(os.path.join(run[0], "profile", "**", "*.xplane.pb"), recursive=True)
  assert traces and all(os.path.getsize(p) > 0 for p in traces)


def test_a_resume_counts_the_steps_it_runs_again(run, tmp_path, text_dataset):
  """Checkpoints 4 and 6 lost: the resumed attempt runs steps 3 to 6 again; the time the first
  attempt logged for them is the lost time."""
  run_dir = str(tmp_path / "run")
  shutil.copytree(run[0], run_dir)
  first = _lines(run_dir)
  for step in (4, 6):
    shutil.rmtree(os.path.join(run_dir, "checkpoints", str(step)))
  again = sum(r.get("time_data", 0) + r.get("time_step", 0) for r in first if r["step"] > 2)
  final = train(_exp(run_dir, text_dataset), progress=False)
  g = final["goodput"]
  assert g["steps_lost"] == 4
  starts = [r for r in _lines(run_dir) if "time_startup" in r]
  assert [r["step"] for r in starts] == [0, 2]
  assert starts[1]["time_lost"] == pytest.approx(again, abs=1e-5)
  assert g["seconds"]["lost"] == pytest.approx(again, abs=1e-3)  # rounded to ms
  assert g["seconds"]["startup"] == pytest.approx(sum(r["time_startup"] for r in starts), abs=1e-3)


def test_the_report_shows_where_the_time_went(run, tmp_path):
  from transformer_jax.report import write_report

  page = open(write_report([run[0]], str(tmp_path / "report"))).read()
  assert "Where the time went" in page
  assert f"goodput {100 * run[1]['goodput']['goodput']:.1f}%" in page
  for part in goodput.ALL_PARTS:
    assert f"<td>{part}</td>" in page


def test_the_dry_run_sets_the_loader_rate_a_step_time_needs_beside_the_measured_one(
  tmp_path, text_dataset
):
  from transformer_jax.train import dry_run as dry

  exp = _exp(tmp_path / "r", text_dataset, "train.target_step_time=0.25")
  report = dry.dry_run(exp)
  ld = report["loader"]
  assert ld["hosts"] == 1 and ld["tokens_per_step"] == 4 * 32  # this host: the global batch
  assert ld["need"] == 4 * 32 / 0.25 and ld["measured"] > 0
  text = dry.format_report(report)
  assert "loader: 128 tokens a step per host (1 here); needs 512 tokens/s" in text
  assert f"measured {ld['measured']:,.0f} tokens/s (batch_at, {dry.LOADER_STEPS} steps)" in text
  missing = dry.loader_report(
    _exp(tmp_path / "r", str(tmp_path / "none")).absolute(), report_task(exp)
  )
  assert "holds no prepared dataset" in missing["missing"]
  with pytest.raises(FieldError, match=r"train\.target_step_time=0\.0 must lie in \(0\.0, inf\)"):
    _exp(tmp_path / "r", text_dataset, "train.target_step_time=0")


def report_task(exp):
  from transformer_jax.train import tasks

  return tasks.for_experiment(exp, exp.model_config(vocab_size=64))
