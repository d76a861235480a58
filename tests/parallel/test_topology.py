"""A run moves between topologies: two processes of 4 devices, then one of 8, then four of 2, each
leg started by experiments/launch/local_multiprocess.sh (real processes joined by
jax.distributed), reading a two-source mixture, gives the losses and per-source token counts of
one uninterrupted run on 8 devices, the losses within 1e-6 relative (not bitwise: the
data-parallel gradient all-reduce sums in another order when the devices and processes change).
The last checkpoint restores onto a new mesh's shardings. Two real processes build only their own
rows of a batch and assemble it with ``make_array_from_process_local_data``.
"""

import json
import os
import random
import subprocess
import sys

import jax
import pytest
import yaml
from jax.sharding import NamedSharding

from transformer_jax import data, models, parallel, runs
from transformer_jax.train import load_experiment, train
from transformer_jax.train import step as step_lib
from transformer_jax.train.optim import make_optimizer
from tests.parallel.test_multihost import REPO, _child_env, _free_port

SCRIPT = os.path.join(REPO, "experiments", "launch", "local_multiprocess.sh")
# (processes, devices per process, train.steps reached): 2x4 -> 1x8 -> 4x2, two steps a leg.
LEGS = ((2, 4, 2), (1, 8, 4), (4, 2, 6))
STEPS = LEGS[-1][2]
RTOL = 1e-6
TIMEOUT_S = 400


def _experiment(run_dir, dataset) -> dict:
  return {
    "run_dir": str(run_dir),
    "model": {
      "preset": "gpt2-tiny",
      "d_model": 32,
      "num_layers": 1,
      "num_heads": 2,
      "d_ff": 64,
      "max_len": 32,
      "dropout_rate": 0.1,  # the dropout keys too must not depend on the topology
    },
    "data": {"path": dataset, "task": "gpt"},
    "train": {
      "steps": STEPS,
      "batch_size": 8,
      "seq_len": 32,
      "lr": 3e-3,
      "warmup_steps": 1,
      "schedule": "constant",  # a leg's train.steps leaves the learning rates as they were
      "log_every": 1,
      "eval_every": 100,
      "eval_batches": 1,
      "checkpoint_every": 2,
      "samples": 0,
    },
    "bars": {},
  }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
  root = tmp_path_factory.mktemp("topology")
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "class", "for", "in", "if", "x", "y", "the"]
  corpus = root / "corpus"
  corpus.mkdir()
  for d in range(12):
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(30)]
    (corpus / f"doc{d:02d}.txt").write_text("\n".join(lines) + "\n")
  out = str(root / "data")
  data.prepare([str(corpus)], out, compact_vocab=True, progress=False, val_fraction=4)
  return out


def _losses(run_dir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in runs.RunDir(run_dir).read_metrics() if "loss" in r}


def _leg(config, run_dir, processes, devices, steps, log_dir):
  env = {
    **_child_env(),
    "PYTHON": sys.executable,
    "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    "NUM_PROCESSES": str(processes),
    "DEVICES_PER_PROCESS": str(devices),
    "RUN_LOG_DIR": str(log_dir),
  }
  done = subprocess.run(
    ["bash", SCRIPT, str(config), f"run_dir={run_dir}", f"train.steps={steps}"],
    env=env,
    capture_output=True,
    text=True,
    timeout=TIMEOUT_S,
  )
  logs = "".join(
    (log_dir / f"process{i}.log").read_text()[-1500:]
    for i in range(1, processes)
    if (log_dir / f"process{i}.log").exists()
  )
  assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:] + logs
  return done.stdout + done.stderr


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, dataset):
  """A second prepared dataset in ``dataset``'s vocabulary: with it, a two-source mixture."""
  root = tmp_path_factory.mktemp("second_source")
  rng = random.Random(1)
  words = ["return", "import", "self", "value", "node", "while", "try", "None"]
  (root / "code.txt").write_text(
    "\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) for _ in range(60))
  )
  out = str(root / "code")
  data.prepare([str(root / "code.txt")], out, vocab_from=dataset, progress=False, val_fraction=0)
  return [
    {"name": "web", "path": dataset, "weight": 0.7},
    {"name": "code", "path": out, "weight": 0.3},
  ]


@pytest.mark.slow
@pytest.mark.long
def test_resume_across_topologies_matches_the_uninterrupted_run(two_sources, tmp_path):
  """The legs read a 0.7/0.3 mixture of two sources: the losses and each source's token count
  equal one uninterrupted run of this process's 8 devices (the 4x2 leg is the launcher's
  four-process rehearsal)."""

  def experiment(run_dir):
    exp = _experiment(run_dir, None)
    exp["data"] = {"mixture": two_sources, "path": two_sources[0]["path"], "task": "gpt"}
    return exp

  reference = tmp_path / "reference"
  train(load_experiment(None, raw=experiment(reference)), progress=False)
  run_dir = tmp_path / "run"
  config = tmp_path / "exp.yaml"
  config.write_text(yaml.safe_dump(experiment(run_dir)))
  for processes, devices, steps in LEGS:
    out = _leg(config, run_dir, processes, devices, steps, tmp_path)
    assert f"process 0/{processes}: {devices} local devices (cpu), 8 global devices" in out
    if steps > LEGS[0][2]:
      assert f"at step {steps - 2}" in out  # resumed, not started over
  want, got = _losses(reference), _losses(run_dir)
  assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
  worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in want)
  print(f"largest relative loss difference over {STEPS} steps: {worst:.2e}")
  assert worst <= RTOL, {s: (got[s], want[s]) for s in want}
  tokens = json.loads((run_dir / "final.json").read_text())["tokens_per_source"]
  assert tokens == json.loads((reference / "final.json").read_text())["tokens_per_source"]
  assert sorted(tokens) == ["code", "web"] and all(n > 0 for n in tokens.values()), tokens
  assert _meta(run_dir, STEPS)["loader"] == {"step": STEPS, "sequences": STEPS * 8}
  _check_restore_places_onto_the_new_mesh(run_dir)


def _meta(run_dir, step):
  ckpt = runs.Checkpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
  try:
    return ckpt.read_meta(step)
  finally:
    ckpt.close()


def _check_restore_places_onto_the_new_mesh(run_dir):
  """The four-process checkpoint restored the way the trainer resumes, onto fsdp=4 x tensor=2:
  every array comes back carrying its target NamedSharding on that mesh (placed shard by shard,
  not gathered), and the sharded leaves really are split."""
  with open(os.path.join(run_dir, "model.yaml")) as f:
    config = models.config_from_dict(yaml.safe_load(f))
  exp = load_experiment(os.path.join(run_dir, "config.yaml"))
  mesh = parallel.make_mesh({"fsdp": 4, "tensor": 2})
  target = step_lib.abstract_state(config, make_optimizer(exp.train), mesh)
  ckpt = runs.Checkpoints(os.path.join(run_dir, "checkpoints"), async_save=False)
  try:
    params, opt_state, _ = ckpt.restore(STEPS, target.params, target.opt_state)
  finally:
    ckpt.close()
  leaves = jax.tree.leaves((params, opt_state))
  wanted = jax.tree.leaves((target.params, target.opt_state))
  for array, want in zip(leaves, wanted, strict=True):
    assert isinstance(array.sharding, NamedSharding) and array.sharding.mesh == mesh
    assert array.sharding == want.sharding
  split = [a for a in jax.tree.leaves(params) if not a.sharding.is_fully_replicated]
  assert split and all(max(s.data.size for s in a.addressable_shards) < a.size for a in split)


# A process of a two-process job: builds its loader's rows (counting them where they are built),
# assembles the global batch, and checks its shards against the whole batch it can compute alone.
_PER_HOST = """
import json, sys
import numpy as np
from transformer_jax.parallel import distributed
distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
import jax
from transformer_jax import data, parallel
from transformer_jax.train import step as step_lib
built = []
gather = data.GPTLoader.gather
data.GPTLoader.gather = lambda self, starts: built.append(len(starts)) or gather(self, starts)
ds = data.load_dataset(sys.argv[3])
loader = data.GPTLoader(ds, batch_size=8, seq_len=32, seed=3)
loader.set_state({"step": 5, "sequences": 44})
local = next(loader)
rows = list(built)
whole = data.GPTLoader(ds, batch_size=8, seq_len=32, seed=3, process_index=0, process_count=1)
whole.set_state({"step": 5, "sequences": 44})
whole = whole.batch_at(5)
mesh = parallel.make_mesh({"data": 2, "fsdp": 2})
batch = step_lib.shard_batch(local, mesh)
same = all(
  np.array_equal(np.asarray(s.data), whole[k][s.index])
  for k, a in batch.items() for s in a.addressable_shards
)
total = int(jax.jit(lambda t: t.sum())(batch["tokens"]))
print(json.dumps({"rows": rows, "local_rows": [loader.local_rows.start, loader.local_rows.stop],
                  "same": same, "total": total, "want": int(whole["tokens"].sum())}))
"""


def test_each_process_builds_only_its_rows_of_the_global_batch(dataset):
  address = f"127.0.0.1:{_free_port()}"
  env = {**_child_env(), "JAX_NUM_CPU_DEVICES": "2"}
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _PER_HOST, address, str(i), dataset],
      cwd=REPO,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for i in range(2)
  ]
  outs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
  assert all(p.returncode == 0 for p in procs), "\n".join(err[-3000:] for _, err in outs)
  reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
  assert [r["rows"] for r in reports] == [[4], [4]]  # each built 4 of the 8 rows, once
  assert [r["local_rows"] for r in reports] == [[0, 4], [4, 8]]
  assert all(r["same"] for r in reports)  # its shards hold the global batch's rows
  assert all(r["total"] == r["want"] for r in reports)  # the assembled array is the batch
