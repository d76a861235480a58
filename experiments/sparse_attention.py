"""Block-sparse attention against full causal attention: forward + backward time, one run.

Child et al.'s "fixed" pattern (a query sees its own block of 128 positions and the last
``--summary`` positions of every block) against full causal attention, both with the chunked
kernels (``ops.sparse.sparse_attention`` and ``ops.dot_product_attention(implementation=
"chunked")``), at T = 16k by default. The two are timed in the same process, repetitions
interleaved, medians reported, so load on a shared machine hits both alike.

  python experiments/sparse_attention.py                      # ~3 min on 2 CPU cores
  python experiments/sparse_attention.py --length 4096 --reps 2 --out /tmp/sparse.json

Writes experiments/results/sparse_attention.json: per kernel the seconds of each repetition and
their median, the keys each query sees, and the speed-up of the sparse kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp

from transformer_jax import hardware, ops
from transformer_jax.ops.sparse import SparsePattern, sparse_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernels(pattern: SparsePattern):
  """Name -> jitted ``(q, k, v, do) -> (dq, dk, dv)`` of ``sum(out * do)``."""

  def grad_of(attend):
    def loss(q, k, v, do):
      return jnp.sum(attend(q, k, v) * do)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

  return {
    "full_causal": grad_of(
      lambda q, k, v: ops.dot_product_attention(q, k, v, causal=True, implementation="chunked")
    ),
    "sparse_fixed": grad_of(lambda q, k, v: sparse_attention(q, k, v, pattern, causal=True)),
  }


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--length", type=int, default=16384)
  p.add_argument("--block", type=int, default=128)
  p.add_argument("--summary", type=int, default=8)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--reps", type=int, default=3)
  p.add_argument("--out", default=os.path.join(ROOT, "experiments/results/sparse_attention.json"))
  args = p.parse_args(argv)
  pattern = SparsePattern.fixed(block=args.block, summary=args.summary)
  shape = (1, args.length, args.heads, args.head_dim)
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(key, shape, jnp.float32) for key in keys)
  fns = kernels(pattern)
  compile_s = {}
  for name, fn in fns.items():
    start = time.perf_counter()
    jax.block_until_ready(fn(q, k, v, do))  # compiles, and warms up
    compile_s[name] = time.perf_counter() - start
  seconds = {name: [] for name in fns}
  for _ in range(args.reps):  # interleaved: a busy moment slows both
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn(q, k, v, do))
      seconds[name].append(time.perf_counter() - start)
  median = {name: statistics.median(s) for name, s in seconds.items()}
  result = {
    "what": "causal attention forward + backward (gradients of q, k, v), B=1, float32",
    "shape_BTNH": list(shape),
    "pattern": {"kind": "fixed", "block": args.block, "summary": args.summary},
    "keys_per_query": {
      "full_causal": (args.length + 1) / 2,
      "sparse_fixed": pattern.keys_per_query(args.length, causal=True),
    },
    "seconds": seconds,
    "median_seconds": median,
    "first_call_seconds": compile_s,
    "speedup": median["full_causal"] / median["sparse_fixed"],
    "machine": {
      "cpu": hardware.cpu_name(),
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "note": "shared machine: other processes ran at the same time",
    },
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  print(json.dumps({"median_seconds": median, "speedup": result["speedup"]}))
  return result


if __name__ == "__main__":
  main()
