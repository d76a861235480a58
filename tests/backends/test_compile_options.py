"""The backends' compile options: each platform's own, the kernel table's over them, and the
notice when bfloat16 would be slower here."""

import jax
import jax.numpy as jnp
import pytest

from transformer_jax import backends, hardware, runtime
from transformer_jax.backends import compile as compile_lib
from transformer_jax.backends.cpu import backend as cpu_backend
from transformer_jax.backends.cpu import onednn


@pytest.mark.usefixtures("onednn_steps")
def test_packed_segments_put_conditionals_in_the_gpu_command_buffers():
  # Packed segments choose their cuDNN call in a lax.cond per attention: on GPUs the step keeps
  # those conditionals inside its CUDA graphs; nothing changes while the lever is off, or off GPUs.
  packed = backends.KernelTable(cudnn_packed_segments=16)
  assert "xla_gpu_enable_command_buffer" not in backends.for_platform("gpu").step_compiler_options()
  gpu = backends.for_platform("gpu", packed).step_compiler_options()
  assert gpu == {
    **compile_lib.GPU_STEP_OPTIONS,
    "xla_gpu_enable_command_buffer": compile_lib.GPU_COMMAND_BUFFERS_WITH_CONDITIONALS,
  }
  assert "CONDITIONAL" in gpu["xla_gpu_enable_command_buffer"].split(",")
  assert backends.for_platform("cpu", packed).step_compiler_options() == onednn.ONEDNN_DOTS
  # The table's own step options go over both (the host-side conditionals' variant).
  host = backends.KernelTable(
    cudnn_packed_segments=16, step_options={"xla_gpu_enable_command_buffer": "FUSION"}
  )
  assert (
    backends.for_platform("gpu", host).step_compiler_options()["xla_gpu_enable_command_buffer"]
    == "FUSION"
  )
  # XLA takes the list as a compile option (its flag's "+CONDITIONAL" form it does not).
  jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile(
    compiler_options={"xla_gpu_enable_command_buffer": gpu["xla_gpu_enable_command_buffer"]}
  )


def test_decoding_compiles_without_triton_gemms_on_gpus_only():
  # The GPU decoding loop's first call: 33.9 s with Triton GEMMs autotuned, 6.2 s without
  # (experiments/PERFORMANCE.md, "XLA:GPU options").
  decode = {p: backends.for_platform(p).decode_compiler_options() for p in ("cpu", "gpu", "tpu")}
  assert decode == {"gpu": {"xla_gpu_enable_triton_gemm": False}, "cpu": {}, "tpu": {}}
  gpu = backends.for_platform("gpu")
  gpu.decode_compiler_options().clear()  # a copy
  assert gpu.decode_compiler_options() == dict(compile_lib.GPU_DECODE_OPTIONS) != {}
  with pytest.raises(TypeError):  # the library's option sets change through a table only
    compile_lib.GPU_DECODE_OPTIONS["xla_gpu_autotune_level"] = 0
  table = backends.KernelTable(decode_options={"xla_gpu_autotune_level": 1})
  assert backends.for_platform("gpu", table).decode_compiler_options() == {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_autotune_level": 1,
  }
  assert backends.for_platform("cpu", table).decode_compiler_options() == {
    "xla_gpu_autotune_level": 1
  }


def test_bf16_notice_only_without_bf16_hardware(monkeypatch):
  assert runtime.bf16_notice("float32") is None
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # accelerators: never a notice
  monkeypatch.setattr(hardware, "has_bf16_units", lambda: False)
  assert runtime.bf16_notice("bfloat16") is None
  assert backends.for_platform("tpu").bf16_notice(jnp.bfloat16) is None
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(cpu_backend, "_warned_bf16", False)
  with pytest.warns(UserWarning, match="slower than dtype=float32"):
    text = runtime.bf16_notice("bfloat16")
  assert "avx512_bf16" in text
  assert backends.CpuBackend(bf16_units=False).bf16_notice(jnp.bfloat16) == text  # once
  monkeypatch.setattr(hardware, "has_bf16_units", lambda: True)
  assert runtime.bf16_notice("bfloat16") is None
