"""The trainer end to end: exact resume after SIGKILL, gradient accumulation == full batch, the run
directory. Data parallel == one device runs in tests/parallel (on its 8 devices), and a NaN that
stops the run with the last good checkpoint intact in test_reliability.py."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from transformer_jax import models
from transformer_jax.train import load_experiment
from transformer_jax.runs import restore_params
from tests.train.conftest import REPO, CompiledStandIn, run_cli, run_tjax

TINY_GPT = {
  "preset": "gpt2-tiny",
  "d_model": 32,
  "num_layers": 2,
  "num_heads": 2,
  "d_ff": 64,
  "max_len": 32,
  "dropout_rate": 0.1,
}


def _write_experiment(path, run_dir, dataset, **train):
  exp = {
    "run_dir": str(run_dir),
    "model": TINY_GPT,
    "data": {"path": dataset, "task": "gpt"},
    "train": {
      "batch_size": 4,
      "seq_len": 32,
      "lr": 3e-3,
      "warmup_steps": 5,
      "log_every": 1,
      "eval_every": 1000,
      "eval_batches": 2,
      "samples": 0,
      **train,
    },
  }
  path.write_text(yaml.safe_dump(exp))
  return str(path)


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _params(run_dir):
  with open(os.path.join(run_dir, "model.yaml")) as f:
    config = models.config_from_dict(yaml.safe_load(f))
  params, step = restore_params(os.path.join(run_dir, "checkpoints"), config)
  return params, step


@pytest.mark.usefixtures("onednn_steps")  # the CPU default, end to end (tests/conftest.py)
@pytest.mark.long
def test_sigkill_and_resume_equals_uninterrupted_run(tmp_path, text_dataset):
  steps = 60
  common = dict(steps=steps, checkpoint_every=10, keep_checkpoints=2)
  straight = tmp_path / "straight"
  cfg_a = _write_experiment(tmp_path / "a.yaml", straight, text_dataset, **common)
  done = run_tjax("train", cfg_a, "--no-progress", timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]

  killed = tmp_path / "killed"
  cfg_b = _write_experiment(tmp_path / "b.yaml", killed, text_dataset, **common)
  proc = subprocess.Popen(
    [sys.executable, "-m", "transformer_jax.cli", "train", cfg_b, "--no-progress"],
    cwd=REPO,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  metrics_path = killed / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline:  # kill mid-way: after step 25, well before step 60
    if metrics_path.exists() and sum('"loss"' in line for line in open(metrics_path)) >= 25:
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
  lines_at_kill = _metrics(killed)
  assert 25 <= lines_at_kill[-1]["step"] < steps

  resumed = run_tjax("train", cfg_b, "--no-progress", timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resuming from" in resumed.stdout

  a, b = _metrics(straight), _metrics(killed)
  train_a = [r for r in a if "loss" in r]
  train_b = [r for r in b if "loss" in r]
  assert [r["step"] for r in train_b] == list(range(1, steps + 1))
  assert [r["batch_hash"] for r in train_a] == [r["batch_hash"] for r in train_b]
  assert [r["loss"] for r in train_a] == [r["loss"] for r in train_b]
  (pa, sa), (pb, sb) = _params(straight), _params(killed)
  assert sa == sb == steps
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bitwise


def test_gradient_accumulation_equals_full_batch(text_dataset, tmp_path):
  """The plans' own steps: 4 microbatches give the whole batch's loss and update."""
  from transformer_jax.train import make_plan
  from transformer_jax.train import step as S

  raw = {
    "run_dir": str(tmp_path / "r"),
    "model": {**TINY_GPT, "dropout_rate": 0.0},
    "data": {"path": text_dataset, "task": "gpt"},
    "train": {"batch_size": 8, "seq_len": 32, "warmup_steps": 1},
  }
  results = {}
  for micro in (1, 4):
    plan = make_plan(load_experiment(None, [f"train.microbatches={micro}"], raw=raw))
    assert plan.exp.train.microbatches == micro
    params = models.init(plan.model_config, jax.random.key(0))
    state = S.place_state(S.create_state(params, plan.optimizer), plan.mesh)
    for s in range(2):
      state, m = plan.step(state, S.shard_batch(plan.loader.batch_at(s), plan.mesh, plan.task.keys))
    results[micro] = (float(m["loss"]), state.params)
  np.testing.assert_allclose(results[1][0], results[4][0], rtol=1e-5)
  for x, y in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[4][1])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


@pytest.mark.parametrize(
  "temps,batch,n_batch,want,compiled",
  [
    ({1: 1500}, 8, 1, 1, [1]),  # fits whole: one compile
    ({1: 5000, 4: 1900}, 8, 1, 4, [1, 4]),  # >= 5000 / 2000: 3 -> 4
    ({1: 5000, 4: 2100, 8: 1200}, 8, 1, 8, [1, 4, 8]),
    ({1: 5000, 4: 2100, 8: 2050}, 8, 1, 1, [1, 4, 8]),  # nothing fits: stays whole
    ({1: 3000, 2: 1900}, 8, 4, 2, [1, 2]),  # 2 rows per device
    ({1: 9000}, 8, 4, 1, [1]),  # would need 5: none divides 2
  ],
)
def test_auto_microbatches_takes_the_fewest_that_fit(temps, batch, n_batch, want, compiled):
  from transformer_jax.backends.cpu import microbatches

  calls = []

  def compile_step(m):
    calls.append(m)
    return CompiledStandIn(temps[m])

  m, step = microbatches.auto_microbatches(compile_step, batch, n_batch, limit=2000)
  assert (m, calls) == (want, compiled)
  assert step.temp == temps[m]


@pytest.mark.parametrize("bad", ["auto", 0, 1.5, True])
def test_make_train_step_takes_only_a_count_of_microbatches(bad):
  from transformer_jax.train import step as S

  with pytest.raises(ValueError, match=r"microbatches=.* must be a count >= 1"):
    S.make_train_step(None, None, None, seed=0, microbatches=bad)


def test_auto_microbatches_in_a_run_on_cpu_over_mimalloc(text_dataset, tmp_path, monkeypatch):
  # A real case needs over 2 GiB of temporaries; the limit is lowered to the size of the step in
  # 2 microbatches instead, which the whole batch's step passes.
  from transformer_jax.backends.cpu import allocator
  from transformer_jax.train import make_plan
  from transformer_jax.train import step as S

  raw = {
    "run_dir": str(tmp_path / "r"),
    "model": {**TINY_GPT, "dropout_rate": 0.0},
    "data": {"path": text_dataset, "task": "gpt"},
    "train": {"batch_size": 8, "seq_len": 32, "warmup_steps": 1},
  }
  exp = load_experiment(None, [], raw=raw)
  assert exp.train.microbatches == "auto"  # the default
  temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
  whole = make_plan(exp)
  assert whole.exp.train.microbatches == 1  # under pytest the allocator is glibc: no rule
  split = make_plan(load_experiment(None, ["train.microbatches=2"], raw=raw))
  assert temp(split.compiled) < temp(whole.compiled)
  monkeypatch.setattr(allocator, "allocator", lambda: "mimalloc")
  monkeypatch.setattr(allocator, "MIMALLOC_REUSE_LIMIT", temp(split.compiled))
  auto = make_plan(exp)
  assert auto.exp.train.microbatches == 2 and temp(auto.compiled) == temp(split.compiled)
  # The step is the 2-microbatch one: the same loss as the explicit count's.
  params = models.init(auto.model_config, jax.random.key(0))
  state = S.place_state(S.create_state(params, auto.optimizer), auto.mesh)
  batch = S.shard_batch(auto.loader.batch_at(0), auto.mesh, auto.task.keys)
  _, got = auto.step(jax.tree.map(np.array, state), batch)  # a copy: the step donates its state
  _, want = split.step(state, batch)
  assert float(got["loss"]) == float(want["loss"])


def test_config_yaml_records_the_resolved_microbatches(text_dataset, tmp_path, monkeypatch):
  """``train.microbatches: auto`` is resolved by the plan, before the snapshot is written."""
  from transformer_jax.backends.cpu import allocator
  from transformer_jax.train import make_plan, train

  raw = {
    "run_dir": str(tmp_path / "r"),
    "model": {**TINY_GPT, "dropout_rate": 0.0},
    "data": {"path": text_dataset, "task": "gpt"},
    "train": {"steps": 1, "batch_size": 8, "seq_len": 32, "eval_batches": 1, "samples": 0},
  }
  split = make_plan(load_experiment(None, ["train.microbatches=2"], raw=raw))
  monkeypatch.setattr(allocator, "allocator", lambda: "mimalloc")
  monkeypatch.setattr(
    allocator, "MIMALLOC_REUSE_LIMIT", split.compiled.memory_analysis().temp_size_in_bytes
  )
  train(load_experiment(None, [], raw=raw), progress=False)
  with open(tmp_path / "r" / "config.yaml") as f:
    assert yaml.safe_load(f)["train"]["microbatches"] == 2


@pytest.mark.long
def test_run_directory_contents_and_eval(tmp_path, text_dataset):
  run_dir = tmp_path / "run"
  cfg = _write_experiment(
    tmp_path / "e.yaml",
    run_dir,
    text_dataset,
    steps=12,
    eval_every=6,
    checkpoint_every=6,
    samples=1,
    sample_tokens=4,
  )
  res = run_tjax("train", cfg, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]
  for name in (
    "config.yaml",
    "model.yaml",
    "metrics.jsonl",
    "loss.png",
    "final.json",
    "samples.txt",
  ):
    assert (run_dir / name).exists(), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(run_dir / "tensorboard"))
  records = _metrics(run_dir)
  train_lines = [r for r in records if "loss" in r]
  eval_lines = [r for r in records if "val_loss" in r]
  assert {"step", "loss", "tokens_per_sec", "lr", "mfu"} <= set(train_lines[0])
  # MFU: the model's FLOPs at the logged rate over the device's measured matmul rate.
  assert all(0 < r["mfu"] < 1 for r in train_lines)
  assert [r["step"] for r in eval_lines] == [6, 12]
  assert os.path.isdir(run_dir / "checkpoints" / "best")
  ev = run_tjax("eval", str(run_dir), timeout=600)
  assert ev.returncode == 0, ev.stderr[-3000:]
  result = json.loads(ev.stdout[ev.stdout.index("{") :])
  assert result["step"] == 12
  np.testing.assert_allclose(result["val_loss"], eval_lines[-1]["val_loss"], rtol=1e-5)


def test_wrong_task_for_model_is_a_clear_error(tmp_path, text_dataset):
  cfg = _write_experiment(tmp_path / "e.yaml", tmp_path / "r", text_dataset, steps=2)
  code, _, err = run_cli("train", cfg, "data.task=bert")
  assert code == 2
  assert "data.task='bert' does not fit a GPTConfig" in err
