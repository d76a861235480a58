"""The test session's own machinery (tests/conftest.py): what each xdist worker keeps between
test modules."""

import pathlib
import subprocess
import sys
import textwrap
import types

import jax
import numpy as np
import pytest

from tests import conftest
from tests.backends import only_on


def test_compiled_programs_are_released_at_the_end_of_each_module(request):
  item = request.node
  here = types.SimpleNamespace(path=item.path)
  beside = types.SimpleNamespace(path=item.path.parent / "test_other.py")
  elsewhere = types.SimpleNamespace(path=item.path.parent / "ops" / "test_norms.py")
  assert not conftest.release_boundary(item, here)
  assert conftest.release_boundary(item, beside) and conftest.release_boundary(item, elsewhere)
  assert conftest.release_boundary(item, None)

  double = jax.jit(lambda x: 2 * x)
  np.testing.assert_allclose(double(np.ones(3)), 2.0)
  assert double._cache_size() == 1
  conftest.release_compiled_programs()
  assert double._cache_size() == 0
  np.testing.assert_allclose(double(np.ones(3)), 2.0)  # compiled again when called


@pytest.mark.long
@only_on("cpu", "XLA:CPU's oneDNN products")
@pytest.mark.usefixtures("onednn_steps")
def test_releasing_after_a_held_onednn_step_ran_does_not_abort():  # about 9 s: a new process
  """Clearing JAX's caches destroys the executables behind held ``jax.jit`` steps; one with oneDNN
  products destroyed just after a call aborts the process (``backends.cpu.onednn``). A step big
  enough to be still running (or just done) when the release starts, ten times, in a fresh
  process."""
  from transformer_jax import backends

  if not backends.for_platform("cpu").step_compiler_options():
    pytest.skip("this jaxlib does not take the oneDNN options")
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp
      from transformer_jax.backends.cpu import onednn
      from tests import conftest
      x = jnp.ones((16, 384, 384))
      for i in range(10):
        step = onednn.hold(jax.jit(lambda a, i=i: a @ a + i, compiler_options=onednn.ONEDNN_DOTS),
                           onednn.ONEDNN_DOTS)
        y = step(x)
        conftest.release_compiled_programs()
      print("released", float(y[0, 0, 0]))
  """)
  out = subprocess.run(
    [sys.executable, "-c", script],
    capture_output=True,
    text=True,
    cwd=pathlib.Path(__file__).parent.parent,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ["released", "393.0"]
