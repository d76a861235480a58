"""The kernel table: validated fields, an experiment's ``kernels:`` section recorded in the run's
``config.yaml``, and a lever that changes the compiled program and nothing else."""

import dataclasses

import jax
import pytest
import yaml
from flax import nnx

from transformer_jax import backends, models
from transformer_jax.backends import KernelTable
from tests.train.conftest import run_cli


def test_defaults_are_the_library_without_a_table():
  table = KernelTable()
  assert table.changed() == {} and table.no_effect_on("cpu") == []
  assert KernelTable.from_dict(None) == KernelTable.from_dict({}) == table
  assert hash(table) == hash(KernelTable())  # a static field of a model's graph


def test_fields_are_read_from_a_mapping_and_written_back():
  raw = {
    "pad_cols": "1.28e2",
    "cudnn_packed_segments": 16.0,
    "step_options": {"xla_gpu_enable_triton_gemm": True},
    "decode_options": {},
  }
  table = KernelTable.from_dict(raw)
  assert table == KernelTable(
    pad_cols=128, cudnn_packed_segments=16, step_options={"xla_gpu_enable_triton_gemm": True}
  )
  assert table.to_dict() == {**raw, "pad_cols": 128, "cudnn_packed_segments": 16}
  assert KernelTable.from_dict(table.to_dict()) == table
  assert table.changed() == {
    "pad_cols": 128,
    "cudnn_packed_segments": 16,
    "step_options": {"xla_gpu_enable_triton_gemm": True},
  }
  assert table.no_effect_on("cpu") == ["cudnn_packed_segments"]
  assert table.no_effect_on("gpu") == []


@pytest.mark.parametrize(
  "raw,words",
  [
    ({"pad_col": 8}, "kernels.pad_col: unknown key (did you mean 'pad_cols'?)"),
    (
      {"pad_cols": 99999999999999999999},
      "kernels.pad_cols=99999999999999999999 must be 0 (off) or an integer from 2 to 65536",
    ),
    ({"pad_cols": 1}, "kernels.pad_cols=1 must be 0 (off)"),
    ({"pad_cols": -8}, "kernels.pad_cols=-8 must be 0 (off)"),
    ({"pad_cols": "1e999"}, "kernels.pad_cols='1e999': expected an integer"),
    ({"pad_cols": 12.5}, "kernels.pad_cols=12.5: expected an integer"),
    ({"pad_cols": True}, "kernels.pad_cols=True: expected an integer"),
    ({"cudnn_packed_segments": "four"}, "kernels.cudnn_packed_segments='four': expected an integ"),
    ({"step_options": {"gpu_triton": 1}}, "kernels.step_options.gpu_triton: expected an XLA opt"),
    ({"step_options": {"xla_a": [1]}}, "kernels.step_options.xla_a=[1]: expected true/false"),
    ({"decode_options": 3}, "kernels.decode_options=3: expected a mapping"),
  ],
)
def test_bad_fields_are_named_with_their_values(raw, words):
  with pytest.raises(ValueError) as e:
    KernelTable.from_dict(raw)
  assert words in str(e.value)


def test_a_backend_is_a_hashable_static_field_of_the_model():
  config = models.get_config("gpt2-tiny", num_layers=1, vocab_size=96)
  table = KernelTable(pad_cols=64)
  backend = backends.current(table)
  assert backend == backends.current(KernelTable(pad_cols=64)) != backends.current()
  graphdef, params = nnx.split(models.create(config, backend=backend))
  assert hash(graphdef) == hash(models.graphdef(config, None, backends.current(table)))
  assert graphdef != models.graphdef(config)
  assert nnx.merge(graphdef, params).blocks.layers.attn.backend == backend


def _tiny_experiment(path, run_dir, dataset, kernels=None):
  exp = {
    "run_dir": str(run_dir),
    "data": {"path": dataset, "task": "gpt"},
    "model": {
      "preset": "gpt2-tiny",
      "d_model": 32,
      "num_layers": 1,
      "num_heads": 2,
      "d_ff": 64,
      "max_len": 32,
    },
    "train": {
      "steps": 1,
      "batch_size": 2,
      "seq_len": 32,
      "warmup_steps": 0,
      "eval_every": 1000,
      "eval_batches": 1,
      "samples": 0,
    },
  }
  if kernels is not None:
    exp["kernels"] = kernels
  path.write_text(yaml.safe_dump(exp))
  return str(path)


def _lowered_step(exp) -> str:
  """The text of the run's train step, lowered for its batch shapes (nothing compiled)."""
  from transformer_jax import parallel
  from transformer_jax.train import make_plan
  from transformer_jax.train import step as step_lib

  plan = make_plan(exp, purpose="export")
  state = plan.method.abstract_state(plan.optimizer, plan.mesh)
  sharding = parallel.batch_sharding(plan.mesh)
  batch = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding)
    for k, v in plan.task.batch_shapes(exp.train.batch_size, exp.train.seq_len).items()
  }
  step = step_lib.jit_train_step(plan.train_step(), plan.mesh, state, backend=plan.backend)
  return step.lower(state, batch).as_text()


@pytest.mark.slow  # about 20 s: one training step, two lowered steps
def test_a_lever_set_in_an_experiment_is_recorded_and_changes_the_program(tmp_path, text_dataset):
  from transformer_jax.train import load_experiment
  from transformer_jax.train.config import changed_keys, fixed_changes

  run_dir = tmp_path / "run"
  # "1e3": YAML 1.1 reads it as a string; the table reads it as the integer 1000, and pads the
  # vocabulary (under 1000 tokens) to 1000 columns.
  cfg = _tiny_experiment(tmp_path / "e.yaml", run_dir, text_dataset, {"pad_cols": "1e3"})
  code, _, err = run_cli("train", cfg, "--no-progress")
  assert code == 0, err[-3000:]
  stored = yaml.safe_load((run_dir / "config.yaml").read_text())
  assert stored["kernels"] == {**KernelTable().to_dict(), "pad_cols": 1000}
  exp = load_experiment(str(run_dir / "config.yaml"))
  assert exp.kernels == KernelTable(pad_cols=1000)
  d = models.get_config("gpt2-tiny", d_model=32).d_model
  padded, plain = _lowered_step(exp), _lowered_step(dataclasses.replace(exp, kernels=KernelTable()))
  assert padded != plain
  assert f"1000x{d}x" in padded and f"1000x{d}x" not in plain  # the padded [1000, D] table
  # The lever is not the model: a run may resume with another table.
  other = dataclasses.replace(exp, kernels=KernelTable(pad_cols=64))
  assert changed_keys(exp.to_dict(), other.to_dict()) == [("kernels.pad_cols", 1000, 64)]
  assert fixed_changes(exp.to_dict(), other.to_dict()) == []


def test_a_bad_kernels_section_is_refused_naming_the_field(tmp_path, text_dataset):
  cfg = _tiny_experiment(
    tmp_path / "e.yaml", tmp_path / "run", text_dataset, {"pad_cols": 99999999999999999999}
  )
  code, _, err = run_cli("train", cfg, "--no-progress")
  assert code == 2
  assert "kernels.pad_cols=99999999999999999999 must be 0 (off)" in err
  assert len(err.strip().splitlines()) == 1, err
  assert not (tmp_path / "run").exists()
  code, _, err = run_cli("train", cfg, "kernels.pad_colz=8")
  assert code == 2 and "kernels.pad_colz: unknown key (did you mean 'pad_cols'?)" in err
