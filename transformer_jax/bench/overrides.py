"""``--model KEY=VALUE`` and ``--table NAME=N`` of ``tjax bench train``: overrides of the preset's
config and of the kernel table, parsed and checked before anything compiles.

``parse_model_overrides`` reads each value as YAML; ``parse_table`` builds a
``backends.KernelTable`` for the side "ours+table" and refuses an entry that is out of range, the
default, or without effect on the platform the bench runs on.
"""

from __future__ import annotations

import re

import yaml

from transformer_jax import backends
from transformer_jax.backends import table as table_lib

# The kernel-table entries ``--table`` sets, for the side "ours+table" (backends.KernelTable's
# integer levers; a name is read in any case, PAD_COLS as pad_cols).
TABLE_ENTRIES = {name: what for name, (_, _, what) in table_lib.INT_LEVERS.items()}


def _pairs(items: list[str], flag: str, expected: str) -> list[tuple[str, str, str]]:
  """``KEY=VALUE`` items of ``flag`` as ``(item, key, value text)``, each key at most once.

  Raises:
    ValueError: for an item without ``=`` or a key, or a key given twice.
  """
  out, seen = [], set()
  for item in items:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
      raise ValueError(f"{flag} {item!r}: expected {expected}")
    if key in seen:
      raise ValueError(f"{flag} {item!r}: {key} is given twice")
    seen.add(key)
    out.append((item, key, text))
  return out


def parse_table(items: list[str], platform: str | None = None) -> backends.KernelTable | None:
  """``--table`` values (``"NAME=N"``) as a kernel table, checked before anything compiles.

  Args:
    items: the ``--table`` values.
    platform: the backend the bench runs on: an entry that changes nothing there is refused.

  Returns:
    The table, or None without items.

  Raises:
    ValueError: one line naming the item, for an item without ``=``, a name not in
      ``TABLE_ENTRIES``, a name given twice, a value that is not an integer or out of the
      entry's range, the entry's default, or an entry that does nothing on ``platform``.
  """
  if not items:
    return None
  out = {}
  for item, name, text in _pairs(
    [i.strip() for i in items], "--table", "NAME=N (e.g. --table pad_cols=128)"
  ):
    field = name.lower()
    if field not in TABLE_ENTRIES:
      raise ValueError(f"--table {item!r}: {name} is not one of {', '.join(TABLE_ENTRIES)}")
    if field in out:
      raise ValueError(f"--table {item!r}: {field} is given twice")
    out[field] = text.strip()
    try:
      table = backends.KernelTable.from_dict({field: out[field]}, where="--table")
    except ValueError as e:
      raise ValueError(f"--table {item!r}: {str(e).removeprefix('--table.')}") from None
    if not table.changed():
      raise ValueError(
        f"--table {item!r}: {field}={getattr(table, field)} is the default, so "
        "ours+table would be ours"
      )
    if platform is not None and table.no_effect_on(platform):
      raise ValueError(
        f"--table {item!r}: {field} has no effect on {platform} (it applies on "
        f"{', '.join(table_lib.APPLIES_ON[field])})"
      )
  return backends.KernelTable.from_dict(out, where="--table")


# Config fields the bench sets itself: its own flags, and no dropout on either side.
_OWN_FIELDS = {
  "dtype": "--dtype",
  "remat": "--remat",
  "dropout_rate": "no dropout",
  "attention_dropout_rate": "no dropout",
}
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def parse_model_overrides(items: list[str]) -> dict:
  """``--model`` values (``"KEY=VALUE"``) as a dict of config overrides.

  Each value is read with ``yaml.safe_load`` (``true``/``false``, ``null``, ints, floats, else the
  string); an exponent without a dot (``1e-5``, a string to YAML 1.1) is a float.

  Raises:
    ValueError: for an item without ``=`` or a key, a key given twice, or a field the bench sets
      itself (``dtype``, ``remat``: their own flags; dropout: off on both sides).
  """

  out = {}
  for item, key, text in _pairs(items, "--model", "KEY=VALUE (e.g. --model scan_layers=false)"):
    if key in _OWN_FIELDS:
      raise ValueError(f"--model {item!r}: {key} is set by the bench ({_OWN_FIELDS[key]})")
    value = yaml.safe_load(text)
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
      value = float(value)
    out[key] = value
  return out
