"""experiments/launch/local_multiprocess.sh, run with a stand-in Python (``$PYTHON``) that logs
what each process would run: the run folder it trains in."""

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "launch", "local_multiprocess.sh")

STUB = r"""#!/usr/bin/env bash
if [[ "$1" == - ]]; then cat > /dev/null; echo "prepare|${*:2}" >> "$STUB_LOG"; exit 0; fi
if [[ "$1" == -c ]]; then echo 41234; exit 0; fi
echo "train|$*" >> "$STUB_LOG"
"""


@pytest.fixture
def launch(tmp_path):
  stub = tmp_path / "python"
  stub.write_text(STUB)
  stub.chmod(0o755)
  log = tmp_path / "calls.log"

  def run(*argv):
    env = {
      **os.environ,
      "PYTHON": str(stub),
      "STUB_LOG": str(log),
      "RUN_LOG_DIR": str(tmp_path / "logs"),
    }
    done = subprocess.run(
      ["bash", SCRIPT, *argv], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    log.unlink()
    return done, calls

  return run


def _run_dirs(call: str) -> list[str]:
  return [a for a in call.split() if a.startswith("run_dir=")]


def test_a_config_without_run_dir_gets_its_own_folder_not_the_demos(launch):
  # The README's example after `make demo`: runs/gpt_tiny holds the finished single-process run.
  done, calls = launch("experiments/gpt_tiny.yaml", "mesh.data=2", "mesh.fsdp=4")
  assert len(calls) == 3  # the dataset prepared once, then processes 1 and 0
  for call in calls:
    assert _run_dirs(call) == ["run_dir=runs/gpt_tiny_2proc"], call
    assert "mesh.data=2 mesh.fsdp=4" in call
  assert "local_multiprocess: run_dir=runs/gpt_tiny_2proc (give run_dir=DIR to choose)" in (
    done.stderr
  )


def test_a_given_run_dir_is_kept(launch):
  _, calls = launch("experiments/gpt_tiny.yaml", "run_dir=/tmp/elsewhere", "train.steps=5")
  assert [_run_dirs(c) for c in calls] == [["run_dir=/tmp/elsewhere"]] * 3
  _, calls = launch()  # no arguments: the 20-step default
  assert [_run_dirs(c) for c in calls] == [["run_dir=runs/gpt_tiny_2proc"]] * 3
