"""What every batch loader shares: the step counter, this process's share of a global batch, the
iterator protocol, and the dataset's special ids and token streams (``data.loaders``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from transformer_jax.data.dataset import Dataset

Batch = dict[str, np.ndarray]


def process_info(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  """``(index, count)`` of this process, JAX's where not given; the index checked against count."""
  if process_index is None or process_count is None:
    import jax  # noqa: PLC0415 - only here: preparing data never loads JAX

    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(
      f"process_index {process_index} must lie in [0, process_count={process_count})"
    )
  return process_index, process_count


class Loader:
  """Step counter, process share and iterator protocol shared by all loaders."""

  def __init__(
    self, batch_size: int, seed: int, process_index: int | None, process_count: int | None
  ):
    if batch_size <= 0:
      raise ValueError(f"batch_size must be positive, got {batch_size}")
    self.process_index, self.process_count = process_info(process_index, process_count)
    if batch_size % self.process_count:
      raise ValueError(
        f"global batch_size {batch_size} is not divisible by process_count {self.process_count}"
      )
    self.batch_size = batch_size
    self.local_batch_size = batch_size // self.process_count
    self.seed = seed
    self.step = 0
    start = self.process_index * self.local_batch_size
    # This process's rows of a global batch.
    self.local_rows = slice(start, start + self.local_batch_size)

  def batch_at(self, step: int) -> Batch:
    raise NotImplementedError

  def __iter__(self) -> Iterator[Batch]:
    return self

  def __next__(self) -> Batch:
    batch = self.batch_at(self.step)
    self.step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    """JSON-able state to store in a checkpoint."""
    return {"step": self.step}

  def set_state(self, state: dict[str, Any]) -> None:
    self.step = int(state["step"])


def special_id(dataset: Dataset, name: str) -> int:
  """The id of special token ``name`` (``"<|endoftext|>"``, ``"[MASK]"``...) in ``dataset``."""
  return int(dataset.meta["special_tokens"][name])


def text_stream(dataset: Dataset, split: str):
  """The token stream of ``split`` of a gpt or bert dataset; refuses seq2seq and empty splits."""
  if dataset.task == "seq2seq":
    raise ValueError(
      f"{dataset.path!r} holds seq2seq pairs; GPT/BERT loaders need a gpt or bert dataset"
    )
  stream = dataset.stream(split, "tokens")
  if stream.tokens.size == 0:
    raise ValueError(f"split {split!r} of {dataset.path!r} has no tokens")
  return stream
