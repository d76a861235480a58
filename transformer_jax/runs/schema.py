"""Typed reading of the YAML and JSON the project reads: one loader, one type check.

``parse_yaml`` reads YAML 1.1 (PyYAML's safe subset) plus YAML 1.2's exponent floats: ``1e6``,
``1e-6``, ``2E-2`` and ``1.0e+6`` are numbers, as a user writing a config means them, where
YAML 1.1 reads the first three as strings. Experiment files, dotted overrides, ``config.yaml``
and ``model.yaml`` all go through it.

``coerce`` checks a value against a dataclass field's annotation (``int``, ``float``, ``bool``,
``str``, ``Literal``, unions, tuples, nested dataclasses): an int is taken for a float, an
integral float (``1e3``) for an int (``integral``) and a list for a tuple, nothing else is
converted, and a float must be finite. Each refusal is a
:class:`FieldError` naming the dotted key and the value.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any, Literal

import yaml

from transformer_jax.backends.table import integral  # the one rule for integer fields


class FieldError(ValueError):
  """A value that does not fit its field; ``key`` is the dotted key (``train.lr``)."""

  def __init__(self, key: str, message: str):
    super().__init__(message)
    self.key = key


class _Loader(yaml.SafeLoader):
  """PyYAML's safe loader, reading exponent floats without a dot (YAML 1.2) as floats."""


# YAML 1.1 floats need a dot and a signed exponent ("1.0e+6"); these are the exponent forms it
# leaves as strings: "1e6", "2E-2", "1.5e3", ".5e-3". Plain integers stay integers (the int
# resolver is tried first and matches them whole).
_Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float",
  re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
  list("-+0123456789."),
)


def parse_yaml(text: str) -> Any:
  """The YAML document ``text`` (safe subset, exponent floats read as floats).

  Raises:
    yaml.YAMLError: the text is not valid YAML.
  """
  return yaml.load(text, Loader=_Loader)  # noqa: S506 (_Loader is a SafeLoader)


def describe(annotation) -> str:
  """``int | Literal["auto"] | None`` -> "int or 'auto' or null"."""
  names = []
  for a in typing.get_args(annotation) or (annotation,):
    if typing.get_origin(a) is Literal:
      names += [repr(v) for v in typing.get_args(a)]
    else:
      names.append(getattr(a, "__name__", str(a)).replace("NoneType", "null"))
  return " or ".join(names)


def coerce(name: str, value: Any, annotation, *, infinite: bool = False) -> Any:
  """``value`` checked against the field annotation ``annotation`` (an evaluated type).

  Args:
    name: the dotted key, for the error.
    value: what the file or override gave.
    annotation: the field's type.
    infinite: the field takes ``inf``/``-inf`` (a bound that may be open, such as Mamba-2's
      ``time_step_limit``: ``metadata={"infinite": True}`` on the dataclass field); NaN never.

  Returns:
    The value, with an int made a float for a float field, an integral float (or a string
    holding an integer) an int for an int field, a list a tuple for a tuple field, a mapping the
    nested dataclass for a dataclass field, and a numeric string a float for a float field
    ("1e-3" quoted).

  Raises:
    FieldError: the value does not fit (the message names ``name`` and the value).
  """
  origin = typing.get_origin(annotation)
  args = typing.get_args(annotation)
  if dataclasses.is_dataclass(annotation):  # a nested section (train.lora, model.rope_scaling)
    if not isinstance(value, dict):
      raise FieldError(name, f"{name}={value!r}: expected a mapping")
    return build_section(annotation, name, value)
  if origin in (typing.Union, types.UnionType):
    section = next((a for a in args if dataclasses.is_dataclass(a)), None)
    if section is not None and isinstance(value, dict):  # its own errors name the nested key
      return coerce(name, value, section, infinite=infinite)
    for arg in args:
      try:
        return coerce(name, value, arg, infinite=infinite)
      except FieldError:
        pass
    raise FieldError(name, f"{name}={value!r}: expected {describe(annotation)}")
  if annotation is type(None):
    if value is None:
      return None
    raise FieldError(name, f"{name}={value!r}: expected null")
  if origin is Literal:
    if any(value == a and type(value) is type(a) for a in args):
      return value
    raise FieldError(name, f"{name}={value!r}: expected one of {', '.join(map(repr, args))}")
  if origin is tuple:
    if isinstance(value, str):
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise FieldError(name, f"{name}={value!r}: expected a list")
    return tuple(coerce(name, v, args[0], infinite=infinite) for v in value)
  if annotation is bool:
    if isinstance(value, bool):
      return value
    raise FieldError(name, f"{name}={value!r}: expected true or false")
  if annotation is int:
    number = integral(value)
    if number is None:
      raise FieldError(name, f"{name}={value!r}: expected an integer")
    return number
  if annotation is float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      number = float(value)
    elif isinstance(value, str):  # a quoted number ("1e-3")
      try:
        number = float(value)
      except ValueError:
        pass
    if number is None:
      raise FieldError(name, f"{name}={value!r}: expected a number")
    if math.isnan(number) or math.isinf(number) and not infinite:
      raise FieldError(name, f"{name}={value!r}: expected a finite number")
    return number
  if annotation is str:
    if isinstance(value, str):
      return value
    raise FieldError(name, f"{name}={value!r}: expected a string")
  return value


def typed_fields(cls, spec: dict, prefix: str) -> dict:
  """``spec`` with each value that names a field of the dataclass ``cls`` checked against its type
  (``coerce``); keys that are not fields are kept as they are, for the caller to refuse."""
  hints = typing.get_type_hints(cls)
  infinite = {f.name for f in dataclasses.fields(cls) if f.metadata.get("infinite")}
  return {
    k: coerce(f"{prefix}{k}", v, hints[k], infinite=k in infinite) if k in hints else v
    for k, v in spec.items()
  }


def build_section(cls, name: str, raw: Any):
  """The dataclass ``cls`` from the mapping ``raw`` (None: every default), each key checked.

  Raises:
    FieldError: ``raw`` is not a mapping, a key is not a field of ``cls`` (with the closest
      name), or a value does not fit its field.
  """
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise FieldError(name, f"{name}: expected a mapping, got {raw!r}")
  fields = [f.name for f in dataclasses.fields(cls)]
  for key in raw:
    if key not in fields:
      close = difflib.get_close_matches(str(key), fields, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise FieldError(
        f"{name}.{key}", f"{name}.{key}: unknown key{hint}; expected one of {', '.join(fields)}"
      )
  return cls(**typed_fields(cls, raw, f"{name}."))
