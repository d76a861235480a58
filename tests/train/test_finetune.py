"""model.init_from: which tensors are loaded, new or dropped; shapes refused by name; a second
corpus prepared with the pretraining vocabulary."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from transformer_jax import data, models, runs
from transformer_jax.train import finetune, load_experiment

BASE = models.get_config(
  "bert-tiny", vocab_size=40, d_model=16, num_layers=1, num_heads=2, d_ff=32, max_len=16
)


def _flat(state):
  return {
    "/".join(map(str, k)): np.asarray(v)
    for k, v in nnx.traversals.flatten_mapping(nnx.to_pure_dict(state)).items()
  }


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("pre") / "run")
  config = dataclasses.replace(BASE, num_labels=5)  # an old head for other labels
  runs.save_model(path, config, models.init(config, jax.random.key(1)))
  return path, config


def test_loaded_new_and_dropped(pretrained):
  path, src_config = pretrained
  target = finetune.model_config(path, {"num_labels": 3, "dropout_rate": 0.0})
  assert target.d_model == 16 and target.num_labels == 3 and target.dropout_rate == 0.0
  fresh = models.init(target, jax.random.key(2))
  before = _flat(fresh)
  params, report = finetune.load_pretrained(jax.device_get(fresh), path)
  src = _flat(models.init(src_config, jax.random.key(1)))
  got = _flat(params)
  assert report["new"] == ["classifier/bias", "classifier/kernel"]
  assert report["dropped"] == ["classifier/bias", "classifier/kernel"]
  assert set(report["loaded"]) == set(got) - {"classifier/bias", "classifier/kernel"}
  for p in report["loaded"]:
    np.testing.assert_array_equal(got[p], src[p])
  for p in report["new"]:
    np.testing.assert_array_equal(got[p], before[p])
  assert got["classifier/kernel"].shape == (16, 3)
  assert "loaded" in finetune.describe(report, path)


def test_a_changed_shape_is_refused_by_name(pretrained):
  path, _ = pretrained
  other = dataclasses.replace(BASE, d_ff=48, num_labels=3)
  with pytest.raises(ValueError, match=r"tensor blocks/layers/mlp/\w+/kernel has shape"):
    finetune.load_pretrained(jax.device_get(models.init(other, jax.random.key(0))), path)


def test_init_from_takes_the_architecture_and_refuses_a_preset(pretrained):
  path, _ = pretrained
  raw = {
    "run_dir": "r",
    "model": {"init_from": path, "num_labels": 2},
    "data": {"path": "d", "task": "classify"},
  }
  exp = load_experiment(None, raw=raw)
  assert exp.model_config(vocab_size=999).vocab_size == 40  # the source's, not the data's
  with pytest.raises(ValueError, match="drop model.preset"):
    load_experiment(None, ["model.preset=bert-tiny"], raw=raw)
  with pytest.raises(ValueError, match="model.init_from=.*no such run directory"):
    load_experiment(None, ["model.init_from=/nonexistent"], raw=raw).model_config()
  with pytest.raises(ValueError, match="model.d_fff: not a field of the BERTConfig"):
    load_experiment(None, ["model.d_fff=3"], raw=raw).model_config()


def test_vocab_from_reuses_the_pretraining_ids(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir(), b.mkdir()
  (a / "x.py").write_text("def alpha(beta):\n    return beta + gamma\n" * 20)
  (b / "y.py").write_text("def gamma(alpha):\n    return alpha * delta_unseen\n" * 20)
  data.prepare([str(a)], str(tmp_path / "da"), compact_vocab=True, progress=False, val_fraction=0)
  data.prepare(
    [str(b)], str(tmp_path / "db"), vocab_from=str(tmp_path / "da"), progress=False, val_fraction=0
  )
  da, db = data.load_dataset(str(tmp_path / "da")), data.load_dataset(str(tmp_path / "db"))
  assert da.vocab_size == db.vocab_size
  assert json.load(open(tmp_path / "da" / "vocab.json")) == json.load(
    open(tmp_path / "db" / "vocab.json")
  )
  tok = da.tokenizer
  ids = db.stream("train").doc(0)
  assert ids.tolist() == tok.encode((b / "y.py").read_text())
  assert tok.unk_id in ids.tolist()  # a word the pretraining corpus never had


def test_pretrain_runs_first_only_when_init_from_is_absent(tmp_path, pretrained, monkeypatch):
  from transformer_jax.train import trainer

  calls = []
  monkeypatch.setattr(trainer, "train", lambda exp, **kw: calls.append(exp.run_dir) or {})
  pre_yaml = tmp_path / "pre.yaml"
  missing = tmp_path / "runs" / "pre"
  pre_yaml.write_text(
    f"run_dir: {missing}\nmodel: {{preset: bert-tiny}}\n"
    "data: {inputs: [stdlib]}\ntrain: {steps: 2}\n"
  )
  raw = {
    "run_dir": str(tmp_path / "ft"),
    "pretrain": str(pre_yaml),
    "data": {"task": "classify", "inputs": ["stdlib:packages"]},
  }
  # The pretrained run exists: nothing to do.
  exp = load_experiment(None, raw={**raw, "model": {"init_from": pretrained[0]}}).absolute()
  trainer.pretrain_first(exp, progress=False)
  assert calls == []
  # It does not: the pretraining experiment is trained first.
  exp = load_experiment(None, raw={**raw, "model": {"init_from": str(missing)}}).absolute()
  trainer.pretrain_first(exp, progress=False)
  assert calls == [str(missing)]
  # A pretraining experiment that writes elsewhere is refused by name.
  exp = load_experiment(None, raw={**raw, "model": {"init_from": str(tmp_path / "other")}})
  with pytest.raises(ValueError, match="pretrain=.*writes .*not model.init_from"):
    trainer.pretrain_first(exp.absolute(), progress=False)
