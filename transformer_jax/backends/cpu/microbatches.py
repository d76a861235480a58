"""``train.microbatches: auto`` on CPU: split a batch only to fit the allocator's reuse limit.

XLA:CPU takes a step's temporaries as one block per call, and mimalloc reuses freed blocks only up
to ``allocator.MIMALLOC_REUSE_LIMIT``; a larger block is mapped and zeroed afresh at every step.
Below the limit, splitting a batch only costs time, so a batch stays whole unless splitting brings
the temporaries under the limit.
"""

from __future__ import annotations

from typing import Any, Callable

from transformer_jax.backends.compile import temp_bytes
from transformer_jax.backends.cpu import allocator as allocator_lib


def auto_microbatches(
  compile_step: Callable[[int], Any], batch_size: int, n_batch: int = 1, *, limit: int | None = None
) -> tuple[int, Any]:
  """The fewest microbatches whose compiled step's temporaries fit in ``limit`` bytes, with that
  compiled step.

  Args:
    compile_step: compiles the train step for a number of microbatches (``jit(...).lower(...)
      .compile()``; jit's cache then serves the chosen one to the step's first call).
    batch_size: the global batch.
    n_batch: the devices the batch is split over; a count must divide ``batch_size / n_batch``.
    limit: the temporaries' size to stay under (default ``allocator.MIMALLOC_REUSE_LIMIT``).

  Returns:
    ``(microbatches, compiled)``: 1 and the whole batch's step when its temporaries fit (or are
    unknown), or when no count makes them fit; else the fewest microbatches that do, each at least
    ``temp / limit`` (the temporaries of ``m`` microbatches are no smaller than ``1/m`` of the
    whole batch's).
  """
  limit = allocator_lib.MIMALLOC_REUSE_LIMIT if limit is None else limit
  whole = compile_step(1)
  temp = temp_bytes(whole)
  if temp is None or temp <= limit or limit <= 0:  # fits, or nothing can
    return 1, whole
  rows = batch_size // n_batch
  for m in range(max(2, -(-temp // limit)), rows + 1):
    if rows % m:
      continue
    compiled = compile_step(m)
    split = temp_bytes(compiled)
    if split is not None and split <= limit:
      return m, compiled
  return 1, whole


def resolve_auto(
  compile_step: Callable[[int], Any],
  batch_size: int,
  n_batch: int = 1,
  *,
  platform: str,
  malloc: str,
  limit: int | None = None,
) -> tuple[int, Any]:
  """``train.microbatches: auto`` resolved: ``auto_microbatches`` on CPU over mimalloc (the limit
  it works around is mimalloc's), else 1.

  Args:
    compile_step, batch_size, n_batch, limit: as for ``auto_microbatches``.
    platform: the step's device platform.
    malloc: this process's allocator (``allocator.allocator()``).

  Returns:
    ``(microbatches, compiled)``.
  """
  if platform != "cpu" or malloc != "mimalloc":
    return 1, compile_step(1)
  return auto_microbatches(compile_step, batch_size, n_batch, limit=limit)
