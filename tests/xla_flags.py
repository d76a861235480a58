"""XLA flags the test harness sets (tests/conftest.py), imported before JAX starts its backend."""

import glob
import importlib.util
import mmap
import os

# XLA:CPU's older elemental emitters: the harness compiles with them (tests/conftest.py says why).
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
