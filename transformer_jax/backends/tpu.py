"""The TPU backend: Pallas splash attention where the table chooses it (per device under a mesh
that splits the batch or heads), everything else as on any platform."""

from __future__ import annotations

import dataclasses

from transformer_jax.backends.base import Backend


@dataclasses.dataclass(frozen=True)
class TpuBackend(Backend):
  """TPUs through XLA:TPU."""

  platform = "tpu"
