"""Process settings: the persistent compilation cache, and the machine's description and limits.
The CPU backend's own settings are checked in tests/backends/cpu."""

import os
import subprocess
import sys
import textwrap

import pytest

from transformer_jax import runtime
from transformer_jax.bench import machine
from tests import conftest
from tests.backends import only_on


def test_the_core_never_imports_the_bench():
  """runtime and the CPU profile load without any of transformer_jax.bench."""
  script = (
    "import sys; from transformer_jax import runtime; "
    "from transformer_jax.backends.cpu import allocator, measured, microbatches, onednn; "
    "from transformer_jax.backends.cpu import poll; "
    "print(sorted(m for m in sys.modules if m.startswith('transformer_jax.bench')))"
  )
  out = subprocess.run(
    [sys.executable, "-c", script], check=True, capture_output=True, text=True
  ).stdout
  assert out.strip() == "[]"


def test_second_process_loads_the_compiled_step_from_the_cache(tmp_path):
  """A second process compiling the same function finds it in the folder and does not compile."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, sys
      from transformer_jax import runtime
      print(runtime.enable_compilation_cache(sys.argv[1]))
      jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
      hits = []
      jax.monitoring.register_event_listener(
          lambda name, **kw: hits.append(name) if name.endswith("/cache_hits") else None)
      f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum())
      f(jnp.ones((64, 64))).block_until_ready()
      print(len(hits))
  """)
  env = conftest.own_cache_env()
  cache = tmp_path / "xla"
  seen = []
  for _ in range(2):
    out = subprocess.run(
      [sys.executable, "-c", script, str(cache)],
      env=env,
      check=True,
      capture_output=True,
      text=True,
    ).stdout
    folder, hits = out.split()
    assert folder == str(cache)
    seen.append((int(hits), sorted(p for p in os.listdir(cache) if p.endswith("-cache"))))
  (hits0, files0), (hits1, files1) = seen
  assert hits0 == 0 and any(p.startswith("jit__lambda-") for p in files0), files0
  assert hits1 >= 1 and files1 == files0  # loaded from the folder, nothing compiled anew


def test_cache_can_be_turned_off(monkeypatch):
  monkeypatch.setenv("TJAX_COMPILATION_CACHE", "0")
  assert runtime.enable_compilation_cache() is None


def test_machine_description_names_cpu_and_flags():
  d = machine.describe()
  assert d["cpu"] and isinstance(d["cpu_flags"], list)
  assert d["bf16_hardware"] == any(f in d["cpu_flags"] for f in machine.BF16_FLAGS)
  # How idle CPUs wait, as /sys says (nothing where it says nothing).
  for key, path in (
    ("driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
    ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns"),
  ):
    if os.path.exists(path):
      with open(path) as f:
        assert str(d["cpu_idle"][key]) == f.read().strip()
    else:
      assert key not in d["cpu_idle"]


@only_on("cpu", "XLA:CPU's product libraries")
@pytest.mark.usefixtures("onednn_steps")
def test_matmul_limit_counts_flops_of_each_layout_and_library():
  r = machine.matmul_limit([(64, 32, 48)], reps=1)
  rates = r["per_shape"]["64x32x48"]
  assert set(rates) == {"x@W", "dy@W^T", "x^T@dy"}
  # The limit is the best of every library the step may use: oneDNN's rates are measured too.
  assert set(r["per_library"]) == {"onednn"}
  dnn = r["per_library"]["onednn"]["64x32x48"]
  assert set(dnn) == {"x@W", "dy@W^T", "x^T@dy"}
  assert r["flops_per_sec"] == max(*rates.values(), *dnn.values()) > 0
