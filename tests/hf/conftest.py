"""Hugging Face parity tests: need the ``hf`` extra (torch, transformers); all offline."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch = pytest.importorskip("torch", reason="the hf extra is not installed: pip install -e '.[hf]'")
torch.set_num_threads(1)  # tiny models; with pytest -n 2, more threads only contend with XLA
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
transformers.logging.disable_progress_bar()


@pytest.fixture(autouse=True)
def _quiet_warnings():
  import warnings

  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    yield
