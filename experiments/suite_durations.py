"""Summarises the test suite's per-test durations (pytest's JUnit XML) as a JSON, with the machine.

Usage:
  .venv/bin/python -m pytest tests ... --junitxml=/tmp/main.xml
  .venv/bin/python experiments/suite_durations.py /tmp/main.xml [/tmp/parallel.xml ...] \\
      --wall SECONDS [--wall SECONDS ...] --out experiments/results/suite_durations_NAME.json

Durations are each test's own wall time in its xdist worker; ``wall`` is each pytest command's
elapsed time as measured outside it. The slowest tests and folders are where the suite's time goes.
"""

import argparse
import collections
import json
import os
import platform
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformer_jax.bench import machine


def summarise(path: str, top: int) -> dict:
  tests = []
  for case in ET.parse(path).iter("testcase"):
    outcome = "passed"
    for tag in ("failure", "error", "skipped"):
      if case.find(tag) is not None:
        outcome = tag
    name = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"
    tests.append((float(case.get("time") or 0.0), name, outcome))
  folders = collections.Counter()
  for seconds, name, _ in tests:
    folders[os.path.dirname(name.split("::")[0])] += seconds
  tests.sort(reverse=True)
  return {
    "junit": os.path.basename(path),
    "tests": len(tests),
    "outcomes": dict(collections.Counter(o for _, _, o in tests)),
    "test_seconds": round(sum(s for s, _, _ in tests), 1),
    "by_folder": {k: round(v, 1) for k, v in folders.most_common()},
    "slowest": [{"test": n, "seconds": round(s, 2)} for s, n, _ in tests[:top]],
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("junit", nargs="+")
  p.add_argument("--wall", type=float, action="append", default=[])
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--note", default="")
  p.add_argument("--out", required=True)
  a = p.parse_args()
  runs = [summarise(j, a.top) for j in a.junit]
  for run, wall in zip(runs, a.wall):
    run["wall_seconds"] = wall
  out = {
    "machine": {
      "cpu": machine.cpu_name(),
      "family": machine.cpu_family(),
      "cpus": os.cpu_count(),
      "flags": machine.cpu_flags(),
      "python": platform.python_version(),
    },
    "note": a.note,
    "runs": runs,
  }
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
  print(a.out, [r.get("wall_seconds") for r in runs])


if __name__ == "__main__":
  main()
