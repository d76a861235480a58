"""bench.profile: kernel kinds, the per-step sums, and a real trace read back on this backend."""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from transformer_jax.bench import profile


@pytest.mark.parametrize(
  "name,kind",
  [
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_256x128>", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata>", "optimizer"),
    ("memcpy128", "copy"),
    ("loop_multiply_fusion", "other"),
    ("input_reduce_fusion_42", "other"),
    ("triton_per_fused__to_copy_add_native_layer_norm_backward_view_11", "other"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy"),
  ],
)
def test_kind_of_names_seen_on_an_h100(name, kind):
  assert profile.kind_of(name) == kind


def test_summarize_sums_per_step_and_measures_the_span():
  kernels = [
    ("gemm_a", 0.0, 10.0),
    ("loop_add_fusion", 12.0, 3.0),
    ("flash_fwd", 20.0, 5.0),
    ("gemm_a", 30.0, 10.0),
  ]
  out = profile.summarize(kernels, steps=2)
  assert out["kernels_per_step"] == 2.0
  assert out["device_ms_per_step"] == pytest.approx(28.0 / 1e3 / 2)
  assert out["span_ms_per_step"] == pytest.approx(40.0 / 1e3 / 2)
  assert out["by_kind_ms_per_step"] == pytest.approx(
    {"matmul": 0.01, "attention": 0.0025, "other": 0.0015}
  )
  assert out["top"][0] == {
    "name": "gemm_a",
    "kind": "matmul",
    "calls_per_step": 1.0,
    "ms_per_step": pytest.approx(0.01),
  }
  assert profile.summarize([], steps=3)["span_ms_per_step"] == 0.0


def test_jax_kernels_reads_a_real_trace(tmp_path):
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  x = jnp.ones((64, 64))
  f(x).block_until_ready()
  kept = tmp_path / "ours.trace.json.gz"
  out = profile.jax_kernels(lambda: f(x).block_until_ready(), 2, keep=str(kept))
  assert out["steps"] == 2 and "error" not in out
  with gzip.open(kept, "rt") as fh:
    assert json.load(fh)["traceEvents"]
  assert out["threads"], "the trace held no events at all"
  if jax.default_backend() == "gpu":
    assert out["kernels_per_step"] >= 1 and out["by_kind_ms_per_step"]
  else:  # no GPU kernels to count
    assert out["kernels_per_step"] == 0
