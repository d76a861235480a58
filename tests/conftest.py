"""Test-session options shared by every test directory.

``TJAX_ATTENTION_IMPL=chunked python -m pytest tests/...`` runs the tests with that attention kernel:
every model config built in this test process (presets, ``get_config``, configs read from Hugging
Face or a run directory) that leaves ``attention_impl`` at its default None gets it, and tests that
build layers directly pass ``FORCED_IMPL``. This is a test-session patch of the config classes,
applied here; the library itself has no such switch (the kernel is always the config's
``attention_impl``). Commands run in subprocesses are not affected.
"""

import os

import pytest

from transformer_jax.models import config as config_lib

FORCED_IMPL = os.environ.get("TJAX_ATTENTION_IMPL") or None

# Tests compile afresh and leave no files in the user's cache folder (tests/test_runtime.py checks
# the persistent compilation cache itself, in a temporary folder).
os.environ.setdefault("TJAX_COMPILATION_CACHE", "0")


def pytest_report_header(config):
  return f"attention implementation: {FORCED_IMPL or 'the configs own (default None = auto)'}"


def pytest_configure(config):
  """Patches the config classes before collection, so configs built at import time are covered."""
  if FORCED_IMPL is None:
    return
  if FORCED_IMPL not in config_lib._ATTENTION_IMPLS:
    raise pytest.UsageError(f"TJAX_ATTENTION_IMPL={FORCED_IMPL!r} must be one of "
                            f"{', '.join(map(repr, config_lib._ATTENTION_IMPLS[1:]))}")
  patch = pytest.MonkeyPatch()
  for cls in (config_lib.GPTConfig, config_lib.BERTConfig, config_lib.Seq2SeqConfig):
    patch.setattr(cls, "__post_init__", _forcing(cls.__post_init__))
  config.add_cleanup(patch.undo)


def _forcing(post_init):
  def wrapped(self):
    if self.attention_impl is None:
      object.__setattr__(self, "attention_impl", FORCED_IMPL)  # frozen dataclass
    post_init(self)
  return wrapped
