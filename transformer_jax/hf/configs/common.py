"""What the config translators share: typed reads of ``config.json`` and the activation names.

``Fields`` reads each value of a Hugging Face ``config.json`` mapping as the type transformers
gives that field and refuses anything else by name (``CheckpointError``), never coercing.
``require`` refuses an option we do not implement (``UnsupportedError``). ``ACTIVATIONS`` maps
transformers' activation names to ours, ``activation`` reads one, and ``ACTIVATIONS_BACK`` is the
name each of ours is written as.
"""

from __future__ import annotations

import math

from transformer_jax import ops
from transformer_jax.hf.errors import CheckpointError, UnsupportedError

# Hugging Face activation names (ACT2FN) -> ours.
ACTIVATIONS = {
  "gelu": "gelu",
  "gelu_new": "gelu_tanh",
  "gelu_pytorch_tanh": "gelu_tanh",
  "relu": "relu",
  "silu": "silu",
  "swish": "silu",
}
ACTIVATIONS_BACK = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu", "silu": "silu"}


def activation(name, field: str) -> ops.Activation:
  """Ours for transformers' activation ``name`` (read from ``field``); others are refused."""
  if name not in ACTIVATIONS:
    raise UnsupportedError(f"{field}={name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
  return ACTIVATIONS[name]


def require(hf: dict, field: str, expected, default=None) -> None:
  """Refuses ``hf[field]`` (``default`` when absent) unless it is ``expected``, type included."""
  value = hf.get(field, default)
  if value != expected or type(value) is not type(expected):
    raise UnsupportedError(f"{field}={value!r} is not supported (only {expected!r})")


def _is_list(v) -> bool:
  return isinstance(v, (list, tuple))


class Fields:
  """Typed reads of a ``config.json`` mapping: each value is checked against the type the field
  has in transformers, never coerced (``sliding_window: 4.7`` is refused, not read as 4). A key
  that is absent gives the default; ``null`` is taken only where ``null=True``.

  Raises (every method):
    CheckpointError: ``field=value: expected ...``, naming the field (``prefix.field`` inside a
      nested object).
  """

  def __init__(self, hf: dict, prefix: str = ""):
    self.hf, self.prefix = hf, prefix

  def _get(self, field: str, default, null: bool, kind: str, ok) -> object:
    value = self.hf.get(field, default)
    if value is None and (null or default is None and field not in self.hf):
      return None
    if not ok(value):
      raise CheckpointError(f"{self.prefix}{field}={value!r}: expected {kind}")
    return value

  def int(self, field: str, default=None, *, null: bool = False) -> int | None:
    value = self._get(
      field,
      default,
      null,
      "an integer",
      lambda v: (
        not isinstance(v, bool) and (isinstance(v, int) or isinstance(v, float) and v.is_integer())
      ),
    )
    return None if value is None else int(value)  # 4096.0 is 4096; 4.7 was refused

  def number(self, field: str) -> int | float:
    """A required number that may be infinite (``float()`` refuses that)."""
    return self._get(
      field,
      None,
      False,
      "a number",
      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    )

  def float(self, field: str, default=None, *, null: bool = False) -> float | None:
    value = self._get(
      field,
      default,
      null,
      "a number",
      lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    )
    if value is not None and not math.isfinite(value):
      raise CheckpointError(f"{self.prefix}{field}={value!r}: expected a finite number")
    return None if value is None else float(value)

  def bool(self, field: str, default=None, *, null: bool = False) -> bool | None:
    return self._get(field, default, null, "true or false", lambda v: isinstance(v, bool))

  def str(self, field: str, default=None, *, null: bool = False) -> str | None:
    return self._get(field, default, null, "a string", lambda v: isinstance(v, str))

  def ints(self, field: str, default=None) -> tuple[int, ...] | None:
    """A list of integers (``[64, 64]``), as a tuple; each item checked as ``int`` does."""
    value = self._get(field, default, False, "a list of integers", _is_list)
    if value is None:
      return None
    items = Fields({f"{field}[{i}]": v for i, v in enumerate(value)}, self.prefix)
    return tuple(items.int(key) for key in items.hf)

  def strs(self, field: str, default=None) -> tuple[str, ...] | None:
    """A list of strings (``["local", "lsh"]``), as a tuple."""
    value = self._get(
      field,
      default,
      False,
      "a list of strings",
      lambda v: _is_list(v) and all(isinstance(x, str) for x in v),
    )
    return None if value is None else tuple(value)

  def object(self, field: str, *, null: bool = True) -> dict:
    """A nested object (absent or null: empty)."""
    return self._get(field, None, null, "an object", lambda v: isinstance(v, dict)) or {}
