"""``hardware``: datasheet peaks by device kind, and the device this process computes on."""

import jax
import pytest

from transformer_jax import hardware


@pytest.mark.parametrize("kind,dtype,want", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "float32", 66.9e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),      # not the SXM part: "h100 pcie" is tried first
    ("nvidia h100 pcie", "float32", 51.2e12),
    ("NVIDIA H200", "bfloat16", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "float32", 19.5e12),
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),           # v5e, not v5p
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
])
def test_peak_flops_by_kind_and_dtype(kind, dtype, want):
  assert hardware.peak_flops(kind, dtype) == want


def test_unknown_kinds_and_dtypes_have_no_peak():
  assert hardware.peak_flops("cpu", "float32") is None
  assert hardware.peak_flops("Some Future Accelerator", "bfloat16") is None
  assert hardware.peak_flops("TPU v4", "float32") is None      # TPUs list bfloat16 only
  assert hardware.peak_flops("NVIDIA H100 80GB HBM3", "float8") is None
  assert hardware.peak_flops("TPU v4 lite", "bfloat16") is None  # not taken for a v4


def test_kinds_are_matched_after_normalizing():
  assert hardware.normalize_kind("NVIDIA  A100-SXM4_80GB") == "nvidia a100 sxm4 80gb"
  # Every table key is already normalized, so each can match.
  for key, _ in hardware.PEAK_FLOPS:
    assert hardware.normalize_kind(key) == key


def test_this_process_device():
  assert hardware.device_kind() == jax.devices()[0].device_kind
  if jax.default_backend() == "cpu":
    assert hardware.peak_flops(hardware.device_kind(), "float32") is None


def test_matmul_peak_is_the_datasheet_or_a_measured_rate(monkeypatch):
  monkeypatch.setattr(hardware, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
  assert hardware.matmul_peak("bfloat16") == (989.4e12, "datasheet")
  monkeypatch.setattr(hardware, "device_kind", lambda: "cpu")
  rate, source = hardware.matmul_peak("float32")
  assert source == "measured" and 1e8 < rate < 1e15
