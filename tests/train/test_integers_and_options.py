"""One rule for every integer field of an experiment, from a file or the command line, and XLA
options the compiler does not take refused by name before anything compiles."""

import os
import re

import pytest
import yaml

from transformer_jax import backends
from transformer_jax.backends import table as table_lib
from transformer_jax.runs import schema
from transformer_jax.train import load_experiment, train
from tests.train.conftest import run_cli

BASE = {"run_dir": "r", "model": {"preset": "mamba-tiny"}, "data": {"path": "d"}}
# Integer fields of each kind of section: the model's, the training's, the mesh's, the kernels'.
FIELDS = ("model.d_state", "train.steps", "mesh.fsdp", "kernels.pad_cols")


def _value(exp, key):
  section, name = key.split(".")
  if section == "model":
    return getattr(exp.model_config(vocab_size=64), name)
  return getattr(getattr(exp, section), name)


@pytest.mark.parametrize("key", FIELDS)
@pytest.mark.parametrize("text,expected", [("1e1", 10), ("1000.0", 1000), ("'1e3'", 1000)])
def test_an_integral_float_is_an_integer_in_every_section(key, text, expected):
  exp = load_experiment(None, [f"{key}={text}"], raw=BASE)
  value = _value(exp, key)
  assert value == expected and type(value) is int


@pytest.mark.parametrize("key", FIELDS)
@pytest.mark.parametrize("text", ["10.5", "1e999", "true", "ten"])
def test_anything_else_is_refused_naming_the_field(key, text):
  with pytest.raises(ValueError, match=rf"^{re.escape(key)}=.*: expected an integer$"):
    load_experiment(None, [f"{key}={text}"], raw=BASE)


def test_a_file_follows_the_same_rule(tmp_path):
  path = tmp_path / "e.yaml"
  path.write_text(yaml.safe_dump(BASE) + "train: {steps: 2e3, batch_size: 3.2e1}\n")
  exp = load_experiment(str(path))
  assert (exp.train.steps, exp.train.batch_size) == (2000, 32)


@pytest.mark.parametrize("value", [7, 7.0, 1e1, 10.5, "12", "1e3", "1.5", True, None, float("nan")])
def test_the_kernel_tables_rule_is_the_schemas(value):
  try:
    table = table_lib._integer("pad_cols", value)
  except ValueError:
    table = None
  assert schema.integral(value) == table


def test_an_option_xla_does_not_know_is_refused_by_name_before_anything_runs(
  tmp_path, text_dataset
):
  run_dir = tmp_path / "r"
  raw = {
    "run_dir": str(run_dir),
    "model": {"preset": "gpt2-tiny", "d_model": 16, "num_heads": 1, "d_ff": 32, "max_len": 16},
    "data": {"path": text_dataset, "task": "gpt"},
    "train": {"steps": 2, "batch_size": 2, "seq_len": 16, "samples": 0},
    "kernels": {"step_options": {"xla_no_such_option": True}, "decode_options": {}},
  }
  path = tmp_path / "e.yaml"
  path.write_text(yaml.safe_dump(raw))
  code, _, err = run_cli("train", str(path), "--no-progress")
  platform = backends.platform()
  assert code == 2, err  # bad input, not an internal error
  assert err.strip().splitlines()[-1] == (
    f"tjax train: error: XLA's compiler on {platform} does not take "
    "kernels.step_options.xla_no_such_option=True (No such compile option: "
    "'xla_no_such_option'); see XLA's DebugOptions for the names it knows"
  )
  assert not os.path.exists(run_dir)
  with pytest.raises(ValueError, match=r"kernels\.decode_options\.xla_cpu_enable_fast_math='x'"):
    options = ["kernels.step_options={}", "kernels.decode_options={xla_cpu_enable_fast_math: x}"]
    train(load_experiment(None, options, raw=raw), progress=False)
  assert not os.path.exists(run_dir)
