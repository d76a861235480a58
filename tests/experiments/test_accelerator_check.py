"""experiments/accelerator_check.sh, run with a stand-in ``python3`` and ``nvidia-smi`` on PATH.

The stand-in answers the script's probe with ``$STUB_BACKEND`` as jax's backend, logs every other
call, writes ``$STUB_JSON`` (default ``{}``) to the file after ``--json`` (no file for a call
matching ``$STUB_NOJSON``), exits 1 for a call matching ``$STUB_FAIL`` and sleeps for one matching
``$STUB_SLEEP``.
"""

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "accelerator_check.sh")

STUB_PYTHON = r"""#!/usr/bin/env bash
if [[ "$1" == - ]]; then   # the probe reads its program from stdin
  cat > /dev/null
  echo "jax 0.0 stub-device | flax 0"
  echo "$STUB_BACKEND"
  exit 0
fi
echo "${JAX_PLATFORMS:-}|$*" >> "$STUB_LOG"
matches() { local pattern=$1; shift; [[ -n "$pattern" && "$*" == *"$pattern"* ]]; }
if matches "${STUB_SLEEP:-}" "${@}"; then exec sleep 30; fi
if matches "${STUB_FAIL:-}" "${@}"; then echo "stub: failing" >&2; exit 1; fi
prev=""
for arg in "$@"; do
  if [[ "$prev" == --json ]] && ! matches "${STUB_NOJSON:-}" "${@}"; then
    echo "${STUB_JSON:-{\}}" > "$arg"
  fi
  prev=$arg
done
echo "stub: ran"
"""


@pytest.fixture
def check(tmp_path):
  stubs = tmp_path / "bin"
  stubs.mkdir()
  for name, text in (("python3", STUB_PYTHON), ("nvidia-smi", "#!/bin/sh\necho 'Stub GPU'\n")):
    (stubs / name).write_text(text)
    (stubs / name).chmod(0o755)
  log = tmp_path / "calls.log"

  def run(*parts, backend="gpu", **env):
    environ = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    environ.update(
      PATH=f"{stubs}:{os.environ['PATH']}", STUB_LOG=str(log), STUB_BACKEND=backend, **env
    )
    out = tmp_path / "out"
    done = subprocess.run(
      ["bash", SCRIPT, str(out), *parts], env=environ, capture_output=True, text=True, timeout=120
    )
    calls = log.read_text().splitlines() if log.exists() else []
    return done, out, calls

  return run


def test_refuses_a_host_without_an_accelerator(check):
  done, out, calls = check(backend="cpu")
  assert done.returncode == 3
  assert done.stderr.strip().splitlines() == [
    "accelerator_check: no accelerator here (jax's backend: cpu); set "
    "ACCELERATOR_CHECK_ON_CPU=1 to run it anyway"
  ]
  assert calls == [] and not out.exists()


def test_runs_without_an_accelerator_only_when_told(check):
  done, out, calls = check("train", backend="cpu", ACCELERATOR_CHECK_ON_CPU="1")
  assert done.returncode == 0, done.stderr
  assert "running on 'cpu' (ACCELERATOR_CHECK_ON_CPU=1)" in done.stderr
  assert len(calls) == 1 and (out / "bench_train.json").exists()


def test_a_misspelled_part_is_refused_before_anything_runs(check):
  done, out, calls = check("train", "tarin")
  assert done.returncode == 2
  assert done.stderr.strip() == (
    "accelerator_check: unknown part 'tarin' (parts: train levers "
    "llama tests attention generate); nothing was run"
  )
  assert calls == [] and not out.exists()


def test_a_failing_part_fails_the_check_and_is_named_the_others_run(check):
  done, out, calls = check("train", "llama", "levers", STUB_FAIL="tinyllama")
  assert done.returncode == 1
  assert done.stderr.strip().splitlines()[-1] == (
    f"accelerator_check: failed: llama (logs in {out})"
  )
  assert re.search(r"^llama: exit 1 after \d+ s \(limit 150 s\)$", done.stdout, re.M)
  assert len(calls) == 3  # the parts after the failing one still ran
  assert (out / "bench_train.json").exists() and (out / "levers.json").exists()
  assert "stub: failing" in (out / "llama.log").read_text()


def test_a_part_that_writes_no_json_fails(check):
  done, out, _ = check("train", "levers", STUB_NOJSON="gpu_levers")
  assert done.returncode == 1
  assert "levers: exit 0 after" in done.stdout and "but it wrote no levers.json" in done.stdout
  assert done.stderr.strip().endswith(f"failed: levers (logs in {out})")


def test_a_json_without_its_measurement_fails(check):
  done, out, _ = check("train", "levers", STUB_JSON='{"left_out": {"torch.compile": "no CUDA"}}')
  assert done.returncode == 1 and done.stderr.strip().endswith(f"failed: train (logs in {out})")
  assert 'bench_train.json has "left_out" entries' in done.stdout
  done, _, _ = check("levers", STUB_JSON='{"train": {"default": {"error": "OOM"}}}')
  assert done.returncode == 1 and 'levers.json has "error" entries' in done.stdout


def test_a_part_past_its_limit_is_stopped_and_named(check):
  done, out, _ = check("levers", "train", STUB_SLEEP="gpu_levers", LEVERS_LIMIT="1")
  assert done.returncode == 1
  assert re.search(
    r"^levers: exit 124 after \d+ s \(limit 1 s\), stopped at its time limit$", done.stdout, re.M
  )
  assert (out / "bench_train.json").exists()


def test_the_default_parts_fit_one_ten_minute_call(check):
  done, out, calls = check()
  assert done.returncode == 0, done.stderr
  assert done.stdout.strip().splitlines()[-1] == (
    "accelerator_check: every part passed (train levers llama tests)"
  )
  limits = [int(s) for s in re.findall(r"\(limit (\d+) s\)", done.stdout)]
  assert len(limits) == 5  # tests runs the suite, then tests/parallel
  assert sum(limits) <= 540 - 20  # 9 minutes, less the probe's
  # The whole suite: everything but tests/parallel on the accelerator, then those on 8 CPU devices.
  suite = [c for c in calls if "-m pytest" in c]
  assert suite[0].startswith("|-m pytest tests --ignore=tests/parallel ")
  assert suite[1].startswith("cpu|-m pytest tests/parallel ")
  assert any("--preset tinyllama-1.1b" in c and "--against torch.compile" in c for c in calls)
  assert (out / "machine.txt").read_text().startswith("parts: train levers llama tests")
