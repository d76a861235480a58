"""Starting a run from a pretrained one: ``model.init_from=RUN_DIR`` (a ``tjax train`` run or a
directory written by ``tjax convert`` from Hugging Face).

The new model's architecture is the source's (its ``model.yaml``) with the experiment's model keys
as overrides (dropout, a classification head's ``num_labels``...). Every parameter whose path and
shape the source has is loaded; the rest are new (freshly initialised: a classification head);
the source's parameters the new model lacks are dropped (BERT's masked-LM and next-sentence
heads). A tensor with the same path but another shape is refused by name, except in a head.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from transformer_jax import models, runs

# Parameters that a fine-tuning run may re-create with a new shape (a head for other labels).
HEADS = ("classifier",)


def source_config(init_from: str) -> models.ModelConfig:
  """The model config of the run (or converted directory) ``init_from``."""
  rd = runs.RunDir(init_from)
  if not rd.exists():
    raise ValueError(f"model.init_from={init_from!r}: no such run directory")
  return rd.require_model()


def model_config(init_from: str, overrides: dict[str, Any]) -> models.ModelConfig:
  """The source's config with ``overrides`` (model-config fields) applied."""
  base = source_config(init_from)
  fields = {f.name for f in dataclasses.fields(base)}
  for key in overrides:
    if key not in fields:
      raise ValueError(f"model.{key}: not a field of the {type(base).__name__} in {init_from}")
  return dataclasses.replace(base, **runs.schema.typed_fields(type(base), overrides, "model."))


def _flat(params) -> dict[str, Any]:
  flat = nnx.traversals.flatten_mapping(nnx.to_pure_dict(params))
  return {"/".join(map(str, k)): v for k, v in flat.items()}


def load_pretrained(params, init_from: str) -> tuple[Any, dict[str, list[str]]]:
  """``params`` (a fresh parameter state) with every tensor the source has put in its place.

  Returns:
    ``(params, report)``: report has the sorted paths ``loaded``, ``new`` and ``dropped``.

  Raises:
    ValueError: the source has no intact checkpoint, or a non-head tensor's shape differs.
  """
  src_config = source_config(init_from)
  src_params, _ = runs.restore_params(runs.RunDir(init_from).checkpoint_dir, src_config)
  src = _flat(src_params)
  dst = _flat(params)
  loaded, new = [], []
  out = {}
  for path, value in dst.items():
    if path in src and tuple(src[path].shape) == tuple(value.shape):
      out[path] = np.asarray(jax.device_get(src[path])).astype(value.dtype)
      loaded.append(path)
    elif path in src and not any(h in path.split("/") for h in HEADS):
      raise ValueError(
        f"model.init_from={init_from}: tensor {path} has shape "
        f"{tuple(src[path].shape)} there but {tuple(value.shape)} here"
      )
    else:
      new.append(path)
  dropped = sorted(set(src) - set(loaded))
  pure = nnx.to_pure_dict(params)
  flat_keys = nnx.traversals.flatten_mapping(pure)
  updated = {k: out.get("/".join(map(str, k)), v) for k, v in flat_keys.items()}
  nnx.replace_by_pure_dict(params, nnx.traversals.unflatten_mapping(updated))
  return params, {"loaded": sorted(loaded), "new": sorted(new), "dropped": dropped}


def describe(report: dict[str, list[str]], init_from: str) -> str:
  """One line per kind: counts and (up to a few) names."""

  def names(paths):
    heads = sorted({p.split("/")[0] for p in paths})
    return ", ".join(heads[:8]) + (" ..." if len(heads) > 8 else "")

  return "\n".join(
    [
      f"init_from {init_from}: loaded {len(report['loaded'])} tensors ({names(report['loaded'])})",
      f"  new {len(report['new'])} ({names(report['new']) or '-'})",
      f"  dropped {len(report['dropped'])} ({names(report['dropped']) or '-'})",
    ]
  )


def record_loaded(run_dir: str, init_from: str, report: dict[str, list[str]]) -> None:
  """Prints :func:`describe`'s lines and writes ``init_from.json`` (the source and the report)
  into ``run_dir`` (process 0)."""
  if jax.process_index() != 0:
    return
  print(describe(report, init_from), flush=True)
  runs.write_atomic(
    os.path.join(run_dir, "init_from.json"),
    json.dumps({"init_from": init_from, **report}, indent=1),
  )
