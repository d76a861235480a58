"""Runs you can trust: faults and bad inputs on a tiny run directory.

Each case names what a user (or a preempted machine) does, and checks what happens: a finished run
is reported, damaged checkpoints fall back to the newest intact step with a warning naming the bad
one, the divergence guard never saves non-finite parameters, SIGTERM saves and exits 0, a second
trainer is refused, and every bad input is one line (exit 2) naming it.
"""

import io
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from transformer_jax import data, parallel, runs
from transformer_jax.backends.cpu import allocator
from transformer_jax.runs import orbax_errors
from transformer_jax.train import TrainingDiverged, evaluate_run, load_experiment, train
from transformer_jax.train import tasks as tasks_lib
from tests.train.conftest import REPO, run_cli, run_tjax

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
  "lr": 3e-3,
  "warmup_steps": 2,
  "schedule": "constant",  # the same learning rates whatever train.steps a resume gives
  "log_every": 2,
  "eval_every": 6,
  "eval_batches": 2,
  "checkpoint_every": 2,
  "keep_checkpoints": 3,
  "samples": 0,
}


def _raw(run_dir, dataset, **train_overrides):
  return {
    "run_dir": str(run_dir),
    "model": dict(MODEL),
    "data": {"path": dataset, "task": "gpt"},
    "train": {**TRAIN, **train_overrides},
    "bars": {"val_loss_below_unigram": 100.0},
  }


def _write(path, raw):
  path.write_text(yaml.safe_dump(raw))
  return str(path)


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, text_dataset):
  """A finished 6-step run (checkpoints 2, 4, 6) trained through the CLI without a terminal."""
  root = tmp_path_factory.mktemp("finished")
  cfg = _write(root / "e.yaml", _raw(root / "run", text_dataset))
  res = run_tjax("train", cfg, timeout=600)
  assert res.returncode == 0, res.stderr[-3000:]  # a bar that is not reached is reported only
  return {"config": cfg, "run": str(root / "run"), "stdout": res.stdout, "stderr": res.stderr}


def _copy(finished, tmp_path, name="run"):
  dst = tmp_path / name
  shutil.copytree(finished["run"], dst)
  os.remove(dst / ".lock")
  return str(dst)


def _exp(run_dir, dataset, overrides=(), **train_overrides):
  return load_experiment(None, list(overrides), raw=_raw(run_dir, dataset, **train_overrides))


# -------------------------------------------------------------------------------------------------
# Logs, bars, finished runs.


@pytest.mark.long
def test_without_a_terminal_one_plain_line_per_log_every(finished):
  lines = [l for l in finished["stdout"].splitlines() if l.startswith("step ") and "  loss " in l]
  assert [l.split()[1] for l in lines] == ["2/6", "4/6", "6/6"]
  assert all("lr" in l and "tokens/s" in l for l in lines)
  assert "\r" not in finished["stdout"] + finished["stderr"]


def test_bars_are_reported_and_enforced_only_with_check_bars(finished):
  assert "learning bar val_loss_below_unigram: NOT reached" in finished["stdout"]
  with open(os.path.join(finished["run"], "final.json")) as f:
    final = json.load(f)
  assert final["bars"]["val_loss_below_unigram"]["passed"] is False
  code, _, err = run_cli("train", finished["config"], "--check-bars")
  assert code == 3 and "not reached: val_loss_below_unigram" in err


def test_a_finished_run_says_so_and_changes_nothing(finished):
  before = {
    n: os.path.getmtime(os.path.join(finished["run"], n))
    for n in ("config.yaml", "model.yaml", "metrics.jsonl", "final.json")
  }
  code, out, err = run_cli("train", finished["config"], "--no-progress", "mesh.data=1")
  assert code == 0, err
  assert "is finished (step 6 of train.steps=6); nothing to do" in out
  assert before == {n: os.path.getmtime(os.path.join(finished["run"], n)) for n in before}


def test_model_and_data_overrides_are_refused_and_nothing_is_rewritten(
  finished, tmp_path, text_dataset
):
  run_dir = _copy(finished, tmp_path)
  snapshot = {n: open(os.path.join(run_dir, n)).read() for n in ("config.yaml", "model.yaml")}
  for overrides, named in (
    (["model.d_model=64"], "model.d_model: 32 -> 64"),
    (["train.seq_len=16", "train.steps=10"], "train.seq_len: 32 -> 16"),
    (["data.path=/elsewhere"], "data.path"),
  ):
    with pytest.raises(ValueError, match="holds a run with another model or data") as e:
      train(_exp(run_dir, text_dataset, overrides), progress=False)
    assert named in str(e.value)
  with pytest.raises(ValueError, match=r"model\.d_modle: unknown key \(did you mean 'd_model'"):
    train(_exp(run_dir, text_dataset, ["model.d_modle=64"]), progress=False)  # misspelt
  with pytest.raises(ValueError, match="train.steps=4 is below the run's last checkpoint"):
    train(_exp(run_dir, text_dataset, steps=4), progress=False)
  assert snapshot == {n: open(os.path.join(run_dir, n)).read() for n in snapshot}
  assert not os.path.exists(os.path.join(run_dir, "checkpoints", "8"))


def test_force_new_starts_over(finished, tmp_path, text_dataset):
  run_dir = _copy(finished, tmp_path)
  final = train(
    _exp(run_dir, text_dataset, ["model.d_model=16", "model.num_heads=1"], steps=2),
    progress=False,
    force_new=True,
  )
  assert final["step"] == 2
  assert runs.RunDir(run_dir).read_model().d_model == 16
  assert runs.RunDir(run_dir).checkpoint_steps() == [2]


def test_a_failed_start_leaves_no_run_folder_behind(tmp_path, text_dataset):
  run_dir = tmp_path / "r"
  with pytest.raises(ValueError, match="does not fit a GPTConfig"):
    train(_exp(run_dir, text_dataset, ["data.task=bert"]), progress=False)
  assert not run_dir.exists()  # not even a .lock
  with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=32"):
    train(_exp(run_dir, text_dataset, ["model.num_heads=3"]), progress=False)
  assert not run_dir.exists()
  run_dir.mkdir()  # an empty folder given: left as it was
  with pytest.raises(ValueError, match="num_heads=3 does not divide d_model=32"):
    train(_exp(run_dir, text_dataset, ["model.num_heads=3"]), progress=False)
  assert os.listdir(run_dir) == []


def test_spelled_out_defaults_resume_the_same_run(finished, tmp_path, text_dataset):
  """A config that spells a default explicitly is the same config."""
  run_dir = _copy(finished, tmp_path)
  same = [
    "model.attention_kind=softmax",
    "model.position=learned",
    "model.norm_eps=1e-5",
    "model.sliding_window=null",
    "data.mask_prob=0.15",
    "train.dtype=null",
  ]
  assert train(_exp(run_dir, text_dataset, same), progress=False)["finished_before"]
  with pytest.raises(ValueError, match=r"model\.attention_kind: 'softmax' -> 'linear'"):
    train(_exp(run_dir, text_dataset, ["model.attention_kind=linear"]), progress=False)


def test_a_folder_that_is_not_a_run_is_not_written_into(tmp_path, text_dataset):
  folder = tmp_path / "project"
  folder.mkdir()
  (folder / "config.yaml").write_text("mine: true\n")
  (folder / "notes.txt").write_text("mine\n")
  for force_new in (False, True):
    with pytest.raises(
      ValueError,
      match=rf"run_dir {folder} holds files that are not a run's "
      r"\(config\.yaml, notes\.txt\)",
    ):
      train(_exp(folder, text_dataset), progress=False, force_new=force_new)
  assert sorted(os.listdir(folder)) == ["config.yaml", "notes.txt"]
  assert (folder / "config.yaml").read_text() == "mine: true\n"


def test_a_run_from_before_the_marker_is_resumed_and_started_over(finished, tmp_path, text_dataset):
  assert runs.RunDir(finished["run"]).is_marked()
  run_dir = _copy(finished, tmp_path)
  os.remove(os.path.join(run_dir, runs.MARKER))  # as a run written before markers existed
  assert train(_exp(run_dir, text_dataset), progress=False)["finished_before"]
  assert train(_exp(run_dir, text_dataset, steps=2), progress=False, force_new=True)["step"] == 2
  assert runs.RunDir(run_dir).is_marked()


def test_a_dataset_smaller_than_one_batch_is_refused(tmp_path, text_dataset):
  from transformer_jax.data import GPTLoader, load_dataset

  windows = GPTLoader(load_dataset(text_dataset), batch_size=1, seq_len=32).num_windows
  run_dir = tmp_path / "r"
  with pytest.raises(
    ValueError,
    match=rf"the train split of {text_dataset} holds {windows} "
    rf"windows of 33 tokens, fewer than train\.batch_size={windows + 1}",
  ):
    train(_exp(run_dir, text_dataset, batch_size=windows + 1), progress=False)
  assert not run_dir.exists()


# -------------------------------------------------------------------------------------------------
# Damaged checkpoints.


def _truncate_largest_shard(step_dir):
  shards = [
    os.path.join(d, f)
    for d, _, fs in os.walk(os.path.join(step_dir, "params"))
    for f in fs
    if os.sep + "d" + os.sep in os.path.join(d, f) + os.sep
  ]
  largest = max(shards, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.truncate(8)


DAMAGE = {
  "truncated shard": _truncate_largest_shard,
  "missing _METADATA": lambda d: os.remove(os.path.join(d, "params", "_METADATA")),
  "missing meta": lambda d: shutil.rmtree(os.path.join(d, "meta")),
  "missing opt_state": lambda d: shutil.rmtree(os.path.join(d, "opt_state")),
}


# Each resume meets two kinds of damage, at steps 6 and 4 (every kind is met once), so that one
# training run checks both fall-backs.
@pytest.mark.parametrize(
  "at_6, at_4", [("truncated shard", "missing opt_state"), ("missing meta", "missing _METADATA")]
)
def test_damaged_latest_steps_fall_back_to_the_newest_intact_one(
  finished, tmp_path, capfd, text_dataset, at_6, at_4
):
  run_dir = _copy(finished, tmp_path)
  DAMAGE[at_6](os.path.join(run_dir, "checkpoints", "6"))
  DAMAGE[at_4](os.path.join(run_dir, "checkpoints", "4"))
  final = train(_exp(run_dir, text_dataset, steps=7), progress=False)
  err = capfd.readouterr().err
  assert "checkpoint step 6" in err and "checkpoint step 4" in err and "damaged" in err
  assert "resuming from step 2" in err
  assert final["step"] == 7
  # Steps 3 to 6 were trained again from step 2's parameters *and optimizer state*: the loss of
  # step 4 depends on the update of step 3, so a fresh optimizer would not reproduce it.
  original = {r["step"]: r["loss"] for r in _metrics(finished["run"]) if "loss" in r}
  again = {r["step"]: r["loss"] for r in _metrics(run_dir) if "loss" in r}
  assert [again[s] for s in (3, 4, 5, 6)] == [original[s] for s in (3, 4, 5, 6)]
  for step in (6, 4):
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", f"damaged-{step}"))


def test_every_step_damaged_is_one_error_naming_each(finished, tmp_path, text_dataset):
  run_dir = _copy(finished, tmp_path)
  for step in (2, 4, 6):
    _truncate_largest_shard(os.path.join(run_dir, "checkpoints", str(step)))
  with pytest.raises(runs.CheckpointDamaged, match="step 6: .*step 4: .*step 2: "):
    train(_exp(run_dir, text_dataset, steps=8), progress=False)
  res = run_tjax("eval", run_dir, timeout=600)
  assert res.returncode == 2
  assert res.stderr.strip().splitlines()[-1].startswith("tjax eval: error: no intact checkpoint"), (
    res.stderr
  )
  assert "Traceback" not in res.stderr and "Event loop is closed" not in res.stderr


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_during_a_save_leaves_a_resumable_run(tmp_path, text_dataset):
  run_dir = tmp_path / "killed"
  cfg = _write(
    tmp_path / "e.yaml",
    _raw(run_dir, text_dataset, steps=400, checkpoint_every=1, log_every=1, eval_every=1000),
  )
  proc = subprocess.Popen(
    [sys.executable, "-m", "transformer_jax.cli", "train", cfg],
    cwd=REPO,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  ckpt = run_dir / "checkpoints"
  deadline = time.time() + 300
  try:
    while time.time() < deadline and proc.poll() is None:  # a step being written, past step 3
      names = os.listdir(ckpt) if ckpt.exists() else []
      done = [int(n) for n in names if n.isdigit()]
      if done and max(done) >= 3 and any("tmp" in n for n in names):
        break
      time.sleep(0.002)
  finally:
    proc.send_signal(signal.SIGKILL)
  assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
  last = max(runs.RunDir(run_dir).checkpoint_steps())
  final = train(
    _exp(run_dir, text_dataset, steps=last + 2, checkpoint_every=1, log_every=1, eval_every=1000),
    progress=False,
  )
  assert final["step"] == last + 2 and np.isfinite(final["val_loss"])


# -------------------------------------------------------------------------------------------------
# Divergence.


def test_divergence_before_the_first_checkpoint_says_none_was_saved(tmp_path, text_dataset):
  exp = _exp(
    tmp_path / "r",
    text_dataset,
    lr=1e30,
    warmup_steps=0,
    clip_norm=None,
    schedule="constant",
    weight_decay=0.0,
    checkpoint_every=100,
    log_every=1,
  )
  with pytest.raises(TrainingDiverged, match="No checkpoint was saved before it"):
    train(exp, progress=False)


def test_divergence_guard_never_saves_non_finite_parameters(tmp_path, text_dataset):
  """Through the command line: exit 1 (a failure, not bad input) naming the step and the last good
  checkpoint, which is the newest one kept; no saved step holds a non-finite parameter. (Two
  warmup steps: the first update is 0, so step 1 is good; tests/train/test_divergence.py has the
  run whose every checkpoint is bad.)"""
  run_dir = tmp_path / "r"
  cfg = _write(
    tmp_path / "e.yaml",
    _raw(
      run_dir,
      text_dataset,
      steps=20,
      checkpoint_every=1,
      log_every=1,
      warmup_steps=2,
      schedule="constant",
    ),
  )
  code, _, err = run_cli("train", cfg, "--no-progress", "train.lr=1e9")
  assert code == 1, err
  match = re.search(r"became .* at step (\d+).*\(step (\d+)\) is intact", err)
  assert match, err
  bad_step, good_step = int(match[1]), int(match[2])
  rd = runs.RunDir(run_dir)
  assert rd.checkpoint_steps() and max(rd.checkpoint_steps()) == good_step < bad_step
  exp = _exp(run_dir, text_dataset, ["train.lr=1e9"], steps=20)
  for step in rd.checkpoint_steps():
    ckpt = runs.Checkpoints(rd.checkpoint_dir)
    try:
      from transformer_jax.train import step as step_lib
      from transformer_jax.train.optim import make_optimizer

      target = step_lib.abstract_state(
        rd.read_model(), make_optimizer(exp.train), parallel.make_mesh({"data": 1})
      )
      params, _, _ = ckpt.restore(step, target.params, target.opt_state)  # verifies finiteness
    finally:
      ckpt.close()
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))


# -------------------------------------------------------------------------------------------------
# Signals and the lock.


@pytest.mark.long
@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_0(tmp_path, text_dataset):
  run_dir = tmp_path / "term"
  cfg = _write(
    tmp_path / "e.yaml",
    _raw(run_dir, text_dataset, steps=2000, log_every=1, checkpoint_every=1000, eval_every=1000),
  )
  proc = subprocess.Popen(
    [sys.executable, "-m", "transformer_jax.cli", "train", cfg],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  metrics = run_dir / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and sum(1 for _ in open(metrics)) >= 3:
      break
    time.sleep(0.01)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-2000:]
  assert "stopped by SIGTERM at step" in out and "To resume: tjax train" in out
  stopped = int(out.split("stopped by SIGTERM at step ")[1].split(";")[0])
  assert runs.RunDir(run_dir).checkpoint_steps() == [stopped]
  assert stopped < 2000 and _metrics(run_dir)[-1]["step"] == stopped


def test_a_second_trainer_is_refused_and_more_steps_continue_the_run(
  finished, tmp_path, text_dataset
):
  run_dir = _copy(finished, tmp_path)
  with runs.RunDir(run_dir).lock():
    with pytest.raises(runs.RunLocked, match="is in use by pid"):
      train(_exp(run_dir, text_dataset, steps=8), progress=False)
    code, _, err = run_cli("train", finished["config"], f"run_dir={run_dir}", "train.steps=8")
    assert code == 2 and err.count("\n") == 1 and "is in use" in err
  # Released: more steps continue the run where it stopped.
  assert train(_exp(run_dir, text_dataset, steps=8), progress=False)["step"] == 8
  steps = [r["step"] for r in _metrics(run_dir) if "loss" in r]
  assert steps == list(range(1, 9))


# -------------------------------------------------------------------------------------------------
# Eval from anywhere, vocabularies, datasets.


def test_eval_works_from_another_folder_and_prepares_nothing(finished, tmp_path, monkeypatch):
  here = evaluate_run(finished["run"])
  monkeypatch.chdir(tmp_path)
  there = evaluate_run(finished["run"])
  assert here == there and here["step"] == 6
  assert os.listdir(tmp_path) == []


def test_vocabulary_mismatch_is_refused_at_eval(finished, tmp_path):
  corpus = tmp_path / "c"
  corpus.mkdir()
  (corpus / "a.txt").write_text("only a few other words here\n" * 20)
  (corpus / "b.txt").write_text("and some more of them\n" * 20)
  other = str(tmp_path / "ds")
  data.prepare([str(corpus)], other, compact_vocab=True, progress=False, val_fraction=1)
  with pytest.raises(ValueError, match=r"has vocab_size=\d+ but the model has vocab_size=\d+"):
    evaluate_run(finished["run"], [f"data.path={other}"])


def test_a_changed_dataset_is_refused(finished, tmp_path):
  run_dir = _copy(finished, tmp_path)
  ref_file = os.path.join(run_dir, "dataset.json")
  ref = json.load(open(ref_file))
  ref["hash"] = "0" * 64
  json.dump(ref, open(ref_file, "w"))
  with pytest.raises(ValueError, match="changed since the run trained on it"):
    evaluate_run(run_dir)


def test_eval_refuses_model_overrides(finished):
  with pytest.raises(ValueError, match="model.d_model: tjax eval takes only"):
    evaluate_run(finished["run"], ["model.d_model=64"])


def test_out_of_range_token_ids_are_refused_on_the_host():
  batch = {"tokens": np.array([[1, 2, 70]]), "labels": np.array([[2, 70, 3]])}
  with pytest.raises(ValueError, match=r"'tokens' holds token id 70, outside .*\[0, 50\)"):
    tasks_lib.check_token_ids(tasks_lib.GPTTask(), batch, 50)
  tasks_lib.check_token_ids(tasks_lib.GPTTask(), batch, 71)


# -------------------------------------------------------------------------------------------------
# One-line errors from the command line.


@pytest.mark.parametrize(
  "override, message",
  [
    ("train.clip_norm=-1", "train.clip_norm=-1.0 must lie in (0.0, inf)"),
    ("train.lr=nan", "train.lr='nan': expected a finite number"),
    ("train.lr=0", "train.lr=0.0 must lie in (0.0, inf)"),
    ("bars.val_loss_below_unigarm=1", "bars.val_loss_below_unigarm: unknown key (did you mean"),
    ("train.b2=1.5", "train.b2=1.5 must lie in [0.0, 1.0)"),
  ],
)
def test_config_ranges_after_options_are_one_line(tmp_path, text_dataset, override, message):
  cfg = _write(tmp_path / "e.yaml", _raw(tmp_path / "r", text_dataset))
  code, _, err = run_cli("train", cfg, "--no-progress", override)  # options first
  assert code == 2, err
  assert err.count("\n") == 1 and message in err, err
  assert not (tmp_path / "r").exists()


def test_broken_yaml_names_the_file_and_line(tmp_path):
  """In a fresh interpreter: nothing printed while the program starts adds to the one line."""
  cfg = tmp_path / "broken.yaml"
  cfg.write_text("run_dir: r\ntrain:\n  steps: [1, 2\n  lr: 3\n")
  res = run_tjax("train", str(cfg), timeout=600)
  assert res.returncode == 2 and res.stderr.count("\n") == 1
  assert f"{cfg}:" in res.stderr and "broken YAML" in res.stderr
  with pytest.raises(ValueError, match="broken YAML"):  # -v: the error itself, with its traceback
    run_cli("train", str(cfg), "-v")


def test_bad_run_dirs_are_one_line(tmp_path, text_dataset):
  afile = tmp_path / "afile"
  afile.write_text("x")
  for run_dir, message in ((afile, "is not a directory"), (afile / "sub", "is not writable")):
    cfg = _write(tmp_path / "e.yaml", _raw(run_dir, text_dataset))
    code, _, err = run_cli("train", cfg)
    assert code == 2 and err.count("\n") == 1, err
    assert message in err and str(afile) in err
  code, _, err = run_cli("train", str(tmp_path / "missing.yaml"))
  assert code == 2 and "missing.yaml' not found" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_run_dir_is_one_line(tmp_path, text_dataset):
  run_dir = tmp_path / "ro"
  run_dir.mkdir()
  run_dir.chmod(0o555)
  cfg = _write(tmp_path / "e.yaml", _raw(run_dir, text_dataset))
  code, _, err = run_cli("train", cfg)
  assert code == 2 and err.count("\n") == 1 and "not writable" in err


def _small_filesystem(path):
  """Mounts a 700 KiB tmpfs at ``path`` (root on Linux); False where the platform refuses."""
  path.mkdir()
  if sys.platform != "linux" or os.geteuid() != 0:
    return False
  res = subprocess.run(
    ["mount", "-t", "tmpfs", "-o", "size=700k", "tmpfs", str(path)], capture_output=True
  )
  return res.returncode == 0


def test_a_bare_full_disk_error_from_orbax_names_the_checkpoint_directory(tmp_path, monkeypatch):
  # Orbax's background metadata thread raises a bare "[Errno 28] No space left on device" (no
  # file) when the disk fills at that moment; the one-line error must still say where.
  from transformer_jax import cli

  ckpt = runs.Checkpoints(str(tmp_path / "checkpoints"))

  def full(*_, **__):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(ckpt.latest, "wait_until_finished", full)
  for call in (ckpt.wait, lambda: ckpt.save(1, {"w": np.zeros(2)}, {}, {"step": 1})):
    monkeypatch.setattr(ckpt.latest, "save", full)
    with pytest.raises(OSError) as info:
      call()
    assert cli._one_line(info.value) == f"{tmp_path / 'checkpoints'}: no space left on the device"
  monkeypatch.undo()
  ckpt.close()


@pytest.mark.long
@pytest.mark.slow
def test_a_full_disk_is_one_line_and_earlier_checkpoints_survive(tmp_path, text_dataset):
  small = tmp_path / "small"
  if not _small_filesystem(small):
    pytest.skip("mounting a small filesystem needs root on Linux")
  try:
    cfg = _write(
      tmp_path / "e.yaml",
      _raw(small / "r", text_dataset, steps=40, checkpoint_every=1, keep_checkpoints=5),
    )
    res = run_tjax("train", cfg, timeout=600)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.count("\n") == 1 and "no space left on the device" in res.stderr
    assert str(small / "r" / "checkpoints") in res.stderr
    steps = runs.RunDir(small / "r").checkpoint_steps()
    assert steps
    subprocess.run(["mount", "-o", "remount,size=16m", str(small)], check=True)
    final = train(
      _exp(small / "r", text_dataset, steps=steps[-1] + 1, checkpoint_every=1, keep_checkpoints=2),
      progress=False,
    )
    assert final["step"] == steps[-1] + 1
  finally:
    subprocess.run(["umount", str(small)], capture_output=True)


def test_asyncio_reports_of_abandoned_reads_are_dropped_and_others_kept():
  """The reads orbax abandons on a damaged step can report through asyncio's logger after the
  damage was named once ("Task exception was never retrieved", "Event loop is closed")."""
  with orbax_errors.quiet_aborted_reads():
    pass
  out = io.StringIO()
  handler = logging.StreamHandler(out)
  log = logging.getLogger("asyncio")
  log.addHandler(handler)

  def _read_array_index_and_device_put():
    raise ValueError("Encountered error while reading array index: (slice(0, 2, 1),)")

  try:
    try:
      _read_array_index_and_device_put()
    except ValueError as read_error:
      raise RuntimeError("Event loop is closed") from read_error
  except RuntimeError as closed:
    chained = closed
  try:
    log.error("Task exception was never retrieved", exc_info=chained)
    log.error("future: <Task finished coro=<_read_array_index_and_device_put() done>>")
    log.error("Exception in callback", exc_info=chained)
    log.error(
      "Future exception was never retrieved\nfuture: <Future finished exception=ValueError("
      "'OUT_OF_RANGE: Error reading \"embed.embedding.value/0.0\" in OCDBT database')>"
    )
    assert out.getvalue() == ""
    log.error("an unrelated asyncio error")
    assert out.getvalue() == "an unrelated asyncio error\n"
  finally:
    log.removeHandler(handler)


def test_a_library_oserror_without_errno_is_one_line_naming_file_and_reason():
  """TensorStore's write errors reach the CLI as an ``OSError`` with no errno and a multi-line
  text; a full disk must still read as one line with the file."""
  from transformer_jax import cli

  text = (
    'Error writing local file "/runs/r/checkpoints/2.orbax-checkpoint-tmp/d/ab12":\\n'
    "  Failed to write 31841 bytes to file 11:\\n  No space left on device [os_error_code='28']"
  )
  try:
    try:
      raise OSError(text)
    except OSError as inner:
      raise RuntimeError("checkpoint save failed") from inner
  except RuntimeError as outer:
    line = cli._one_line(outer)
  assert line == "/runs/r/checkpoints/2.orbax-checkpoint-tmp/d/ab12: no space left on the device"
  assert cli._one_line(OSError(28, "No space left on device", "/x")) == (
    "/x: no space left on the device"
  )


_LAUNCH_WITH_LATE_NOISE = """
import atexit, os, sys, threading
from transformer_jax import cli
code = int(sys.argv[1])
def main():
  print("tjax train: error: /r/checkpoints/2: no space left on the device", file=sys.stderr)
  cli._error_reported = code != 0   # as main's handler of a caught exception does
  # What abandoned background work does at exit: Python tracebacks and C++ logging on fd 2.
  atexit.register(lambda: print("Traceback (most recent call last):\\n  ...", file=sys.stderr))
  atexit.register(lambda: os.write(2, b"E tensorstore: Failed to write\\n"))
  return code
cli.main = main
cli.launch()
"""


@pytest.mark.parametrize("code", [0, 2])
def test_after_the_one_line_error_the_launcher_keeps_stderr_quiet(code):
  """A failed checkpoint write leaves orbax/tensorstore work that prints tracebacks at exit (one
  CI run saw 256 lines after the error); once the error is reported, the launcher drops them.
  A run that succeeds keeps everything."""
  res = subprocess.run(
    [sys.executable, "-c", _LAUNCH_WITH_LATE_NOISE, str(code)],
    cwd=REPO,
    env={**os.environ, "TJAX_MALLOC": "0"},
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert res.returncode == code
  lines = res.stderr.splitlines()
  assert lines[0] == "tjax train: error: /r/checkpoints/2: no space left on the device"
  if code:
    assert lines == lines[:1]
  else:
    assert (
      "E tensorstore: Failed to write" in lines and "Traceback (most recent call last):" in lines
    )


def test_main_marks_only_a_caught_error_for_the_launcher(tmp_path, monkeypatch):
  from transformer_jax import cli

  monkeypatch.setattr(cli, "_error_reported", False)
  code, _, err = run_cli("train", str(tmp_path / "missing.yaml"))
  assert code == 2 and err.startswith("tjax train: error:") and cli._error_reported
  monkeypatch.setattr(cli, "_error_reported", False)
  code, out, _ = run_cli("info")
  assert code == 0 and not cli._error_reported


def test_a_step_too_large_for_the_allocator_to_reuse_is_named_once(
  tmp_path, text_dataset, monkeypatch, capfd
):
  # A real case needs a step with over 2 GiB of temporaries; here the limit is lowered instead.
  monkeypatch.setattr(allocator, "MIMALLOC_REUSE_LIMIT", 0)
  monkeypatch.setattr(allocator, "allocator", lambda: "mimalloc")
  train(
    _exp(tmp_path / "r", text_dataset, ["model.d_model=16", "model.num_heads=1"], steps=3),
    progress=False,
  )
  out = capfd.readouterr().out
  assert out.count("notice: one training step needs") == 1, out
  assert "train.microbatches" in out


def test_no_allocator_notice_for_a_small_step(finished):
  assert "notice: one training step" not in finished["stdout"] + finished["stderr"]


def test_a_window_past_the_models_positions_is_refused_before_the_run(tmp_path, text_dataset):
  run_dir = tmp_path / "r"
  with pytest.raises(
    ValueError,
    match=r"train\.seq_len=64 is longer than the model's "
    r"max_len=32 positions",
  ):
    train(_exp(run_dir, text_dataset, seq_len=64), progress=False)
  assert not run_dir.exists()


def test_a_model_larger_than_the_free_memory_is_refused_before_anything_is_allocated(
  tmp_path, text_dataset, monkeypatch
):
  from transformer_jax import hardware

  monkeypatch.setattr(hardware, "host_memory_available", lambda: 2**10)
  run_dir = tmp_path / "r"
  with pytest.raises(
    ValueError,
    match=r"parameters need .* GiB for parameters, gradients and "
    r"AdamW moments, more than the 0\.0 GiB of memory this machine has free",
  ):
    train(_exp(run_dir, text_dataset), progress=False)
  assert not run_dir.exists()


def test_a_lock_that_is_a_symbolic_link_is_refused_and_its_target_kept(
  finished, tmp_path, text_dataset
):
  run_dir = _copy(finished, tmp_path)
  precious = tmp_path / "precious.txt"
  precious.write_text("mine\n")
  os.symlink(precious, os.path.join(run_dir, ".lock"))
  with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
    train(_exp(run_dir, text_dataset, steps=8), progress=False)
  assert precious.read_text() == "mine\n"


def test_a_torn_metrics_line_is_dropped_when_the_run_resumes(finished, tmp_path, text_dataset):
  """A crash in the middle of a log line: the resumed run drops it (and reports and plots skip
  it), and the file is rewritten whole."""
  run_dir = _copy(finished, tmp_path)
  with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 7, "lo')
  assert runs.RunDir(run_dir).read_metrics() == _metrics(finished["run"])
  assert train(_exp(run_dir, text_dataset, steps=8), progress=False)["step"] == 8
  steps = [r["step"] for r in _metrics(run_dir) if "loss" in r]
  assert steps == list(range(1, 9))


@pytest.mark.parametrize(
  "content, named",
  [
    ('{"step": 6, "loader": "x"}', "loader='x': expected null or an object"),
    ('{"step": 6, "loader": {"step": -1}}', "loader={'step': -1}"),
    ('{"step": 6, "loader": {"step": 6, "sequences": -1}}', "integer sequences >= 0"),
    ("[6]", "expected an object"),
    ('{"step": 6, "lo', "broken JSON"),
  ],
)
def test_a_damaged_checkpoint_meta_is_a_damaged_step_naming_the_file(
  finished, tmp_path, content, named
):
  run_dir = _copy(finished, tmp_path)
  path = os.path.join(run_dir, "checkpoints", "6", "meta", "metadata")
  with open(path, "w") as f:
    f.write(content)
  ckpt = runs.Checkpoints(os.path.join(run_dir, "checkpoints"), keep=3, async_save=False)
  try:
    with pytest.raises(ValueError, match=re.escape(path) + r".*" + re.escape(named)):
      ckpt.read_meta(6)
    assert ckpt.read_meta(4)["loader"] == {"step": 4, "sequences": 16}
  finally:
    ckpt.close()
