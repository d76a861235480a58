"""``hardware``: datasheet peaks by device kind, and the device this process computes on."""

import json
import os

import jax
import pytest

from transformer_jax import hardware


@pytest.mark.parametrize(
  "kind,dtype,want",
  [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "float32", 66.9e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),  # not the SXM part: "h100 pcie" is tried first
    ("nvidia h100 pcie", "float32", 51.2e12),
    ("NVIDIA H200", "bfloat16", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", "bfloat16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "float32", 19.5e12),
    ("TPU v4", "bfloat16", 275e12),
    ("TPU v5 lite", "bfloat16", 197e12),  # v5e, not v5p
    ("TPU v5", "bfloat16", 459e12),
    ("TPU v5p", "bfloat16", 459e12),
    ("TPU v6 lite", "bfloat16", 918e12),
  ],
)
def test_peak_flops_by_kind_and_dtype(kind, dtype, want):
  assert hardware.peak_flops(kind, dtype) == want


def test_unknown_kinds_and_dtypes_have_no_peak():
  assert hardware.peak_flops("cpu", "float32") is None
  assert hardware.peak_flops("Some Future Accelerator", "bfloat16") is None
  assert hardware.peak_flops("TPU v4", "float32") is None  # TPUs list bfloat16 only
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
  monkeypatch.setenv(hardware.LIMIT_CACHE_ENV, "0")
  rate, source = hardware.matmul_peak("float32")
  assert source == "measured" and 1e8 < rate < 1e15


@pytest.fixture
def measured(monkeypatch, tmp_path):
  """A CPU whose products are timed by a stand-in (counted), its cache under ``tmp_path``."""
  calls = []
  monkeypatch.setattr(hardware, "device_kind", lambda: "cpu")
  monkeypatch.setattr(hardware, "measure_matmul", lambda dtype: calls.append(dtype) or 2e11)
  monkeypatch.delenv(hardware.LIMIT_CACHE_ENV, raising=False)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
  return calls


def test_a_cpu_limit_is_measured_once_per_machine_and_cached(measured, tmp_path, monkeypatch):
  assert hardware.matmul_peak("float32") == (2e11, "measured")
  path = tmp_path / "cache" / "transformer_jax" / "matmul_limits.json"
  assert hardware.limit_cache_path() == str(path)
  assert json.loads(path.read_text()) == {hardware.limit_key("float32"): 2e11}
  assert hardware.matmul_peak("float32") == (2e11, "cached") and measured == ["float32"]
  # Another dtype, CPU, or JAX version is another machine as far as the limit goes.
  assert hardware.matmul_peak("bfloat16")[1] == "measured"
  monkeypatch.setattr(jax, "__version__", "0.0.1")
  assert hardware.matmul_peak("float32")[1] == "measured"
  assert measured == ["float32", "bfloat16", "float32"]
  key = hardware.limit_key("float32")
  for part in (hardware.cpu_name(), "jax 0.0.1", "float32", " ".join(hardware.cpu_flags()) or "-"):
    assert part in key


def test_the_limit_cache_can_be_turned_off_or_moved(measured, tmp_path, monkeypatch):
  monkeypatch.setenv(hardware.LIMIT_CACHE_ENV, "0")
  assert hardware.limit_cache_path() is None
  for _ in range(2):
    assert hardware.matmul_peak("float32") == (2e11, "measured")
  assert measured == ["float32"] * 2 and not (tmp_path / "cache").exists()
  monkeypatch.setenv(hardware.LIMIT_CACHE_ENV, str(tmp_path / "elsewhere"))
  hardware.matmul_peak("float32")
  assert (tmp_path / "elsewhere" / "matmul_limits.json").is_file()


def test_a_damaged_cache_is_measured_again_and_a_limit_only_rises(measured, tmp_path):
  path = tmp_path / "cache" / "transformer_jax" / "matmul_limits.json"
  path.parent.mkdir(parents=True)
  path.write_text("{not json")
  assert hardware.matmul_peak("float32") == (2e11, "measured")
  assert not hardware.store_limit("float32", 1e11)  # lower: kept as it was
  assert hardware.store_limit("float32", 3e11)
  assert hardware.matmul_peak("float32") == (3e11, "cached")


def test_mfu_never_passes_100_percent_the_limit_rises_instead(measured, tmp_path):
  """A limit measured on a busy machine (here 2e11 FLOP/s) is below what a step reaches: the
  MFU is 1 and the machine's limit becomes the step's rate."""
  from transformer_jax.train import metrics

  peak, source = hardware.matmul_peak("float32")
  mfu = metrics.MFU(flops_per_token=1e6, peak=peak, source=source, devices=2, dtype="float32")
  assert mfu(2e5) == pytest.approx(0.5)  # 1e11 per device: half the limit
  assert mfu(1e6) == 1.0  # 5e11 per device: above it
  assert hardware.matmul_peak("float32") == (5e11, "cached")
  assert mfu(5e5) == pytest.approx(0.5)  # counted against the raised limit
  sheet = metrics.MFU(
    flops_per_token=1e6, peak=1e11, source="datasheet", devices=1, dtype="float32"
  )
  assert sheet(2e5) == pytest.approx(2.0)  # a datasheet is never rewritten
  assert hardware.matmul_peak("float32") == (5e11, "cached")


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux's /proc/meminfo")
def test_host_memory_available_is_the_kernels_figure():
  free = hardware.host_memory_available()
  with open("/proc/meminfo") as f:
    meminfo = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
  assert free is not None and 0 < free <= meminfo["MemAvailable"]
