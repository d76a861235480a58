"""Round trips, for every registered kind: saved for Hugging Face, transformers computes the same
logits and ``tj.hf.load`` reads back the same parameters (kinds with an HF class); a run directory
gives back the config and the parameters bitwise, and the experiment that wrote it resumes."""

import os

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from tests.conformance import harness as h
from tests.conformance.kinds import ENCODER, KINDS, SEQ2SEQ
from transformer_jax import models, runs
from transformer_jax.train import load_experiment
from transformer_jax.train.config import fixed_changes

HF = [k for k in KINDS if k.hf_class is not None]


@pytest.mark.parametrize("kind", HF, ids=[k.name for k in HF])
def test_saved_for_hugging_face_gives_the_same_logits_and_loads_back(kind, tmp_path):
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  torch = pytest.importorskip("torch", reason="the hf extra is not installed")
  transformers = pytest.importorskip("transformers")
  from tests.hf import hf_cases
  from transformer_jax import hf

  torch.set_num_threads(1)
  config = kind.config()
  model = h.model(config)
  assert hf.save(model, config, tmp_path) == kind.hf_class
  theirs = getattr(transformers, kind.hf_class).from_pretrained(tmp_path).float().eval()
  diffs = hf_cases.compare(theirs, model, kind.hf_class, paddings=(True,))
  assert max(diffs.values()) <= 1e-4, diffs
  _, again = hf.load(tmp_path)
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(h.params(config)),
    jax.tree.leaves(nnx.state(again, nnx.Param)),
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


def _experiment(kind, run_dir, dataset) -> dict:
  """An experiment training the kind, as a user writes it: YAML with the full model."""
  task = "seq2seq" if kind.has(SEQ2SEQ) else "bert" if kind.has(ENCODER) else "gpt"
  return yaml.safe_load(
    yaml.safe_dump(
      {
        "run_dir": str(run_dir),
        "model": models.config_to_dict(kind.config()),
        "data": {"path": str(dataset), "task": task},
        "train": {"steps": 2, "batch_size": 2, "seq_len": 16},
      }
    )
  )


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_a_run_directory_gives_back_the_model_and_accepts_its_resume(kind, tmp_path):
  """The parts of a resume that depend on the kind: its config through ``model.yaml`` and
  ``config.yaml`` (a resumed experiment is compared with the stored one key by key) and its
  parameters through a checkpoint, bitwise. (Resuming the training loop itself is kind-blind:
  tests/train/test_trainer.py kills and resumes a run and compares every parameter.)"""
  config = kind.config()
  run_dir = tmp_path / "run"
  runs.save_model(str(run_dir), config, h.params(config))
  got_config, got = runs.load_model(str(run_dir))
  assert got_config == config
  for (path, a), b in zip(
    jax.tree_util.tree_leaves_with_path(h.params(config)), jax.tree.leaves(got)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
  raw = _experiment(kind, run_dir, tmp_path / "data")
  stored = yaml.safe_load(yaml.safe_dump(load_experiment(None, raw=raw).absolute().to_dict()))
  assert load_experiment(None, raw=raw).model_config() == config
  assert (
    fixed_changes(
      load_experiment(None, raw=stored).absolute().to_dict(),
      load_experiment(None, raw=raw).absolute().to_dict(),
    )
    == []
  )
