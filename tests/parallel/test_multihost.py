"""Multi-host training for real: two local processes (4 CPU devices each, gloo collectives,
joined by ``jax.distributed.initialize`` on 127.0.0.1) train a tiny GPT and checkpoint it; this
process (8 devices) restores the checkpoint onto other meshes and device counts. Also the start-up
rules of ``parallel.distributed`` (which arguments and variables start a multi-process job, and the
errors).
"""

import json
import os
import random
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from transformer_jax import cli, data, models, parallel
from transformer_jax.parallel import distributed
from transformer_jax.train import load_experiment
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train import plan
from transformer_jax.runs import Checkpoints
from transformer_jax.train.optim import make_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESH = "mesh.data=2 mesh.fsdp=4"  # the two-process run: FSDP spanning both processes
STEPS = 3  # checkpoints at STEPS - 1 and STEPS
TIMEOUT_S = 300
TINY_GPT = {
  "preset": "gpt2-tiny",
  "d_model": 32,
  "num_layers": 2,
  "num_heads": 2,
  "d_ff": 64,
  "max_len": 32,
  "dropout_rate": 0.1,
}
_DIST_ENV = (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _child_env(**extra) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
  flags = [
    f
    for f in env.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env.update(
    XLA_FLAGS=" ".join(flags),
    JAX_PLATFORMS="cpu",
    JAX_NUM_CPU_DEVICES="4",
    JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
    **extra,
  )
  return env


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  """Runs ``tjax train`` as processes 0 and 1 of 2; returns (run_dir, stdout of each process)."""
  root = tmp_path_factory.mktemp("multihost")
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "class", "for", "in", "if", "x", "y", "the"]
  corpus = root / "corpus"
  corpus.mkdir()
  for d in range(12):
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(30)]
    (corpus / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
  dataset = str(root / "data")
  # Prepared up front: process 0 alone would prepare it, and process 1 would not wait for it.
  data.prepare([str(corpus)], dataset, compact_vocab=True, progress=False, val_fraction=4)
  run_dir = root / "run"
  config = root / "exp.yaml"
  config.write_text(
    yaml.safe_dump(
      {
        "run_dir": str(run_dir),
        "model": TINY_GPT,
        "data": {"path": dataset, "task": "gpt"},
        "train": {
          "batch_size": 8,
          "seq_len": 32,
          "lr": 3e-3,
          "warmup_steps": 2,
          "steps": STEPS,
          "checkpoint_every": STEPS - 1,
          "log_every": 1,
          "eval_every": 1000,
          "eval_batches": 1,
          "samples": 0,
        },
      }
    )
  )

  address = f"127.0.0.1:{_free_port()}"
  base = [
    sys.executable,
    "-m",
    "transformer_jax.cli",
    "train",
    str(config),
    *MESH.split(),
    "--no-progress",
  ]
  # Process 0 is told by flags, process 1 by the environment: both ways must work.
  commands = [
    (
      base + ["--coordinator-address", address, "--num-processes", "2", "--process-id", "0"],
      _child_env(),
    ),
    (base, _child_env(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1")),
  ]
  procs = [
    subprocess.Popen(
      cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for cmd, env in commands
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=TIMEOUT_S))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    outputs = [p.communicate() for p in procs]
    pytest.fail("the two-process run timed out:\n" + _report(procs, outputs))
  if any(p.returncode != 0 for p in procs):
    pytest.fail("the two-process run failed:\n" + _report(procs, outputs))
  return str(run_dir), [out for out, _ in outputs]


def _report(procs, outputs) -> str:
  return "\n".join(
    f"--- process {i} (exit {p.returncode}) stderr:\n{err[-4000:]}\nstdout:\n{out[-2000:]}"
    for i, (p, (out, err)) in enumerate(zip(procs, outputs))
  )


def _targets(run_dir, mesh, spec_of):
  """``ShapeDtypeStruct`` params and optimizer state carrying shardings on ``mesh``."""
  with open(os.path.join(run_dir, "model.yaml")) as f:
    config = models.config_from_dict(yaml.safe_load(f))
  exp = load_experiment(os.path.join(run_dir, "config.yaml"))
  optimizer = make_optimizer(exp.train)
  params = models.init_abstract(config)
  opt_state = jax.eval_shape(optimizer.init, params)

  def place(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, spec_of(a.shape)))

  return config, exp, optimizer, jax.tree.map(place, params), jax.tree.map(place, opt_state)


def _over_fsdp(shape) -> P:
  """Split the first axis divisible by 4 over ``fsdp``: a layout no process of the run used."""
  for i, n in enumerate(shape):
    if n % 4 == 0:
      return P(*([None] * i), "fsdp")
  return P()


def _metrics(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.long
def test_two_processes_train_then_restore_on_other_meshes(two_process_run):
  """One test, so that pytest-xdist never runs the two-process job twice."""
  run_dir, stdouts = two_process_run
  _check_the_run(run_dir, stdouts)
  _check_restore_onto_other_meshes_gives_identical_params(run_dir)
  _check_restore_and_one_step_matches_the_continued_run(run_dir)


def _check_the_run(run_dir, stdouts):
  assert jax.config.jax_cpu_collectives_implementation == "gloo"
  assert "process 0/2: 4 local devices (cpu), 8 global devices" in stdouts[0]
  assert "process 1/2" not in stdouts[1]  # start-up and metrics lines come from process 0 only
  lines = _metrics(run_dir)
  assert [r["step"] for r in lines if "loss" in r] == list(range(1, STEPS + 1))
  assert all(np.isfinite(r["loss"]) for r in lines if "loss" in r)
  for step in (STEPS - 1, STEPS):
    params_dir = os.path.join(run_dir, "checkpoints", str(step), "params")
    # Both processes took part in writing (one OCDBT file set each).
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(params_dir))


def _check_restore_onto_other_meshes_gives_identical_params(run_dir):
  ckpt = Checkpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
  # 8 devices in reverse order as data=2 x fsdp=4 (sharded leaves), and 4 devices replicated.
  sharded = Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "fsdp"))
  small = Mesh(np.array(jax.devices()[:4]), ("data",))
  _, _, _, params_a, opt_a = _targets(run_dir, sharded, _over_fsdp)
  _, _, _, params_b, opt_b = _targets(run_dir, small, lambda shape: P())
  got_a = ckpt.restore(STEPS, params_a, opt_a)
  got_b = ckpt.restore(STEPS, params_b, opt_b)
  ckpt.close()
  for target, array in zip(jax.tree.leaves((params_a, opt_a)), jax.tree.leaves(got_a[:2])):
    assert array.sharding == target.sharding  # placed directly, not resharded afterwards
  assert any(not a.sharding.is_fully_replicated for a in jax.tree.leaves(got_a[0]))
  for a, b in zip(jax.tree.leaves(got_a[:2]), jax.tree.leaves(got_b[:2])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert got_a[2]["step"] == STEPS


def _check_restore_and_one_step_matches_the_continued_run(run_dir):
  """Step STEPS - 1 restored the way the trainer resumes, onto all 8 local devices as
  fsdp=4 x tensor=2 (the run used data=2 x fsdp=4 over two processes), plus one sharded train step
  == step STEPS of the two-process run (logged loss and saved parameters)."""
  with open(os.path.join(run_dir, "model.yaml")) as f:
    config = models.config_from_dict(yaml.safe_load(f))
  exp = load_experiment(os.path.join(run_dir, "config.yaml"))
  optimizer = make_optimizer(exp.train)
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
  target = step_lib.abstract_state(config, optimizer, mesh)
  ckpt = Checkpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
  params, opt_state, meta = ckpt.restore(STEPS - 1, target.params, target.opt_state)
  expected, _, _ = ckpt.restore(STEPS, target.params, target.opt_state)
  ckpt.close()
  assert meta["loader"] == {"step": STEPS - 1, "sequences": (STEPS - 1) * 8}
  assert any("tensor" in str(a.sharding.spec) for a in jax.tree.leaves(params))

  t = exp.train
  task = tasks_lib.get_task("gpt")
  state = step_lib.place_state(
    step_lib.TrainState(step=np.int32(STEPS - 1), params=params, opt_state=opt_state), mesh
  )
  train_step = step_lib.jit_train_step(
    step_lib.make_train_step(
      models.graphdef(config),
      task,
      optimizer,
      seed=t.seed,
      microbatches=plan.fixed_microbatches(t),
      label_smoothing=t.label_smoothing,
      z_loss=t.z_loss,
    ),
    mesh,
    state,
  )
  loader = data.GPTLoader(
    data.load_dataset(exp.data.path),
    batch_size=t.batch_size,
    seq_len=t.seq_len,
    seed=t.seed,
    process_index=0,
    process_count=1,
  )
  new_state, metrics = train_step(
    state, step_lib.shard_batch(loader.batch_at(STEPS - 1), mesh, task.keys)
  )

  logged = next(r for r in _metrics(run_dir) if r["step"] == STEPS and "loss" in r)
  assert abs(float(metrics["loss"]) - logged["loss"]) < 1e-5
  for got, want in zip(jax.tree.leaves(new_state.params), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)


# -------------------------------------------------------------------------------------------------
# Start-up rules (no job is started: these fail or return before jax.distributed is called).


@pytest.fixture
def clean_env(monkeypatch):
  for name in _DIST_ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_initialize_without_arguments_or_environment_does_nothing(clean_env):
  assert not distributed.requested()
  assert distributed.initialize() is False
  assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
  "kwargs, env, message",
  [
    ({"num_processes": 2, "process_id": 0}, {}, "--coordinator-address / JAX_COORDINATOR_ADDRESS"),
    ({"coordinator_address": "h:1"}, {}, "--num-processes / JAX_NUM_PROCESSES"),
    ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID"),
    ({"coordinator_address": "h:1", "num_processes": 2, "process_id": 2}, {}, "out of range"),
    ({"coordinator_address": "h:1", "num_processes": 0, "process_id": 0}, {}, "at least 1"),
    ({"coordinator_address": "h", "num_processes": 2, "process_id": 0}, {}, "HOST:PORT"),
    (
      {},
      {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
      "JAX_NUM_PROCESSES='two' is not an integer",
    ),
  ],
)
def test_initialize_rejects_incomplete_or_bad_settings(clean_env, kwargs, env, message):
  for name, value in env.items():
    clean_env.setenv(name, value)
  assert distributed.requested(**kwargs)
  with pytest.raises(ValueError, match=message):
    distributed.initialize(**kwargs)
  assert not jax.distributed.is_initialized()


def test_flags_win_over_environment(clean_env):
  clean_env.setenv("JAX_COORDINATOR_ADDRESS", "h:1")
  clean_env.setenv("JAX_NUM_PROCESSES", "2")
  clean_env.setenv("JAX_PROCESS_ID", "1")
  with pytest.raises(ValueError, match="--process-id=5 is out of range"):
    distributed.initialize(process_id=5)


def test_cli_reports_a_partial_multiprocess_setting(clean_env, capsys):
  assert cli.main(["train", "unused.yaml", "--num-processes", "2"]) == 2
  err = capsys.readouterr().err
  assert "tjax train: error:" in err and "--process-id" in err


def test_describe_names_process_and_devices():
  assert distributed.describe() == "process 0/1: 8 local devices (cpu), 8 global devices"
