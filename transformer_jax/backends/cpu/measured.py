"""Which CPUs each runtime rule of the CPU profile was measured on.

The rules apply on every CPU, as they always have; this table is the record of where their timings
came from (experiments/PERFORMANCE.md has the figures), so that a result from another CPU can be
read against it and a rule re-measured there. ``this_cpu_measured(rule)`` says whether the CPU
this process runs on is one of them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from transformer_jax import hardware


@dataclasses.dataclass(frozen=True)
class CpuKind:
  """A kind of CPU as ``/proc/cpuinfo`` tells it apart.

  Attributes:
    name: what it is called in experiments/PERFORMANCE.md.
    model_name: text that the CPU's model name (``hardware.cpu_name``) contains.
    family: ``cpu family``, or None where the record does not say.
    model: ``model``, or None for any model of the family.
    flags: instruction-set flags it has (``hardware.cpu_flags`` names); a CPU matches when it has
      them all.
    without: flags it lacks; a CPU with any of them is another kind.
  """

  name: str
  model_name: str
  family: int | None
  model: int | None
  flags: tuple[str, ...] = ()
  without: tuple[str, ...] = ()

  def matches(
    self, cpu_name: str, family: int | None, model: int | None, flags: Iterable[str]
  ) -> bool:
    """Whether a CPU named ``cpu_name``, of ``family``, ``model`` and ``flags`` is of this kind (a
    field the kind leaves None matches anything)."""
    have = set(flags)
    return (
      self.model_name in cpu_name
      and (self.family is None or self.family == family)
      and (self.model is None or self.model == model)
      and set(self.flags) <= have
      and not set(self.without) & have
    )


# The CPUs of the measurements: 2-core AMD EPYC virtual machines.
EPYC_AVX2 = CpuKind(
  "AMD EPYC with AVX2 + FMA, no AVX-512",
  "AMD EPYC",
  None,
  None,
  flags=("avx2", "fma"),
  without=("avx512f",),
)
EPYC_ZEN4 = CpuKind("AMD EPYC Zen 4", "AMD EPYC", 25, 17, flags=("avx512f", "avx512_bf16"))
EPYC_ZEN5 = CpuKind("AMD EPYC Zen 5", "AMD EPYC", 26, None, flags=("avx512f", "avx512_bf16"))

# rule -> the CPU kinds whose measurements chose it.
MEASURED_ON: dict[str, tuple[CpuKind, ...]] = {
  # onednn.ONEDNN_DOTS in the train and eval steps (and onednn.hold, which they need).
  "onednn_step_products": (EPYC_ZEN4,),
  # the tjax launcher's mimalloc (allocator), and its reuse limit behind scratch_notice.
  "mimalloc": (EPYC_AVX2, EPYC_ZEN4, EPYC_ZEN5),
  # poll.cpu_poll around decoding.
  "cpu_poll": (EPYC_ZEN5,),
  # microbatches.auto_microbatches (train.microbatches: auto).
  "auto_microbatches": (EPYC_ZEN4,),
}


def measured_on(rule: str) -> tuple[CpuKind, ...]:
  """The CPU kinds ``rule`` (a key of ``MEASURED_ON``) was measured on.

  Raises:
    ValueError: ``rule`` is not in the table.
  """
  if rule not in MEASURED_ON:
    raise ValueError(f"rule {rule!r} is not one of {', '.join(MEASURED_ON)}")
  return MEASURED_ON[rule]


def parse_family(text: str) -> tuple[int | None, int | None]:
  """``(family, model)`` from ``hardware.cpu_family()``'s text ("cpu family 25, model 17"); None
  for what it does not say."""
  found = {key: int(value) for key, value in re.findall(r"(cpu family|model) (\d+)", text)}
  return found.get("cpu family"), found.get("model")


def this_cpu_measured(rule: str) -> bool:
  """Whether the CPU this process runs on is one of the kinds ``rule`` was measured on.

  Raises:
    ValueError: ``rule`` is not in ``MEASURED_ON``.
  """

  kinds = measured_on(rule)
  family, model = parse_family(hardware.cpu_family())
  flags = hardware.cpu_flags()
  return any(kind.matches(hardware.cpu_name(), family, model, flags) for kind in kinds)
