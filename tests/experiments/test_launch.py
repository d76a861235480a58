"""experiments/launch/local_multiprocess.sh, run for real: two ``tjax train`` processes of two
simulated CPU devices each, joined by jax.distributed, for a few steps of experiments/gpt_tiny.yaml
made tiny. The script's Python is this interpreter and its package this checkout's."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "launch", "local_multiprocess.sh")

# gpt_tiny.yaml with a model and a run small enough to compile and train in seconds per process;
# the dataset is the tests' prepared one (gpt_tiny's corpus would take minutes to tokenize).
TINY = [
  "model.d_model=32",
  "model.num_layers=1",
  "model.num_heads=2",
  "model.d_ff=64",
  "model.max_len=32",
  "train.seq_len=32",
  "train.batch_size=4",
  "train.steps=4",
  "train.warmup_steps=1",
  "train.log_every=2",
  "train.eval_every=4",
  "train.eval_batches=1",
  "train.checkpoint_every=4",
  "train.samples=0",
  "bars={}",
]


@pytest.mark.slow
@pytest.mark.long
def test_two_processes_train_a_few_steps_in_a_folder_of_their_own(tmp_path, text_dataset):
  # No run_dir given: the script picks RUN_LOG_DIR/gpt_tiny_2proc, never the demo's runs/gpt_tiny.
  env = {
    **os.environ,
    "PYTHON": sys.executable,
    "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    "DEVICES_PER_PROCESS": "2",
    "RUN_LOG_DIR": str(tmp_path),
  }
  done = subprocess.run(
    ["bash", SCRIPT, "experiments/gpt_tiny.yaml", f"data.path={text_dataset}", *TINY],
    env=env,
    capture_output=True,
    text=True,
    timeout=540,
  )
  log1 = tmp_path / "process1.log"
  assert done.returncode == 0, done.stderr[-3000:] + (
    log1.read_text()[-2000:] if log1.exists() else ""
  )
  run_dir = tmp_path / "gpt_tiny_2proc"
  assert f"local_multiprocess: run_dir={run_dir} (give run_dir=DIR to choose)" in done.stderr
  with open(run_dir / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
  assert any("val_loss" in r for r in records)
  assert sorted(os.listdir(run_dir / "checkpoints")) == ["4", "best"]
  with open(run_dir / "final.json") as f:
    assert json.load(f)["step"] == 4
  # Both processes joined one job: 4 devices over 2 processes.
  assert "process 0/2: 2 local devices (cpu), 4 global devices" in done.stdout + done.stderr
