"""experiments/suite_durations.py reads pytest's JUnit XML as written and adds up each folder."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "suite_durations.py")
sys.path.insert(0, os.path.join(REPO, "experiments"))

import suite_durations  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.ops.test_a" name="test_one" time="1.5" />
<testcase classname="tests.ops.test_b" name="test_two[x]" time="2.2" />
<testcase classname="tests.train.test_c" name="test_three" time="4.0"><skipped /></testcase>
<testcase classname="tests.test_d" name="test_four" time="0.5"><failure message="no" /></testcase>
</testsuite></testsuites>"""


def test_folders_add_up_and_the_slowest_come_first(tmp_path):
  junit, out = tmp_path / "main.xml", tmp_path / "out.json"
  junit.write_text(JUNIT)
  subprocess.run(
    [sys.executable, SCRIPT, str(junit), "--wall", "9", "--top", "2", "--out", str(out)]
    + ["--reference-seconds", "14.5", "--reference-seconds", "15"],
    check=True,
    capture_output=True,
  )
  record = json.loads(out.read_text())
  assert record["reference_seconds"] == [14.5, 15.0]
  (run,) = record["runs"]
  assert run["tests"] == 4 and run["wall_seconds"] == 9.0
  assert run["outcomes"] == {"passed": 2, "skipped": 1, "failure": 1}
  assert run["by_folder"] == {"tests/train": 4.0, "tests/ops": 3.7, "tests": 0.5}
  assert [r["test"] for r in run["slowest"]] == [
    "tests/train/test_c.py::test_three",
    "tests/ops/test_b.py::test_two[x]",
  ]


def test_the_reference_work_runs_in_a_fresh_interpreter_with_the_suites_flags():
  """A smaller reference (one preset, a few dispatches) than ``--reference`` takes: it compiles
  and runs, and its interpreter has the flags of the suite's processes and no cache."""
  flags = suite_durations.harness_flags()
  assert "--xla_backend_optimization_level=0" in flags
  assert set(flags) <= set(os.environ["XLA_FLAGS"].split())  # what conftest.py set
  assert suite_durations.reference_seconds(("gpt2-tiny",), ops=3) > 0
