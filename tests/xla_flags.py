"""XLA flags the test harness sets (tests/conftest.py, ``harness_flags``), imported before JAX
starts its backend."""

import glob
import importlib.util
import mmap
import os

# XLA:CPU's older elemental emitters: the harness compiles with them (``harness_flags`` says why).
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def xla_knows(flag: str) -> bool:
  """Whether this jaxlib's XLA defines ``flag``: XLA aborts the process on a flag it does not know,
  and its CPU flags come and go between releases. Looked up in jaxlib's shared libraries."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    return False
  needle = flag.encode()
  for root in spec.submodule_search_locations:
    for path in glob.glob(os.path.join(root, "**", "*.so"), recursive=True):
      with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m.find(needle) >= 0:
          return True
  return False


def harness_flags(present: str = "") -> list[str]:
  """The XLA:CPU flags the test harness compiles with, less those ``present`` (an ``XLA_FLAGS``
  value) already sets and those this jaxlib does not know. Numerics are unchanged (no fast-math
  either way); the library itself runs with XLA's defaults.

  - ``--xla_backend_optimization_level=0``: the tests' programs are tiny and run a few times
    each, and XLA:CPU's LLVM optimisation passes cost more than they save (about half of every
    compilation).
  - ``OLDER_EMITTERS``: XLA:CPU's MLIR fusion emitters take more than half of every test program's
    compilation; its older elemental emitters compile the same fusions about 2.3x faster. Results
    may differ from the default emitters in the last bits of transcendental functions; the tests
    compare with tolerances against float64 references, and exact comparisons are between two
    programs of one process (or of its subprocesses, which inherit the flag).
  - ``--xla_cpu_parallel_codegen_split_count=1``: XLA:CPU cuts each program's LLVM module into
    pieces it compiles on several threads; the suite's xdist workers already use every core, and
    one piece is 10 to 25% less backend compilation (measured on 14 conformance kinds' forward and
    gradient programs).
  """
  flags = []
  if "xla_backend_optimization_level" not in present:
    flags.append("--xla_backend_optimization_level=0")
  if "xla_cpu_use_fusion_emitters" not in present and xla_knows("xla_cpu_use_fusion_emitters"):
    flags.append(OLDER_EMITTERS)
  split = "xla_cpu_parallel_codegen_split_count"
  if split not in present and xla_knows(split):
    flags.append(f"--{split}=1")
  return flags
