"""Loading a trained run in Python: ``load_run`` (config, parameters and tokenizer) and
``load_model`` (config and parameters), what ``tjax generate`` and ``tjax fill-mask`` read."""

from __future__ import annotations

import os
from typing import Callable

from transformer_jax.data import load_dataset
from transformer_jax.runs.checkpoints import load_model, restore_params
from transformer_jax.runs.directory import DATASET, RunDir, check_vocab

__all__ = ["load_model", "load_run"]


def load_run(
  run_dir: str, *, best: bool = False, data: str | None = None, check: Callable | None = None
):
  """``(config, params, tokenizer)`` of a run directory's latest (or best) checkpoint.

  The tokenizer is the one of the dataset named by ``dataset.json`` (or ``data``).

  Args:
    run_dir: a directory written by ``tjax train`` (or ``save_model`` / ``tjax convert``).
    best: the best checkpoint by validation loss instead of the latest.
    data: a prepared dataset directory to take the tokenizer from.
    check: called as ``check(config, tokenizer)`` before the parameters are read (to refuse a run
      early); it raises ``ValueError``.

  Raises:
    ValueError: not a run directory, no checkpoint, no dataset to read the tokenizer from, or a
      tokenizer whose vocabulary differs from the model's, or no intact checkpoint.
  """
  rd = RunDir(run_dir)
  config = rd.require_model()
  if not rd.checkpoint_steps(best=best):
    look = os.path.join(rd.checkpoint_dir, "best") if best else rd.checkpoint_dir
    raise ValueError(
      f"{run_dir} has no {'best ' if best else ''}checkpoint (nothing in {look}); train it first"
    )
  if data is None:
    ref = rd.read_dataset_ref()
    if ref is not None:  # absolute: the run works from any folder
      data = ref["path"]
    else:  # a run directory written before dataset.json existed
      data = ((rd.read_config() or {}).get("data") or {}).get("path")
    if data is None:
      raise ValueError(
        f"{run_dir} names no dataset (no {DATASET}) to read the tokenizer "
        "from; give one with --data DIR"
      )
  try:
    tokenizer = load_dataset(data).tokenizer
  except FileNotFoundError as e:
    raise ValueError(f"cannot read the tokenizer: {e}") from None
  check_vocab(tokenizer.vocab_size, config, data)
  if check is not None:
    check(config, tokenizer)
  params, _ = restore_params(rd.checkpoint_dir, config, best=best)
  return config, params, tokenizer
