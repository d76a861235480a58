"""Batch-1 greedy decoding time per token of the tree on ``PYTHONPATH``, to compare two versions
of the package where their decoding programs differ (``experiments/program_identity.py``).

One process per measurement; alternate the trees so that both meet the same machine state:

  git worktree add /tmp/old REV
  for i in 1 2 3; do for t in /tmp/old $PWD; do
    (cd /tmp && PYTHONPATH=$t python $OLDPWD/experiments/decode_per_token.py) >> runs.jsonl
  done; done

Each line: the tree, five per-token times (ms) and their median. A time per token is the
difference between a 72-token and an 8-token ``generate`` over 64 tokens (prompt 64 ids, float32,
random init), so the prompt's prefill and the call's fixed costs cancel.
"""

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import transformer_jax as tj
from transformer_jax import generate as generate_lib


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--preset", default="gpt2-small")
  p.add_argument("--repeats", type=int, default=5)
  args = p.parse_args(argv)
  config = tj.models.get_config(args.preset)
  params = tj.models.init(config, jax.random.key(0))
  ids = jnp.arange(1, 65, dtype=jnp.int32)[None]

  def seconds(new_tokens: int) -> float:
    start = time.perf_counter()
    out = generate_lib.generate((config, params), ids, max_new_tokens=new_tokens)
    jax.block_until_ready(out)
    return time.perf_counter() - start

  seconds(8), seconds(72)  # compiled
  per = [(seconds(72) - seconds(8)) / 64 for _ in range(args.repeats)]
  out = {
    "tree": tj.__file__,
    "preset": args.preset,
    "ms_per_token": [round(1000 * x, 3) for x in per],
    "median_ms": round(1000 * float(np.median(per)), 3),
  }
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
