"""The kernel table: the levers of a run's kernels, one frozen value that an experiment sets.

A ``KernelTable`` is part of the ``Backend`` a model is built with (``backends.current(table)``),
so it changes the compiled program and nothing else: it is a static field of the model's graph,
recorded in a run's ``config.yaml`` (the experiment's ``kernels:`` section), and ``tjax bench
train --table NAME=N`` builds one to time a lever against the defaults. Every field defaults to
what the library does without a table; the rules that pick an attention kernel from the shapes
are ``ops.choose_implementation``'s.

  ==========================  =========  =====================================================
  field                       backends   what it does
  ==========================  =========  =====================================================
  ``pad_cols``                all        the tied vocabulary product (a weight stored ``[V, D]``)
                                         padded with zero rows to a multiple of N columns, the
                                         padding sliced off (0: off); its GEMM and transposes
                                         see aligned widths
  ``cudnn_packed_segments``   gpu        segment ids go to cuDNN as up to N packed sequences
                                         per row where every run fits (0: always the mask)
  ``step_options``            all        XLA compile options of the train and eval steps, over
                                         the backend's own (``Backend.step_compiler_options``)
  ``decode_options``          all        the same for ``generate``'s decoding loop
  ==========================  =========  =====================================================
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

OptionValue = bool | int | float | str

# The integer levers: field -> (smallest value that does something, largest accepted, what it
# does). 0 is "off"; between 1 and the smallest useful value nothing would change, so those are
# refused rather than accepted as a silent no-op.
INT_LEVERS: dict[str, tuple[int, int, str]] = {
  "pad_cols": (
    2,
    1 << 16,
    "the tied vocabulary product padded to a multiple of N columns (0: off)",
  ),
  "cudnn_packed_segments": (
    2,
    1 << 16,
    "segment ids to cuDNN as up to N packed sequences per row (0: off)",
  ),
}
# The backends a set (non-default) field changes anything on.
APPLIES_ON: dict[str, tuple[str, ...]] = {
  "pad_cols": ("cpu", "gpu", "tpu"),
  "cudnn_packed_segments": ("gpu",),
  "step_options": ("cpu", "gpu", "tpu"),
  "decode_options": ("cpu", "gpu", "tpu"),
}
OPTION_FIELDS = ("step_options", "decode_options")


def integral(value: Any) -> int | None:
  """``value`` as an int, or None: the one rule for an integer field, whatever the file or
  section (kernel levers here, every integer field of an experiment through ``runs.schema``). An
  int; a finite float with an integral value (``1000.0``, ``1.0e+3``); a string holding either
  (PyYAML reads ``1e3`` and ``1.0e3`` as strings; a quoted number too). Never a bool."""
  if isinstance(value, bool):
    return None
  if isinstance(value, int):
    return value
  if isinstance(value, str):
    text = value.strip()
    try:
      return int(text)
    except ValueError:
      pass
    try:
      value = float(text)
    except ValueError:
      return None
  if isinstance(value, float) and math.isfinite(value) and value == int(value):
    return int(value)
  return None


def _integer(name: str, value: Any) -> int:
  """``integral(value)``; raises ``ValueError`` naming ``name`` where it is None."""
  number = integral(value)
  if number is None:
    raise ValueError(f"{name}={value!r}: expected an integer")
  return number


def _options(name: str, value: Any) -> tuple[tuple[str, OptionValue], ...]:
  """A mapping of XLA option names to values as sorted ``(name, value)`` pairs (hashable)."""
  if isinstance(value, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
    value = dict(value)
  if not isinstance(value, Mapping):
    raise ValueError(f"{name}={value!r}: expected a mapping of XLA options (xla_...: value)")
  out = []
  for key, v in value.items():
    if not isinstance(key, str) or not key.startswith("xla_"):
      raise ValueError(f"{name}.{key}: expected an XLA option name (xla_...)")
    if not isinstance(v, (bool, int, float, str)):
      raise ValueError(f"{name}.{key}={v!r}: expected true/false, a number or a string")
    out.append((key, v))
  return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class KernelTable:
  """The levers of a run's kernels (see the module's table); validated, hashable.

  Attributes:
    pad_cols: the tied vocabulary product's width padded to a multiple of this (0: off).
    cudnn_packed_segments: segment ids to cuDNN as up to this many packed sequences per row
      (0: always as a mask). GPUs only.
    step_options: ``(name, value)`` XLA compile options of the train and eval steps, applied over
      the backend's own.
    decode_options: the same for the decoding loop.

  Raises:
    ValueError: naming the field and the value, for a value out of range or of the wrong type.
  """

  pad_cols: int = 0
  cudnn_packed_segments: int = 0
  step_options: tuple[tuple[str, OptionValue], ...] = ()
  decode_options: tuple[tuple[str, OptionValue], ...] = ()

  def __post_init__(self):
    for name, (low, high, _) in INT_LEVERS.items():
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r}: expected an integer")
      if value != 0 and not low <= value <= high:
        raise ValueError(f"{name}={value} must be 0 (off) or an integer from {low} to {high}")
    for name in OPTION_FIELDS:
      object.__setattr__(self, name, _options(name, getattr(self, name)))

  @classmethod
  def from_dict(cls, raw: Mapping[str, Any] | None, *, where: str = "kernels") -> KernelTable:
    """A table from a mapping (an experiment's ``kernels:`` section): unknown keys are refused
    with a suggestion, integers may be written in exponent form (``1.28e2``).

    Args:
      raw: field -> value, or None for the defaults.
      where: the section's name in error messages.

    Raises:
      ValueError: naming ``where.field`` and the value.
    """
    if raw is None:
      return cls()
    if not isinstance(raw, Mapping):
      raise ValueError(f"{where}: expected a mapping of kernel-table fields, got {raw!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
      if key not in names:
        close = difflib.get_close_matches(str(key), names, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{where}.{key}: unknown key{hint}; expected one of {', '.join(names)}")
      name = f"{where}.{key}"
      kwargs[key] = _options(name, value) if key in OPTION_FIELDS else _integer(name, value)
    try:
      return cls(**kwargs)
    except ValueError as e:
      raise ValueError(f"{where}.{e}") from None

  def to_dict(self) -> dict[str, Any]:
    """Every field, YAML-able (the option pairs as mappings): ``from_dict``'s inverse."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    for name in OPTION_FIELDS:
      out[name] = dict(out[name])
    return out

  def changed(self) -> dict[str, Any]:
    """The fields set away from their defaults (``to_dict``'s form)."""
    default = KernelTable().to_dict()
    return {k: v for k, v in self.to_dict().items() if v != default[k]}

  def no_effect_on(self, platform: str) -> list[str]:
    """The fields set away from their defaults that change nothing on ``platform``."""
    return [name for name in self.changed() if platform not in APPLIES_ON[name]]
