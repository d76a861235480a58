"""A mixture of experts against dense models of equal active and of equal total parameters, and the
grouped product against a dense masked one.

Part 1 trains three models on the demo corpus with experiments/moe_tiny.yaml's data and schedule:
``moe`` (8 experts of 256, top 2), ``dense_active`` (one MLP of 512: the parameters a token uses
equal the mixture's) and ``dense_total`` (one MLP of 2048: the mixture's total). It reports the
final validation loss, the mean step time after the first ``--warmup`` steps (from metrics.jsonl's
tokens per second), and for the mixture the tokens each expert received over the last logged steps
(and the largest expert's share over an even one).

Part 2 times one forward and backward pass of a mixture layer (4096 tokens, width 128, experts of
256, top 2) at 8 and 64 experts, dropless through ``Backend.grouped_matmul`` (on CPU the blocked
form, ``backends/cpu/grouped.py``) against every expert on every token with the unchosen weighted
0 (``MoEKind.impl="dense"``), each measured by experiments/grouped_matmul.py's ``measure``
(compiled as the train step is), which compares every way.

  python experiments/moe_vs_dense.py                 # both parts; part 1 ~3 x 5 min on 2 CPU cores
  python experiments/moe_vs_dense.py --steps 60 --skip-training

Writes experiments/results/moe_vs_dense.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import jax
import numpy as np
import yaml

from transformer_jax import hardware, models
from transformer_jax.train import load_experiment, train
from transformer_jax.bench import machine

from grouped_matmul import measure  # experiments/: this script's own folder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
YAML = os.path.join(ROOT, "experiments/moe_tiny.yaml")
VARIANTS = {
  "moe": [],
  "dense_active": ["model.num_experts=0", "model.d_ff=512"],
  "dense_total": ["model.num_experts=0", "model.d_ff=2048"],
}


def train_variant(name: str, args) -> dict:
  run_dir = os.path.join(args.runs, name)
  overrides = [
    f"run_dir={run_dir}",
    f"train.steps={args.steps}",
    f"train.eval_every={args.steps}",
    f"train.checkpoint_every={args.steps}",
    "train.samples=0",
    *VARIANTS[name],
  ]
  if args.data:
    overrides.append(f"data.path={args.data}")
  exp = load_experiment(YAML, overrides)
  train(exp, progress=False, force_new=True)
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    lines = [json.loads(x) for x in f]
  steps = [r for r in lines if "tokens_per_sec" in r and r["step"] > args.warmup]
  evals = [r for r in lines if "val_loss" in r]
  tokens = exp.train.batch_size * exp.train.seq_len
  with open(os.path.join(run_dir, "model.yaml")) as f:
    pc = models.param_count(models.config_from_dict(yaml.safe_load(f)))
  row = {
    "val_loss": evals[-1]["val_loss"],
    "step_seconds": float(np.mean([tokens / r["tokens_per_sec"] for r in steps])),
    "params_total": pc.total,
    "params_active": pc.active,
  }
  counts = [np.asarray(r["moe_tokens_per_expert"]) for r in steps if "moe_tokens_per_expert" in r]
  if counts:
    last = np.sum(counts[-5:], axis=0)  # [L, E]
    row["tokens_per_expert_last5"] = last.tolist()
    row["max_over_even_share"] = float((last.max(-1) / last.mean(-1)).max())
    row["balance_loss"] = steps[-1]["moe_balance_loss"]
  return row


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=400)
  p.add_argument("--warmup", type=int, default=20)
  p.add_argument("--runs", default="/tmp/moe_vs_dense")
  p.add_argument("--data", default=None, help="a prepared dataset (default: the YAML's)")
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--skip-training", action="store_true")
  p.add_argument("--out", default=os.path.join(ROOT, "experiments/results/moe_vs_dense.json"))
  args = p.parse_args(argv)
  result = {"steps": args.steps}
  if not args.skip_training:
    result["training"] = {name: train_variant(name, args) for name in VARIANTS}
    print(json.dumps(result["training"], indent=1), flush=True)
  impls = ("grouped", "dense")
  result["layer_seconds"] = {
    f"{e}_experts": {i: measure(i, e, args.tokens, args.reps)["seconds"] for i in impls}
    for e in (8, 64)
  }
  print(json.dumps(result["layer_seconds"]), flush=True)
  result["machine"] = {
    "cpu": hardware.cpu_name(),
    "platform": platform.platform(),
    "jax": jax.__version__,
    "backend": jax.default_backend(),
  }
  machine.write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
