"""Which CPUs each rule of the CPU backend was measured on (``backends.cpu.measured``)."""

import pytest

from transformer_jax.backends.cpu import measured


def test_every_cpu_rule_names_the_cpus_it_was_measured_on():
  assert set(measured.MEASURED_ON) == {
    "onednn_step_products",
    "mimalloc",
    "cpu_poll",
    "auto_microbatches",
  }
  for rule, kinds in measured.MEASURED_ON.items():
    assert kinds and all(isinstance(k, measured.CpuKind) for k in kinds), rule
    assert isinstance(measured.this_cpu_measured(rule), bool)
  assert measured.measured_on("onednn_step_products") == (measured.EPYC_ZEN4,)
  with pytest.raises(ValueError, match="rule 'nope' is not one of"):
    measured.measured_on("nope")


def test_cpu_kinds_match_by_name_family_model_and_flags():
  zen4_flags = ["avx", "avx2", "fma", "avx512f", "avx512_bf16"]
  assert measured.parse_family("cpu family 25, model 17") == (25, 17)
  assert measured.parse_family("") == (None, None)
  assert measured.EPYC_ZEN4.matches("AMD EPYC 9B14", 25, 17, zen4_flags)
  assert not measured.EPYC_ZEN4.matches("AMD EPYC 9B14", 25, 1, zen4_flags)
  assert measured.EPYC_ZEN5.matches("AMD EPYC 9B45", 26, 2, zen4_flags)
  assert measured.EPYC_AVX2.matches("AMD EPYC 7B12", 23, 49, ["avx", "avx2", "fma"])
  assert not measured.EPYC_AVX2.matches("AMD EPYC 9B14", 25, 17, zen4_flags)  # has AVX-512
  xeon = ["avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"]
  assert not any(
    k.matches("Intel(R) Xeon(R) Processor", 6, 143, xeon)
    for k in (measured.EPYC_AVX2, measured.EPYC_ZEN4, measured.EPYC_ZEN5)
  )
