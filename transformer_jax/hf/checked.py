"""The one checked reader every family's loader takes its tensors from.

A loader says which tensors its model needs, by Hugging Face name, each with the exact shape the
checkpoint must hold it in (``Expected``); ``read`` returns them after checking every one, and
refuses the checkpoint with one ``CheckpointError`` that lists every problem:

- missing tensors, and unexpected ones (neither needed, nor a tied duplicate, nor an ignored
  buffer);
- a shape other than the expected one: nothing is reshaped or transposed to fit, so a transposed
  (non-square) matrix is refused, not read in the wrong layout;
- a dtype that is not floating point (an integer or boolean weight would be cast silently);
- a value that is not finite (NaN or infinite), named with how many elements are;
- tied duplicates (``aliases``) that differ from the tensor they stand for.

The config's fields are read by type through ``configs.common.Fields``; together they are the
checks every reader (GPT-2, BERT, T5, LLaMA, Mistral, Qwen2, Qwen3, Marian, Mamba, Mamba-2,
BigBird, Reformer) shares.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np

from transformer_jax.hf.errors import CheckpointError, listing


@dataclasses.dataclass(frozen=True)
class Expected:
  """What a loader needs from a checkpoint.

  Attributes:
    shapes: every tensor the model needs, Hugging Face name -> the shape it must have there.
    aliases: a tied duplicate's name -> the tensor it stands for; a duplicate given alone stands in
      for it, and one given alongside must be equal to it.
    ignore: regexes of buffers that carry no parameters (read by nobody, not reported).
  """

  shapes: dict[str, tuple[int, ...]]
  aliases: dict[str, str] = dataclasses.field(default_factory=dict)
  ignore: tuple[str, ...] = ()


def _dtype_problem(name: str, x: np.ndarray) -> str | None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return f"{name}: dtype {x.dtype}, expected a floating-point type"
  return None


def _finite_problem(name: str, x: np.ndarray) -> str | None:
  bad = x.size - int(np.count_nonzero(np.isfinite(x)))
  if bad:
    return f"{name}: {bad} of {x.size} values are NaN or infinite"
  return None


def read(tensors: dict[str, np.ndarray], expected: Expected, what: str) -> dict[str, np.ndarray]:
  """The tensors ``expected`` names, each checked (see the module docstring).

  Args:
    tensors: the checkpoint's tensors by name (NumPy arrays, possibly memory-mapped).
    expected: what the loader needs.
    what: the model named in the error's first line (``"GPT2LMHeadModel"``).

  Returns:
    Name -> array for every name in ``expected.shapes``, in the checkpoint's own dtype.

  Raises:
    CheckpointError: every problem found, listed by kind, each tensor named.
  """
  tensors = dict(tensors)
  tied = []
  for alias, canon in expected.aliases.items():
    if alias not in tensors:
      continue
    value = tensors.pop(alias)
    if canon not in tensors:
      tensors[canon] = value
    elif value.shape != tensors[canon].shape or not np.array_equal(value, tensors[canon]):
      tied.append(f"{alias} (tied to {canon} but different)")
  ignored = [re.compile(p) for p in expected.ignore]
  tensors = {k: v for k, v in tensors.items() if not any(p.search(k) for p in ignored)}

  out, missing, misshaped, mistyped, nonfinite = {}, [], [], [], []
  for name, want in expected.shapes.items():
    if name not in tensors:
      missing.append(name)
      continue
    x = np.asarray(tensors[name])
    if tuple(x.shape) != tuple(want):
      misshaped.append(f"{name}: shape {tuple(x.shape)}, expected {tuple(want)}")
    elif problem := _dtype_problem(name, x):
      mistyped.append(problem)
    elif problem := _finite_problem(name, x):
      nonfinite.append(problem)
    else:
      out[name] = x
  unexpected = sorted(set(tensors) - set(expected.shapes))
  if missing or unexpected or misshaped or mistyped or nonfinite or tied:
    parts = [f"checkpoint does not match {what} with this config.json:"]
    for title, items in (
      ("missing tensors", missing),
      ("unexpected tensors", unexpected),
      ("tensors with the wrong shape", misshaped),
      ("tensors with a non-float dtype", mistyped),
      ("tensors with non-finite values", nonfinite),
      ("tied tensors that differ", tied),
    ):
      if items:
        parts.append(listing(title, items))
    raise CheckpointError("\n".join(parts))
  return out
