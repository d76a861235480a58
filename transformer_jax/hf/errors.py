"""The errors of Hugging Face interop: every refusal is one of these two, never a deep traceback."""

from __future__ import annotations


class CheckpointError(ValueError):
  """A checkpoint cannot be read as the model it claims to be.

  Raised for missing, unexpected or mis-shaped tensors, non-float dtypes and NaN or infinite
  values (all of them listed in one message, ``checked.read``), tied tensors that disagree, config
  fields of the wrong type (named with their value), and unreadable or truncated files.
  """


class UnsupportedError(CheckpointError):
  """The checkpoint is valid but uses something transformer_jax does not implement (an architecture,
  ``model_type`` or config option), named in the message. Nothing is loaded approximately."""


def listing(title: str, items: list[str], limit: int = 20) -> str:
  """``title`` plus up to ``limit`` items, one a line (and how many more)."""
  lines = [f"  {title} ({len(items)}):"] + [f"    {x}" for x in items[:limit]]
  if len(items) > limit:
    lines.append(f"    ... and {len(items) - limit} more")
  return "\n".join(lines)
