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
      raise ValueError(f"model.init_from={init_from}: tensor {path} has shape "
                       f"{tuple(src[path].shape)} there but {tuple(value.shape)} here")
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
  return "\n".join([
      f"init_from {init_from}: loaded {len(report['loaded'])} tensors ({names(report['loaded'])})",
      f"  new {len(report['new'])} ({names(report['new']) or '-'})",
      f"  dropped {len(report['dropped'])} ({names(report['dropped']) or '-'})"])


def record_loaded(run_dir: str, init_from: str, report: dict[str, list[str]]) -> None:
  """Prints :func:`describe`'s lines and writes ``init_from.json`` (the source and the report)
  into ``run_dir`` (process 0)."""
  if jax.process_index() != 0:
    return
  print(describe(report, init_from), flush=True)
  runs.write_atomic(os.path.join(run_dir, "init_from.json"),
                    json.dumps({"init_from": init_from, **report}, indent=1))


def lora_start(model_config: models.ModelConfig, lora_config, seed: int,
               init_from: str | None = None):
  """``(trainable, frozen, report)`` of a fresh LoRA run: the base initialised from ``seed``
  (then ``init_from``'s tensors loaded into it), adapters with B = 0, split by
  ``lora.TRAINABLE``. A pure function of its arguments, so a resumed run rebuilds the same frozen
  base. ``report``: see :func:`load_pretrained` (None without ``init_from``)."""
  from transformer_jax import lora
  full = jax.jit(lambda k: nnx.state(lora.create(model_config, lora_config, k), nnx.Param))(
      jax.random.key(seed))
  report = None
  if init_from:
    full, report = load_pretrained(jax.device_get(full), init_from)
  trainable, frozen = nnx.split_state(full, lora.TRAINABLE, nnx.Param)
  return trainable, frozen, report


def lora_run_config(run_dir: str):
  """The ``LoRAConfig`` of a run directory's experiment, or None (not a LoRA run)."""
  rd = runs.RunDir(run_dir)
  raw = rd.read_config()
  train = (raw or {}).get("train")
  if not isinstance(train, dict) or not train.get("lora"):
    return None
  return _stored(rd, raw).train.lora


def _stored(rd: runs.RunDir, raw: dict):
  """The experiment stored in ``rd``'s ``config.yaml`` (``raw``), its errors naming the file."""
  from transformer_jax.train.config import load_experiment
  return load_experiment(None, raw={**raw, "run_dir": rd.path}, source=rd.file(runs.CONFIG))


def load_lora_merged(run_dir: str, *, best: bool = False):
  """``(config, params)`` of a LoRA run with its adapters merged into the base: the base
  architecture's parameters, as ``runs.load_model`` gives for a plain run."""
  from transformer_jax import lora
  rd = runs.RunDir(run_dir)
  config = rd.require_model()
  exp = _stored(rd, rd.read_config() or {})
  _, trainable_abs, _ = lora.split(lora.abstract(config, exp.train.lora))
  trainable, _ = runs.restore_params(rd.checkpoint_dir, config, best=best, target=trainable_abs)
  _, frozen, _ = lora_start(config, exp.train.lora, exp.train.seed, exp.model.get("init_from"))
  graphdef = nnx.split(lora.abstract(config, exp.train.lora))[0]
  return config, lora.merged_params(graphdef, trainable, frozen)
