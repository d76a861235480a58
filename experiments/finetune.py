"""LoRA against full fine-tuning against the frozen base, on experiments/gpt_lora_tiny.yaml.

Runs, each in its own process (so peak memory is its own):
  * ``lora``: the experiment as written (rank-8 adapters on the gpt_tiny demo's model);
  * ``full``: the same with ``train.lora=null`` (every parameter trains);
  * ``frozen``: the base model evaluated on the new corpus' validation split (no training).
and writes ``experiments/results/finetune.json``: trainable parameters and their fraction,
validation loss, peak resident memory (max RSS of the process, which includes JAX's own ~0.5 GB)
and wall time. Train ``experiments/gpt_tiny.yaml`` first.

  python experiments/finetune.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CONFIG = os.path.join(HERE, "gpt_lora_tiny.yaml")

_CHILD = r"""
import json, resource, sys, time
from transformer_jax.train import load_experiment, train
from transformer_jax.train.trainer import evaluate_run
mode, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
t0 = time.perf_counter()
if mode == "frozen":
  exp = load_experiment(config, overrides)
  ds = exp.data.path
  out = evaluate_run(exp.model["init_from"], [f"data.path={ds}",
                     f"train.eval_batches={exp.train.eval_batches}",
                     f"train.batch_size={exp.train.batch_size}",
                     f"train.seq_len={exp.train.seq_len}"])
  from transformer_jax import models, runs
  n = models.count_params(runs.RunDir(exp.model["init_from"]).require_model())
  out = {"val_loss": out["val_loss"], "trainable": 0, "total": n, "fraction": 0.0}
else:
  final = train(load_experiment(config, overrides), progress=False, force_new=True)
  out = {"val_loss": final["val_loss"]}
  if "lora" in final:
    out.update(final["lora"])
out["wall_s"] = time.perf_counter() - t0
out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
print("RESULT " + json.dumps(out))
"""


def _run(mode: str, overrides: list[str]) -> dict:
  env = {**os.environ, "PYTHONPATH": REPO}
  proc = subprocess.run(
    [sys.executable, "-c", _CHILD, mode, CONFIG, *overrides],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
  )
  if proc.returncode:
    raise SystemExit(f"{mode}: failed\n{proc.stderr[-3000:]}")
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT ") :])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=None, help="override train.steps")
  args = parser.parse_args()
  common = [] if args.steps is None else [f"train.steps={args.steps}"]
  results = {}
  for mode, extra in (
    ("lora", []),  # first: prepares the new corpus
    ("full", ["train.lora=null", "run_dir=runs/gpt_full_ft_tiny"]),
    ("frozen", []),
  ):
    print(f"{mode} ...", flush=True)
    results[mode] = _run(mode, common + extra)
    print(f"  {results[mode]}", flush=True)
  out = {
    "config": os.path.relpath(CONFIG, REPO),
    "overrides": common,
    "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared)",
    "results": results,
  }
  path = os.path.join(HERE, "results", "finetune.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
