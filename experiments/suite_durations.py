"""Summarises the test suite's per-test durations (pytest's JUnit XML) as a JSON, with the machine.

Usage:
  .venv/bin/python experiments/suite_durations.py --reference          # prints R1
  .venv/bin/python -m pytest tests ... --junitxml=/tmp/main.xml
  .venv/bin/python experiments/suite_durations.py --reference          # prints R2
  .venv/bin/python experiments/suite_durations.py /tmp/main.xml [/tmp/parallel.xml ...] \\
      --wall SECONDS [--wall SECONDS ...] --reference-seconds R1 --reference-seconds R2 \\
      --out experiments/results/suite_durations_NAME.json

Durations are each test's own wall time in its xdist worker; ``wall`` is each pytest command's
elapsed time as measured outside it. The slowest tests and folders are where the suite's time goes.

A machine whose speed moves between minutes (a shared cloud CPU) gives the same suite different
durations; ``--reference`` measures the machine's speed at that moment on the suite's own kind of
work, in a fresh interpreter with the suite's XLA flags and no compilation cache: compiling and
running the forward and gradient programs of four tiny presets, and ``REFERENCE_OPS`` op-by-op
dispatches. Taken just before and just after the suite, it says which phase of the machine the
suite's durations were taken in.
"""

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.xla_flags import harness_flags  # noqa: E402
from transformer_jax.bench import machine  # noqa: E402

REFERENCE_PRESETS = ("gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny")
REFERENCE_OPS = 200

# The reference work, timed in its own interpreter after its imports.
_REFERENCE = """
import sys, time
import jax, jax.numpy as jnp
import transformer_jax as tj
presets, ops = sys.argv[1].split(","), int(sys.argv[2])
start = time.perf_counter()
for name in presets:
  config = tj.models.get_config(name)
  params = tj.models.init(config, jax.random.key(0))
  tokens = jnp.zeros((2, 16), jnp.int32)
  inputs = (tokens, tokens) if isinstance(config, tj.models.Seq2SeqConfig) else (tokens,)
  def loss(p):
    out = jax.tree.leaves(tj.models.apply(config, p, *inputs))
    return sum(jnp.mean(x**2) for x in out if jnp.issubdtype(x.dtype, jnp.floating))
  jax.block_until_ready(jax.jit(jax.value_and_grad(loss))(params))
for n in range(ops):
  jax.block_until_ready(jnp.ones((n + 1, 3)) * 2)
print(round(time.perf_counter() - start, 3))
"""


def reference_seconds(presets=REFERENCE_PRESETS, ops: int = REFERENCE_OPS) -> float:
  """Seconds of the reference work (the module's docstring) in a fresh interpreter on CPU."""
  drop = ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "XLA_FLAGS")
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(harness_flags()), TJAX_COMPILATION_CACHE="0")
  env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  out = subprocess.run(
    [sys.executable, "-c", _REFERENCE, ",".join(presets), str(ops)],
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )
  if out.returncode != 0:
    raise RuntimeError(f"the reference work failed:\n{out.stderr[-2000:]}")
  return float(out.stdout.split()[-1])


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
  p.add_argument("junit", nargs="*")
  p.add_argument("--wall", type=float, action="append", default=[])
  p.add_argument("--top", type=int, default=30)
  p.add_argument("--note", default="")
  p.add_argument("--out")
  p.add_argument("--reference", action="store_true", help="print the reference work's seconds")
  p.add_argument("--reference-seconds", type=float, action="append", default=[])
  a = p.parse_args()
  if a.reference:
    print(reference_seconds())
    return
  if not a.junit or not a.out:
    p.error("give the JUnit files and --out (or --reference alone)")
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
    "reference_seconds": a.reference_seconds,
    "runs": runs,
  }
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
  print(a.out, [r.get("wall_seconds") for r in runs])


if __name__ == "__main__":
  main()
