"""experiments/suite_durations.py reads pytest's JUnit XML as written and adds up each folder."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "suite_durations.py")

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
    [sys.executable, SCRIPT, str(junit), "--wall", "9", "--top", "2", "--out", str(out)],
    check=True,
    capture_output=True,
  )
  (run,) = json.loads(out.read_text())["runs"]
  assert run["tests"] == 4 and run["wall_seconds"] == 9.0
  assert run["outcomes"] == {"passed": 2, "skipped": 1, "failure": 1}
  assert run["by_folder"] == {"tests/train": 4.0, "tests/ops": 3.7, "tests": 0.5}
  assert [r["test"] for r in run["slowest"]] == [
    "tests/train/test_c.py::test_three",
    "tests/ops/test_b.py::test_two[x]",
  ]
