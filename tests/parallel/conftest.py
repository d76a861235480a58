"""The parallel tests run on 8 simulated CPU devices.

``make test`` runs this directory in its own pytest invocation, so the setting below comes before
JAX starts its CPU backend (the device count is fixed once the backend exists).
"""

import jax
import pytest

NUM_DEVICES = 8

try:
  jax.config.update("jax_num_cpu_devices", NUM_DEVICES)
except RuntimeError:  # the backend was started already (tests collected with other directories)
  pass


@pytest.fixture(autouse=True)
def _eight_devices():
  if jax.device_count() != NUM_DEVICES:
    raise RuntimeError(
      f"tests/parallel need {NUM_DEVICES} devices but JAX has {jax.device_count()}: run them in "
      f"their own process (`pytest tests/parallel`, as `make test` does)"
    )
