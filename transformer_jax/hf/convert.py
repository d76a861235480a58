"""``tjax convert``: a Hugging Face checkpoint directory <-> a transformer_jax run directory.

The run-directory format belongs to ``transformer_jax.runs`` (``save_model`` and ``load_model``);
this module only joins it to ``load``/``save``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flax import nnx

from transformer_jax import models, runs
from transformer_jax.data import Tokenizer
from transformer_jax.hf import configs
from transformer_jax.hf import reformer as reformer_hf
from transformer_jax.hf.api import load, recorded_ids, save
from transformer_jax.train import method


def from_hf(hf_dir: str | os.PathLike, out_run_dir: str | os.PathLike) -> str:
  """Converts the checkpoint in ``hf_dir`` into a run directory; returns the architecture read.
  The checkpoint's special-token ids go into the run's ``runs.HF_SPECIAL_IDS`` file: the model
  configs have no place for them, and ``to_hf`` writes them back."""

  if not runs.RunDir(out_run_dir).is_empty():  # before the (slow) read of the checkpoint
    raise ValueError(f"--out {out_run_dir} exists and is not empty; give a new directory")
  config, model = load(hf_dir)  # refuses what it cannot read, naming the file and field
  hf = json.loads((Path(hf_dir) / "config.json").read_text())  # read and checked by load
  architecture = (  # before anything is written; the Reformer has a reader of its own
    reformer_hf.ARCHITECTURE
    if hf.get("model_type") == reformer_hf.MODEL_TYPE
    else configs.architecture_of(hf)
  )
  runs.save_model(out_run_dir, config, nnx.state(model, nnx.Param))
  ids = recorded_ids(model)
  if ids:
    runs.write_atomic(os.path.join(out_run_dir, runs.HF_SPECIAL_IDS), json.dumps(ids, indent=2))
  return architecture


def to_hf(
  run_dir_path: str | os.PathLike, out_dir: str | os.PathLike, *, architecture: str | None = None
) -> str:
  """Writes the model of a run directory as a Hugging Face checkpoint; returns the architecture.

  A LoRA run (``train.lora``) is written with its adapters merged into the base weights. The
  special-token ids come from the run's tokenizer (``run_tokenizer``), when its dataset is there;
  else, for a run converted from Hugging Face, from its ``runs.HF_SPECIAL_IDS`` file."""

  if not runs.RunDir(out_dir).is_empty():  # before reading the run
    raise ValueError(f"--out {out_dir} exists and is not empty; give a new directory")
  config, params = method.load_base(run_dir_path)  # a LoRA run: its adapters merged
  if not isinstance(params, nnx.State):
    # A plain nested dict of arrays: put it into the abstract model's state.
    _, state = nnx.split(models.abstract(config))
    nnx.replace_by_pure_dict(state, params)
    params = state
  tokenizer = run_tokenizer(run_dir_path)
  kept = os.path.join(run_dir_path, runs.HF_SPECIAL_IDS)
  special_ids = runs.read_json(kept) if tokenizer is None and os.path.isfile(kept) else None
  return save(
    params,
    config,
    out_dir,
    architecture=architecture,
    tokenizer=tokenizer,
    special_ids=special_ids,
  )


def run_tokenizer(run_dir_path: str | os.PathLike):
  """The tokenizer of the dataset a run directory names (``dataset.json``, else ``config.yaml``'s
  ``data.path``), or None: a run converted from Hugging Face names none, and a dataset that is
  gone cannot be read (its special ids are then written as unknown)."""

  rd = runs.RunDir(run_dir_path)
  ref = rd.read_dataset_ref()
  path = ref["path"] if ref else ((rd.read_config() or {}).get("data") or {}).get("path")
  meta_file = Path(path) / "metadata.json" if path else None
  if meta_file is None or not meta_file.is_file():
    return None
  return Tokenizer.from_metadata(json.loads(meta_file.read_text()), path)
