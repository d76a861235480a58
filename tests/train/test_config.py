"""Experiment configs: overrides, validation messages naming the key."""

import dataclasses
import math
import typing

import pytest
import yaml

from transformer_jax import models
from transformer_jax.train import load_experiment
from transformer_jax.train.config import DataConfig, TrainConfig

BASE = {"run_dir": "r", "model": {"preset": "gpt2-tiny"}, "data": {"path": "d"}}


def test_dotted_overrides_apply_with_yaml_types():
  exp = load_experiment(
    None,
    [
      "train.steps=200",
      "train.lr=1e-3",
      "model.d_model=32",
      "mesh.data=2",
      "train.clip_norm=null",
      "run_dir=/x",
    ],
    raw=BASE,
  )
  assert exp.train.steps == 200 and exp.train.lr == 1e-3 and exp.mesh.data == 2
  assert exp.train.clip_norm is None and exp.run_dir == "/x"
  assert exp.model_config(vocab_size=50).d_model == 32
  assert exp.model_config(vocab_size=50).vocab_size == 50


@pytest.mark.parametrize(
  "override,message",
  [
    ("train.stpes=3", r"train\.stpes: unknown key \(did you mean 'steps'\?\)"),
    ("train.steps=many", r"train\.steps='many': expected an integer"),
    ("train.lr=fast", r"train\.lr='fast': expected a number"),
    ("train.schedule=cubic", r"train\.schedule='cubic': expected one of"),
    ("trian.steps=3", r"trian: unknown key"),
    ("train.batch_size=10", r"train\.microbatches=3 does not divide train\.batch_size=10"),
    ("train.steps", r"must look like section\.key=value"),
  ],
)
def test_bad_keys_and_types_name_the_key(override, message):
  with pytest.raises(ValueError, match=message):
    load_experiment(
      None, [override, "train.microbatches=3"] if "batch_size" in override else [override], raw=BASE
    )


def test_unknown_model_field_is_named_when_the_experiment_is_read():
  with pytest.raises(ValueError, match=r"model\.pre_nrom: unknown key \(did you mean 'pre_norm"):
    load_experiment(None, ["model.pre_nrom=3"], raw={**BASE, "model": {"family": "seq2seq"}})
  with pytest.raises(ValueError, match=r"model\.d_modle: unknown key \(did you mean 'd_model'"):
    load_experiment(None, ["model.d_modle=3"], raw=BASE)


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
        os.path.join(REPO, exp.model["init_from"])
      ), path
      pre.model_config(vocab_size=1000)


def _exponent_forms(x: float) -> list[str]:
  """``x`` written as YAML exponent floats: ``3e-3``, ``3E-3``, ``3.0e-3`` and ``3.0e+3`` kinds."""
  if x == 0:
    return ["0e0", "0E+0", "0.0e-0"]
  exp = math.floor(math.log10(abs(x)))
  while round(x / 10.0**exp, 9) != int(round(x / 10.0**exp, 9)):
    exp -= 1
  m = int(round(x / 10.0**exp))
  return [f"{m}e{exp}", f"{m}E{exp}", f"{m}.0e{exp:+d}"]


def _float_fields(cls, instance):
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    if float in typing.get_args(hints[f.name]) + (hints[f.name],):
      value = getattr(instance, f.name)
      if isinstance(value, float):
        yield f.name, value


# Every float field of every section, at a valid value (its default; linear_decay at 0.5).
FLOAT_CASES = (
  [("train", k, v) for k, v in _float_fields(TrainConfig, TrainConfig())]
  + [("data", k, v) for k, v in _float_fields(DataConfig, DataConfig())]
  + [
    ("model", k, v)
    for k, v in _float_fields(
      models.GPTConfig,
      models.get_config("gpt2-tiny", attention_kind="linear", linear_decay=0.5, rope_theta=1e6),
    )
  ]
)


@pytest.mark.parametrize(
  "section,key,value", FLOAT_CASES, ids=[f"{s}.{k}" for s, k, _ in FLOAT_CASES]
)
def test_every_float_field_reads_yaml_exponent_forms(tmp_path, section, key, value):
  model = {"preset": "gpt2-tiny", "attention_kind": "linear"}
  for form in _exponent_forms(value):
    raw = {"run_dir": "r", "model": dict(model), "data": {"path": "d"}, "train": {"steps": 5}}
    path = tmp_path / "e.yaml"
    path.write_text(
      yaml.safe_dump(raw).replace(f"{section}:\n", f"{section}:\n  {key}: {form}\n", 1)
    )
    for exp in (
      load_experiment(str(path)),  # in the file
      load_experiment(None, [f"{section}.{key}={form}"], raw=raw),
    ):  # an override
      if section == "model":
        got = getattr(exp.model_config(vocab_size=64), key)
      else:
        got = getattr(getattr(exp, section), key)
      assert type(got) is float and got == pytest.approx(value, rel=1e-12), (form, got)


def test_mistral_rope_theta_trains_from_a_yaml_exponent():
  """Mistral's real rope_theta, as a user writes it, builds the model it means."""
  exp = load_experiment(
    None,
    ["model.rope_theta=1e6", "model.norm_eps=1e-5", "model.init_std=2e-2"],
    raw={**BASE, "model": {"preset": "llama-tiny"}},
  )
  config = exp.model_config(vocab_size=64)
  assert (config.rope_theta, config.norm_eps, config.init_std) == (1e6, 1e-5, 0.02)
  assert isinstance(config.rope_theta, float)


@pytest.mark.parametrize(
  "override,message",
  [
    ("model.d_model=6.5", r"model\.d_model=6\.5: expected an integer"),
    ("model.rope_theta=fast", r"model\.rope_theta='fast': expected a number"),
    ("model.norm_eps=.inf", r"model\.norm_eps=inf: expected a finite number"),
    ("model.gated=1", r"model\.gated=1: expected true or false"),
    ("model.preset=gpt9", r"model\.preset: unknown preset 'gpt9'"),
    ("train.lr=1e999", r"train\.lr=inf: expected a finite number"),
    ("model.rope_scaling={kind: linear, factor: x}", r"model\.rope_scaling\.factor='x'"),
  ],
)
def test_model_fields_are_checked_by_type_when_read(override, message):
  with pytest.raises(ValueError, match=message):
    load_experiment(None, [override], raw=BASE)


def test_errors_in_a_file_name_the_file_and_overrides_do_not(tmp_path):
  path = tmp_path / "e.yaml"
  path.write_text(yaml.safe_dump({**BASE, "train": {"lr": "fast"}}))
  with pytest.raises(ValueError, match=rf"^{path}: train\.lr='fast': expected a number$"):
    load_experiment(str(path))
  with pytest.raises(ValueError, match=r"^train\.steps='x': expected an integer$"):
    load_experiment(str(path), ["train.lr=1e-3", "train.steps=x"])


@pytest.mark.parametrize("missing", ["train", "data", "model", "run_dir"])
def test_a_file_missing_a_required_section_is_refused_naming_it(tmp_path, missing):
  raw = {**BASE, "train": {"steps": 5}}
  del raw[missing]
  path = tmp_path / "e.yaml"
  path.write_text(yaml.safe_dump(raw))
  with pytest.raises(
    ValueError,
    match=rf"^{path} has no {missing} section; an experiment needs "
    "run_dir, model, data, train",
  ):
    load_experiment(str(path))
  path.write_text(yaml.safe_dump({**raw, missing: None}))  # "train:" and nothing under it
  with pytest.raises(ValueError, match=rf"has no {missing} section"):
    load_experiment(str(path))


def test_an_override_may_supply_a_section(tmp_path):
  path = tmp_path / "e.yaml"
  path.write_text(yaml.safe_dump(BASE))
  assert load_experiment(str(path), ["train.steps=7"]).train.steps == 7


@pytest.mark.parametrize(
  "content,message",
  [
    (b"", "is empty"),
    (b"# only a comment\n", "is empty"),
    (b"run_dir: r\nmodel: {preset: gpt2-tiny}\n# caf\xe9\n", "not UTF-8 text"),
    (b"- a list\n", "expected a mapping of sections"),
    (b"train: [1, 2\n", "broken YAML"),
  ],
)
def test_unreadable_config_files_are_named(tmp_path, content, message):
  path = tmp_path / "e.yaml"
  path.write_bytes(content)
  with pytest.raises(ValueError, match=rf"^{path}(:\d+)?:? .*{message}"):
    load_experiment(str(path))


@pytest.mark.parametrize("override", ["model.=3", "train..steps=3", "=3", ".x=1"])
def test_an_override_key_with_an_empty_part_is_refused(override):
  with pytest.raises(ValueError, match=r"has an empty part"):
    load_experiment(None, [override], raw=BASE)


def test_a_compact_vocabulary_count_below_one_is_refused():
  with pytest.raises(ValueError, match=r"data\.compact_vocab=0: expected true, false or a count"):
    load_experiment(None, ["data.compact_vocab=0"], raw=BASE)
