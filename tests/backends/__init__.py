"""Marks for tests that check one backend's own machinery (XLA:CPU's kernels and compiled code, a
GPU kernel): elsewhere they skip, saying which backend they need."""

import jax
import pytest

BACKEND = jax.default_backend()


def only_on(platform: str, what: str):
  """Skips the test unless JAX's default backend is ``platform``; ``what`` names what it checks."""
  return pytest.mark.skipif(
    BACKEND != platform, reason=f"{what} exists on {platform} only; this backend is {BACKEND}"
  )
