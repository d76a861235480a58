"""Experiment configs: overrides, validation messages naming the key."""

import pytest

from transformer_jax.train import load_experiment

BASE = {"run_dir": "r", "model": {"preset": "gpt2-tiny"}, "data": {"path": "d"}}


def test_dotted_overrides_apply_with_yaml_types():
  exp = load_experiment(None, ["train.steps=200", "train.lr=1e-3", "model.d_model=32",
                               "mesh.data=2", "train.clip_norm=null", "run_dir=/x"], raw=BASE)
  assert exp.train.steps == 200 and exp.train.lr == 1e-3 and exp.mesh.data == 2
  assert exp.train.clip_norm is None and exp.run_dir == "/x"
  assert exp.model_config(vocab_size=50).d_model == 32
  assert exp.model_config(vocab_size=50).vocab_size == 50


@pytest.mark.parametrize("override,message", [
    ("train.stpes=3", r"train\.stpes: unknown key \(did you mean 'steps'\?\)"),
    ("train.steps=many", r"train\.steps='many': expected an integer"),
    ("train.lr=fast", r"train\.lr='fast': expected a number"),
    ("train.schedule=cubic", r"train\.schedule='cubic': expected one of"),
    ("trian.steps=3", r"trian: unknown key"),
    ("train.batch_size=10", r"train\.microbatches=3 does not divide train\.batch_size=10"),
    ("train.steps", r"must look like section\.key=value"),
])
def test_bad_keys_and_types_name_the_key(override, message):
  with pytest.raises(ValueError, match=message):
    load_experiment(None, [override, "train.microbatches=3"] if "batch_size" in override
                    else [override], raw=BASE)


def test_unknown_model_field_is_named():
  exp = load_experiment(None, ["model.hidden=3"], raw=BASE)
  with pytest.raises(ValueError, match="no field.*hidden"):
    exp.model_config()


def test_experiment_files_in_repo_are_valid():
  import glob
  import os
  from tests.train.conftest import REPO
  files = sorted(glob.glob(os.path.join(REPO, "experiments", "*.yaml")))
  assert len(files) >= 3
  for path in files:
    exp = load_experiment(path)
    if exp.model.get("init_from") is None:
      exp.model_config(vocab_size=1000)
    else:  # fine-tuning: its pretraining experiment, which makes model.init_from, must be valid
      assert exp.pretrain is not None, path
      pre = load_experiment(os.path.join(REPO, exp.pretrain))
      assert os.path.abspath(os.path.join(REPO, pre.run_dir)) == os.path.abspath(
          os.path.join(REPO, exp.model["init_from"])), path
      pre.model_config(vocab_size=1000)
