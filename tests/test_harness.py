"""The test session's own machinery (tests/conftest.py): what each xdist worker keeps between
folders."""

import types

import jax
import numpy as np

from tests import conftest


def test_compiled_programs_are_released_at_the_end_of_each_folder(request):
  item = request.node
  here = types.SimpleNamespace(path=item.path.parent / "test_other.py")
  elsewhere = types.SimpleNamespace(path=item.path.parent / "ops" / "test_norms.py")
  assert not conftest.release_boundary(item, here)
  assert conftest.release_boundary(item, elsewhere) and conftest.release_boundary(item, None)

  double = jax.jit(lambda x: 2 * x)
  np.testing.assert_allclose(double(np.ones(3)), 2.0)
  assert double._cache_size() == 1   # noqa: SLF001 - the jit function's executables
  conftest.release_compiled_programs()
  assert double._cache_size() == 0   # noqa: SLF001
  np.testing.assert_allclose(double(np.ones(3)), 2.0)   # compiled again when called
