"""Which folders ``tjax train`` takes for a run: one carrying the marker (``.tjax-run``), an empty
one, or a run written before the marker existed; anything else is refused before a file in it is
replaced or deleted, ``--force-new`` included."""

import importlib.util
import json
import os
import struct
import subprocess
import sys

import pytest
import yaml

from transformer_jax import models, runs
from transformer_jax.train import load_experiment, train

MODEL = {"preset": "gpt2-tiny", "d_model": 16, "num_layers": 1, "num_heads": 1, "d_ff": 32}


def _exp(run_dir, dataset):
  raw = {
    "run_dir": str(run_dir),
    "model": dict(MODEL, max_len=16),
    "data": {"path": dataset, "task": "gpt"},
    "train": {"steps": 2, "batch_size": 2, "seq_len": 16, "samples": 0},
  }
  return load_experiment(None, [], raw=raw)


def _tree(folder) -> dict:
  """Every file under ``folder`` with its bytes."""
  out = {}
  for root, _, files in os.walk(folder):
    for name in files:
      path = os.path.join(root, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = f.read()
  return out


@pytest.fixture
def users_folder(tmp_path):
  """A project folder of the user's: its own ``config.yaml``, ``checkpoints/`` and
  ``tensorboard/``, names a run also writes."""
  folder = tmp_path / "project"
  (folder / "checkpoints" / "100").mkdir(parents=True)
  (folder / "checkpoints" / "100" / "weights.pt").write_bytes(b"the user's weights")
  (folder / "tensorboard").mkdir()
  (folder / "tensorboard" / "events.out").write_bytes(b"the user's events")
  (folder / "config.yaml").write_text("learning_rate: 0.1\n")
  return folder


def test_a_users_folder_with_run_file_names_is_not_taken_for_a_run(users_folder, text_dataset):
  before = _tree(users_folder)
  for force_new in (False, True):
    with pytest.raises(ValueError) as e:
      train(_exp(users_folder, text_dataset), progress=False, force_new=force_new)
    message = str(e.value)
    assert f"run_dir {users_folder} holds files that are not a run's" in message
    assert "checkpoints, config.yaml, tensorboard" in message
    assert f"create {users_folder / runs.MARKER} to take the directory as its run" in message
  with pytest.raises(ValueError, match="holds files that are not a run's"):
    runs.RunDir(users_folder).clear()
  assert _tree(users_folder) == before


def test_a_run_carries_the_marker_from_its_first_snapshot(tmp_path):
  rd = runs.RunDir(tmp_path / "r")
  rd.write_snapshot(None, models.get_config("gpt2-tiny"), None)
  assert rd.is_marked() and sorted(os.listdir(rd.path)) == [runs.MARKER, runs.MODEL]
  (tmp_path / "r" / "notes.txt").write_text("mine\n")
  rd.check_owned()  # a marked run may hold the user's notes too
  rd.clear()
  assert sorted(os.listdir(rd.path)) == [runs.MARKER, "notes.txt"]


def _unmarked_run(folder, dataset, *, config=True, metrics=True, checkpoint=False):
  """The files a run wrote before runs carried the marker."""
  folder.mkdir()
  exp = _exp(folder, dataset).absolute()
  spec = runs.model_spec(models.get_config("gpt2-tiny", **{k: 8 for k in ("d_model", "d_ff")}))
  (folder / runs.MODEL).write_text(yaml.safe_dump(spec))
  if config:
    (folder / runs.CONFIG).write_text(yaml.safe_dump(exp.to_dict()))
  if metrics:
    (folder / runs.METRICS).write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
  if checkpoint:
    (folder / runs.CHECKPOINTS / "0").mkdir(parents=True)
  return runs.RunDir(folder)


@pytest.mark.parametrize(
  "files",
  [
    {"metrics": True},  # stopped before its first checkpoint
    {"metrics": False, "checkpoint": True},
    {"config": False, "metrics": False, "checkpoint": True},  # a model tjax convert wrote
  ],
)
def test_runs_written_before_the_marker_are_still_runs(tmp_path, text_dataset, files):
  rd = _unmarked_run(tmp_path / "old", text_dataset, **files)
  assert not rd.is_marked() and rd.is_unmarked_run()
  rd.check_owned()


@pytest.mark.parametrize(
  "files",
  [
    {"metrics": False},  # an experiment and a model, but nothing a run produced
    {"config": False, "metrics": True},
  ],
)
def test_too_little_of_an_unmarked_run_is_refused_with_the_way_out(tmp_path, text_dataset, files):
  rd = _unmarked_run(tmp_path / "old", text_dataset, **files)
  assert not rd.is_unmarked_run()
  with pytest.raises(ValueError, match=f"create {rd.file(runs.MARKER)} to take the directory"):
    rd.check_owned()
  (tmp_path / "old" / runs.MARKER).write_text("")
  rd.check_owned()


def test_tensorboard_scalars_are_written_without_importing_pytorch(tmp_path):
  """A run's TensorBoard writer leaves PyTorch unloaded (tensorboardX would import it, over two
  seconds of every start) and PyTorch importable; the event file holds the scalars."""
  code = (
    "import sys\n"
    "from transformer_jax.train import metrics\n"
    "w = metrics.summary_writer(sys.argv[1])\n"
    "w.add_scalar('train/loss', 1.5, 3)\n"
    "w.close()\n"
    "print('torch' in sys.modules)\n"
    "import importlib.util\n"
    "print(importlib.util.find_spec('torch') is not None)\n"
  )
  has_torch = importlib.util.find_spec("torch") is not None
  res = subprocess.run(
    [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
  )
  assert res.returncode == 0, res.stderr
  assert res.stdout.split() == ["False", str(has_torch)]
  # The event file is TFRecord: [length u64, crc u32, Event proto, crc u32] per record.
  from tensorboardX.proto import event_pb2

  [name] = os.listdir(tmp_path)
  data, scalars = (tmp_path / name).read_bytes(), []
  while data:
    (n,) = struct.unpack("<Q", data[:8])
    event = event_pb2.Event.FromString(data[12 : 12 + n])
    data = data[16 + n :]
    scalars += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
  assert scalars == [(3, "train/loss", 1.5)]
