"""The data position in sequences: a resumed run may change its global batch size by an integer
ratio and continue at the first sequence not yet consumed (no sequence skipped or repeated), the
learning-rate schedule staying in steps; other ratios, loaders that draw per step and a changed
dataset are refused by name (a changed dataset unless accepted). Each process builds only its own
rows of a global batch."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import yaml

from transformer_jax import data, runs
from transformer_jax.train import load_experiment, train
from transformer_jax.train.plan import check_batch_change
from transformer_jax.train.state import data_position
from transformer_jax.train.config import TrainConfig
from tests.train.conftest import run_cli

MODEL = {
  "preset": "gpt2-tiny",
  "d_model": 32,
  "num_layers": 1,
  "num_heads": 2,
  "d_ff": 64,
  "max_len": 32,
  "dropout_rate": 0.0,
}
TRAIN = {
  "steps": 2,
  "batch_size": 8,
  "seq_len": 32,
  "lr": 3e-3,
  "warmup_steps": 1,
  "log_every": 1,
  "eval_every": 100,
  "eval_batches": 1,
  "checkpoint_every": 2,
  "samples": 0,
  "async_checkpoints": False,
}


def _raw(run_dir, dataset, **train):
  return {
    "run_dir": str(run_dir),
    "model": dict(MODEL),
    "data": {"path": dataset, "task": "gpt"},
    "train": {**TRAIN, **train},
    "bars": {},
  }


def _loader(dataset, batch_size, **kw):
  return data.GPTLoader(data.load_dataset(dataset), batch_size=batch_size, seq_len=32, seed=0, **kw)


# -------------------------------------------------------------------------------------------------
# The loader: a pure function of (seed, origin, step).


@pytest.mark.parametrize("after", [16, 4, 24])
def test_gpt_loader_continues_at_the_first_unconsumed_sequence(text_dataset, after):
  """Batches of 8 for steps 33-35 (sequences 264-287, across the end of the first epoch's 286
  windows), then of ``after`` from sequence 288: the windows are exactly those of one sequence
  order (a batch of 1 per step)."""
  one = _loader(text_dataset, 1)
  assert one.num_windows == 286
  order = np.concatenate([one.window_starts(g) for g in range(264, 288 + 5 * after)])
  before = _loader(text_dataset, 8)
  before.set_state({"step": 33})
  consumed = [before.window_starts(s) for s in range(33, 36)]
  for _ in range(3):
    next(before)
  state = before.get_state()
  assert state == {"step": 36, "sequences": 288}
  resumed = _loader(text_dataset, after)
  resumed.set_state(json.loads(json.dumps(state)))  # as a checkpoint's meta stores it
  consumed += [resumed.window_starts(s) for s in range(36, 41)]
  np.testing.assert_array_equal(np.concatenate(consumed), order)
  # A pure function: another loader at the same origin builds the same batch.
  again = _loader(text_dataset, after)
  again.set_state({"step": 36, "sequences": 288})
  for k, v in resumed.batch_at(38).items():
    np.testing.assert_array_equal(again.batch_at(38)[k], v)
  # A state without "sequences" (the loop's per-step update) keeps the origin.
  resumed.set_state({"step": 39})
  assert resumed.get_state() == {"step": 39, "sequences": 288 + 3 * after}


def test_a_step_before_the_origin_with_no_sequences_left_is_refused(text_dataset):
  loader = _loader(text_dataset, 8)
  loader.set_state({"step": 10, "sequences": 16})
  assert loader.sequences_at(8) == 0
  with pytest.raises(ValueError, match=r"step 7 lies before the loader's first batch"):
    loader.window_starts(7)


def test_loaders_that_draw_per_step_refuse_a_sequence_offset(text_dataset, reverse_dataset):
  bert = data.BertLoader(data.load_dataset(text_dataset), batch_size=8, seq_len=32)
  bert.set_state({"step": 3, "sequences": 24})  # the position a batch of 8 reached: fine
  with pytest.raises(ValueError, match=r"BertLoader draws its batches per step: .*sequence 24"):
    bert.set_state({"step": 2, "sequences": 24})
  s2s = data.Seq2SeqLoader(data.load_dataset(reverse_dataset), batch_size=4)
  with pytest.raises(ValueError, match=r"Seq2SeqLoader draws its batches per step"):
    s2s.set_state({"step": 1, "sequences": 8})


def test_each_process_builds_only_its_rows_and_all_agree(text_dataset, monkeypatch):
  """Two processes of a batch of 8: each gathers 4 rows (counted where the rows are built), and
  their shares, computed without exchanging anything, are the single process's global batch."""
  built = []
  gather = data.GPTLoader.gather
  monkeypatch.setattr(
    data.GPTLoader, "gather", lambda self, starts: built.append(len(starts)) or gather(self, starts)
  )
  whole = _loader(text_dataset, 8, process_index=0, process_count=1).batch_at(5)
  built.clear()
  shares = [_loader(text_dataset, 8, process_index=i, process_count=2) for i in range(2)]
  for loader in shares:
    loader.set_state({"step": 5})
  parts = [next(loader) for loader in shares]
  assert built == [4, 4]
  for k, v in whole.items():
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), v)


# -------------------------------------------------------------------------------------------------
# Resuming a run.


@pytest.fixture(scope="module")
def run8(tmp_path_factory, text_dataset):
  """Two steps of a batch of 8 (checkpoint at step 2)."""
  run_dir = tmp_path_factory.mktemp("topology") / "run"
  train(load_experiment(None, raw=_raw(run_dir, text_dataset)), progress=False)
  return str(run_dir)


def _copy(run8, tmp_path):
  dst = tmp_path / "run"
  shutil.copytree(run8, dst)
  if os.path.exists(dst / ".lock"):
    os.remove(dst / ".lock")
  return str(dst)


def _meta(run_dir, step):
  ckpt = runs.Checkpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
  try:
    return ckpt.read_meta(step)
  finally:
    ckpt.close()


def test_doubling_the_batch_on_resume_keeps_the_data_position(
  run8, tmp_path, text_dataset, monkeypatch, capsys
):
  run_dir = _copy(run8, tmp_path)
  assert _meta(run_dir, 2)["loader"] == {"step": 2, "sequences": 16}
  seen = {}
  batch_at = data.GPTLoader.batch_at

  def recording(self, step):
    seen[step] = self.window_starts(step)  # the loop's call for a step comes last
    return batch_at(self, step)

  monkeypatch.setattr(data.GPTLoader, "batch_at", recording)
  exp = load_experiment(None, raw=_raw(run_dir, text_dataset, steps=4, batch_size=16))
  assert train(exp, progress=False)["step"] == 4
  assert "train.batch_size changed from 8 to 16: step 2 starts at sequence 16" in (
    capsys.readouterr().out
  )
  assert _meta(run_dir, 4)["loader"] == {"step": 4, "sequences": 48}
  eight = _loader(text_dataset, 8)
  first = [eight.window_starts(s) for s in range(2)]  # what the first two steps consumed
  np.testing.assert_array_equal(
    np.concatenate(first + [seen[2], seen[3]]),
    np.concatenate([eight.window_starts(s) for s in range(6)]),
  )
  steps = [r["step"] for r in runs.RunDir(run_dir).read_metrics() if "loss" in r]
  assert steps == [1, 2, 3, 4]  # the schedule and the step count go on in steps


def test_a_non_integer_batch_change_is_refused(run8, tmp_path, text_dataset):
  run_dir = _copy(run8, tmp_path)
  exp = load_experiment(None, raw=_raw(run_dir, text_dataset, steps=4, batch_size=12))
  with pytest.raises(ValueError, match=re.escape("train.batch_size: 8 -> 12 is not an integer")):
    train(exp, progress=False)
  for before, after in ((8, 16), (16, 8), (8, 8), (3, 9)):
    check_batch_change(before, after)
  with pytest.raises(ValueError, match=re.escape("train.batch_size: 16 -> 24")):
    check_batch_change(16, 24)


def test_a_checkpoint_without_sequences_consumed_batches_of_the_stored_size():
  stored = TrainConfig(batch_size=8)
  assert data_position({"step": 3}, stored) == {"step": 3, "sequences": 24}
  assert data_position({"step": 3, "sequences": 5}, stored) == {"step": 3, "sequences": 5}


def test_a_changed_dataset_is_refused_unless_accepted(run8, tmp_path, text_dataset):
  run_dir = _copy(run8, tmp_path)
  ref_file = os.path.join(run_dir, "dataset.json")
  with open(ref_file) as f:
    ref = json.load(f)
  real = ref["hash"]
  ref["hash"] = "0" * 64
  with open(ref_file, "w") as f:
    json.dump(ref, f)
  config = tmp_path / "exp.yaml"
  config.write_text(yaml.safe_dump(_raw(run_dir, text_dataset, steps=3)))
  code, _, err = run_cli("train", str(config), "--no-progress")
  assert code == 2
  (line,) = [l for l in err.splitlines() if l.strip()]
  assert f"the dataset {text_dataset} changed since this run started" in line
  assert "--accept-data-change" in line
  assert _meta(run_dir, 2) and runs.RunDir(run_dir).checkpoint_steps() == [2]
  code, out, err = run_cli("train", str(config), "--no-progress", "--accept-data-change")
  assert code == 0, err
  assert "--accept-data-change: continuing on it at the same data position" in out + err
  with open(ref_file) as f:
    assert json.load(f)["hash"] == real  # the run now records the data it continued on
  assert _meta(run_dir, 3)["loader"] == {"step": 3, "sequences": 24}


def test_a_bert_run_refuses_another_batch_size(tmp_path, text_dataset):
  """BERT draws each step's pairs as a whole: a changed batch size is refused before anything is
  restored or rewritten."""
  raw = _raw(tmp_path / "bert", text_dataset)
  raw["model"] = {"preset": "bert-tiny", "d_model": 32, "num_heads": 2, "d_ff": 64, "max_len": 32}
  raw["data"]["task"] = "bert"
  raw["train"]["steps"] = 1
  raw["train"]["checkpoint_every"] = 1
  train(load_experiment(None, raw=raw), progress=False)
  config = (tmp_path / "bert" / "config.yaml").read_text()
  raw["train"].update(steps=2, batch_size=16)
  with pytest.raises(ValueError, match=r"train.batch_size: 8 -> 16: the bert task's loader draws"):
    train(load_experiment(None, raw=raw), progress=False)
  assert (tmp_path / "bert" / "config.yaml").read_text() == config
