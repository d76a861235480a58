"""``train.microbatches: auto`` on CPU (``backends.cpu.microbatches``)."""

import pytest

from transformer_jax.backends.cpu import microbatches
from tests.train.conftest import CompiledStandIn


@pytest.mark.parametrize(
  "platform, malloc, want, compiled",
  [
    ("cpu", "mimalloc", 4, [1, 4]),
    ("cpu", "glibc", 1, [1]),  # the limit is mimalloc's
    ("gpu", "mimalloc", 1, [1]),  # and the CPU's
  ],
)
def test_auto_microbatches_only_on_cpu_over_mimalloc(platform, malloc, want, compiled):
  calls = []

  def compile_step(m):
    calls.append(m)
    return CompiledStandIn({1: 5000, 4: 1900}[m])

  m, step = microbatches.resolve_auto(compile_step, 8, platform=platform, malloc=malloc, limit=2000)
  assert (m, calls) == (want, compiled) and step.temp == {1: 5000, 4: 1900}[m]
