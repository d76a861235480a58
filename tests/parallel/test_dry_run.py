"""``tjax train CONFIG --dry-run``: compiles the sharded step on simulated devices, reads no
data."""

import os
import subprocess
import sys

import jax
import pytest
import optax
import yaml

from transformer_jax import models, parallel
from transformer_jax.train import load_experiment
from transformer_jax.train import dry_run as dry
from transformer_jax.train import make_plan
from transformer_jax.train import step as step_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(tmp_path, mesh, model=None, **train):
  path = tmp_path / "exp.yaml"
  path.write_text(
    yaml.safe_dump(
      {
        "run_dir": str(tmp_path / "run"),
        "model": {"preset": "gpt2-tiny", **(model or {})},
        "data": {"path": str(tmp_path / "no-data"), "task": "gpt"},
        "train": {"batch_size": 16, "seq_len": 64, **train},
        "mesh": mesh,
      }
    )
  )
  return str(path)


def _tjax(*args):
  """``tjax ARGS`` in a fresh interpreter, whose device count is the dry run's own: the session's
  XLA flags (which compile faster, tests/conftest.py) go with it, the 8 test devices do not."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  return subprocess.run(
    [sys.executable, "-m", "transformer_jax.cli", *args],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_dry_run_prints_per_device_memory_for_a_16_device_mesh(tmp_path):
  config = _config(tmp_path, {"data": 2, "fsdp": 4, "tensor": 2, "sequence": 1})
  out = _tjax("train", config, "--dry-run")
  assert out.returncode == 0, out.stderr
  text = out.stdout
  assert "mesh data=2 x fsdp=4 x tensor=2 x sequence=1 on 16 simulated devices" in text
  for line in ("parameters (fp32)", "optimizer state", "activations + scratch", "peak estimate"):
    assert line in text
  assert not os.path.exists(tmp_path / "run")  # nothing written, no data needed
  # The kernel each attention takes on each backend, for one device's [B/8, T, N/2, H] share:
  # gpt2-tiny's float32 at 64 tokens is dense on accelerators, too short for splash.
  assert "self-attention          [2, 64, 2, 16] float32: tpu xla, gpu xla, cpu xla" in text


def test_dry_run_names_splash_and_cudnn_for_a_bfloat16_pod_recipe(tmp_path):
  config = _config(
    tmp_path, {"data": 2, "fsdp": 4}, {"max_len": 512}, seq_len=512, dtype="bfloat16"
  )
  out = _tjax("train", config, "--dry-run")
  assert out.returncode == 0, out.stderr
  assert (
    "self-attention          [2, 512, 4, 16] bfloat16: tpu splash, gpu cudnn, cpu" in out.stdout
  )


def test_dry_run_needs_a_device_count_for_a_free_axis(tmp_path):
  out = _tjax("train", _config(tmp_path, {"data": -1}), "--dry-run")
  assert out.returncode != 0
  assert "--devices N" in out.stderr and "Traceback" not in out.stderr
  out = _tjax("train", _config(tmp_path, {"data": -1, "tensor": 2}), "--dry-run", "--devices", "4")
  assert out.returncode == 0, out.stderr
  assert "mesh data=2 x fsdp=1 x tensor=2 x sequence=1 on 4 simulated devices" in out.stdout


def test_dry_run_rejects_heads_not_divisible_by_tensor(tmp_path):
  out = _tjax("train", _config(tmp_path, {"data": 1, "tensor": 8}), "--dry-run")
  assert out.returncode != 0
  assert "num_heads=4 is not divisible by mesh.tensor=8" in out.stderr
  assert "Traceback" not in out.stderr


def test_report_bytes_match_the_sharded_state(tmp_path):
  """The report's per-device parameter and optimizer bytes are what a real sharded state puts on
  each device (in-process, on the 8 test devices)."""
  exp = load_experiment(_config(tmp_path, {"fsdp": 8}))
  report = dry.dry_run(exp)
  config = exp.model_config()
  state = step_lib.init_state(
    config, optax.adamw(1e-3), parallel.make_mesh({"fsdp": 8}), jax.random.key(0)
  )
  device = jax.devices()[3]

  def held(tree):
    return sum(
      s.data.nbytes
      for x in jax.tree.leaves(tree)
      for s in x.addressable_shards
      if s.device == device
    )

  assert report["per_device_bytes"]["parameters"] == held(state.params)
  # make_optimizer's chain may hold extra scalars; the moments dominate.
  assert abs(report["per_device_bytes"]["optimizer_state"] - held(state.opt_state)) < 1024
  assert report["parameters"] == models.count_params(config)
  assert report["per_device_bytes"]["temporaries"] > 0


def test_dry_run_takes_the_vocabulary_of_a_prepared_dataset(tmp_path, text_dataset):
  """The README's dry run after the demo: data.path holds a prepared dataset."""
  from transformer_jax import data

  exp = load_experiment(_config(tmp_path, {"data": 8}), [f"data.path={text_dataset}"])
  plan = make_plan(exp, purpose="dry_run")
  vocab = data.load_dataset(text_dataset).vocab_size
  assert plan.model_config.vocab_size == vocab
  assert f"vocabulary {vocab} from {text_dataset}" == plan.vocab_note


@pytest.mark.parametrize("devices", [0, -2, 2049, 100000])
def test_device_counts_past_what_xla_cpu_simulates_are_refused_first(tmp_path, devices):
  exp = load_experiment(_config(tmp_path, {"data": -1}))
  before = jax.config.jax_num_cpu_devices
  with pytest.raises(ValueError, match=rf"--devices {devices}: .*1 to {dry.MAX_SIMULATED_DEVICES}"):
    dry.simulate_devices(exp, devices)
  assert jax.config.jax_num_cpu_devices == before  # refused before anything was set


def test_a_mesh_too_large_to_simulate_is_refused_by_its_sizes(tmp_path):
  exp = load_experiment(_config(tmp_path, {"data": 64, "fsdp": 64}))
  with pytest.raises(ValueError, match=r"mesh data=64 x fsdp=64 .* 4096 devices.*at most 2048"):
    dry.simulate_devices(exp, None)


def test_devices_without_dry_run_is_refused(tmp_path):
  from tests.train.conftest import run_cli

  code, _, err = run_cli("train", _config(tmp_path, {"data": 1}), "--devices", "4")
  assert code == 2 and "--devices is for --dry-run" in err and "Traceback" not in err
  assert not os.path.exists(tmp_path / "run")


def test_dry_run_names_linear_attention_for_a_linear_model():
  config = models.get_config(
    "gpt2-tiny", attention_kind="linear", linear_decay=0.5, linear_chunk=32
  )
  (row,) = dry.attention_kernels(config, {"data": 1}, 8, 64, packed=True)
  assert row["attention"] == "self-attention"
  assert set(row["kernels"].values()) == {"linear (chunks of 32, decay 0.5)"}


def test_dry_run_names_the_kernel_a_config_forces():
  config = models.get_config("gpt2-tiny", attention_impl="chunked")
  (row,) = dry.attention_kernels(config, {"data": 1}, 8, 64, packed=True)
  assert set(row["kernels"].values()) == {"chunked"}


def test_the_dry_run_plans_a_model_larger_than_this_machine(tmp_path, monkeypatch):
  """A pod's model need not fit the laptop that plans it: the host-memory check is a real run's."""
  from transformer_jax import hardware

  monkeypatch.setattr(hardware, "host_memory_available", lambda: 2**10)
  exp = load_experiment(_config(tmp_path, {"fsdp": 8}))
  plan = make_plan(exp, purpose="dry_run")
  assert dict(plan.mesh.shape)["fsdp"] == 8 and plan.task.name == "gpt"
  with pytest.raises(ValueError, match="more than the 0.0 GiB of memory this machine has free"):
    make_plan(exp)
  assert not os.path.exists(exp.run_dir)


def test_a_dry_run_over_an_existing_run_refuses_another_model(tmp_path):
  """A real run would refuse the change; the dry run must not plan the stored model instead."""
  from transformer_jax import runs

  exp = load_experiment(_config(tmp_path, {"data": 8}))
  stored = exp.model_config()
  runs.save_model(exp.run_dir, stored, models.init(stored, jax.random.key(0)))
  rd = runs.RunDir(exp.run_dir)
  runs.write_atomic(rd.file(runs.CONFIG), yaml.safe_dump(exp.to_dict()))
  assert make_plan(exp, purpose="dry_run").model_config == stored
  changed = load_experiment(_config(tmp_path, {"data": 8}), ["model.attention_kind=linear"])
  with pytest.raises(
    ValueError,
    match=r"holds a run with another model or data \(model\."
    r"attention_kind: 'softmax' -> 'linear'\); a run would refuse it",
  ):
    make_plan(changed, purpose="dry_run")


def test_dry_run_says_how_big_the_dataset_is_and_how_many_epochs_the_steps_read(
  tmp_path, text_dataset
):
  """Tokens, documents and shards from the dataset's metadata (no shard is read); the epochs are
  the steps' tokens over the train split's tokens (each document with its end-of-text token)."""
  import json

  exp = load_experiment(
    _config(tmp_path, {"data": 8}, steps=40, seq_len=32, batch_size=8),
    [f"data.path={text_dataset}"],
  )
  report = dry.dry_run(exp)
  ds = report["dataset"]
  with open(os.path.join(text_dataset, "metadata.json")) as f:
    splits = json.load(f)["splits"]
  assert ds["tokens"] == sum(s["tokens"] for s in splits.values())
  assert ds["documents"] == sum(s["documents"] for s in splits.values())
  train = splits["train"]
  want = 40 * 8 * 32 / (train["tokens"] + train["documents"])
  assert abs(ds["epochs"] - want) <= 0.05 * want
  text = dry.format_report(report)
  assert f"dataset {text_dataset}: {ds['tokens']:,} tokens in {ds['documents']:,} documents" in text
  assert "epoch(s) of train" in text
  missing = dry.dataset_report(load_experiment(_config(tmp_path, {"data": 8})))
  assert "not a prepared dataset" in missing["missing"]
