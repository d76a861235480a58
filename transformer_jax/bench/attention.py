"""``tjax bench attention``: forward + backward of ``ops.dot_product_attention`` per implementation.

Causal self-attention on ``[batch, T, heads, head_dim]`` inputs (GPT-2 small's layer by default),
each implementation at each length, jitted with the train step's compile options
(``runtime.step_compiler_options``: oneDNN products on CPU), best of ``--reps`` after a compiling
call. The attention core's FLOPs (``4 * B * N * T * S * H`` forward, 2.5x that forward + backward,
halved for causal masking's useful half) are set against the matmul limit measured in the same
run. Memory per length is ``experiments/attention_memory.py``'s job (a process per cell); this is
the quick time table.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from transformer_jax import ops, runtime
from transformer_jax.bench import machine


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--lengths", default="256,1024,2048", help="comma-separated sequence lengths")
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--implementations", default="xla,chunked", help="comma-separated")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--reps", type=int, default=3)


def run(args) -> dict:
  lengths = [int(x) for x in args.lengths.split(",") if x]
  impls = [x for x in args.implementations.split(",") if x]
  b, n, h = args.batch_size, args.heads, args.head_dim
  # The core's own matmul shapes: scores [T, H] x [H, S] and outputs [T, S] x [S, H].
  t_max = max(lengths)
  limit = machine.matmul_limit([(t_max, h, t_max), (t_max, t_max, h)], dtype="float32")
  options = runtime.step_compiler_options(jax.default_backend())
  rows = []
  for t in lengths:
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.float32).astype(args.dtype)
               for key in keys)
    useful = 2.5 * 4 * b * n * t * t * h / 2   # causal: half the pairs
    for impl in impls:
      loss = lambda q, k, v, impl=impl: jnp.sum(ops.dot_product_attention(  # noqa: E731
          q, k, v, causal=True, implementation=impl).astype(jnp.float32))
      step = runtime.hold(jax.jit(jax.grad(loss, argnums=(0, 1, 2)),
                                  compiler_options=options or None), options)
      start = time.perf_counter()
      jax.block_until_ready(step(q, k, v))
      first = time.perf_counter() - start
      best = np.inf
      for _ in range(args.reps):
        start = time.perf_counter()
        jax.block_until_ready(step(q, k, v))
        best = min(best, time.perf_counter() - start)
      rows.append({"T": t, "implementation": impl, "first_call_s": first, "best_s": best,
                   "useful_flops_per_sec": useful / best,
                   "fraction_of_matmul_limit": useful / best / limit["flops_per_sec"]})
  return {"benchmark": "attention forward+backward, causal", "batch_size": b, "heads": n,
          "head_dim": h, "dtype": args.dtype, "rows": rows, "limit": {"matmul": limit}}


def table(result: dict) -> str:
  lines = [f"attention fwd+bwd, causal, [{result['batch_size']}, T, {result['heads']}, "
           f"{result['head_dim']}] {result['dtype']}"]
  for r in result["rows"]:
    lines.append(f"  T={r['T']:<6d} {r['implementation']:<8s} {r['best_s']:8.3f} s  "
                 f"{r['useful_flops_per_sec'] / 1e9:6.1f} GFLOP/s  "
                 f"{100 * r['fraction_of_matmul_limit']:5.1f}% of the matmul limit")
  return "\n".join(lines)
