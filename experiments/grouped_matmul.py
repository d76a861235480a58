"""One mixture-of-experts layer's forward and backward pass by each way of computing the experts:
time and memory.

The layer: 4096 tokens of width 128, experts of 256 (SwiGLU), top 2, at 8 and 64 experts, float32.
The ways:

- ``ragged_dot``: dropless, ``jax.lax.ragged_dot`` (the base backend's grouped product; XLA:CPU
  lowers it as a masked product over every expert);
- ``blocked_<b>``: dropless, the CPU backend's blocks of b rows of one expert each
  (``backends/cpu/grouped.py``);
- ``dense``: every expert on every token, the unchosen weighted 0 (``MoEKind.impl="dense"``);
- ``capacity``: each expert on a buffer of ``ceil(1.25 * N * k / E)`` rows (copies over it
  dropped).

``decode_forward``: the forward pass alone on ``--decode-tokens`` tokens (a decoding step), for
``ragged_dot``, ``blocked_128`` and ``dense``. ``train_step_seconds``: an AdamW train step of
``moe-tiny`` (4 x 128) and of Mixtral cut to 2 layers of width 512 (4 x 256), the models of
docs/moe.md's ``tjax bench train`` rows, with ``ragged_dot`` and with blocks, timed in turn.

Each is compiled as the train step is (``Backend.step_compiler_options``) and timed as the median
of ``--reps`` calls after one; memory is the compiled program's ``memory_analysis()``: temporaries
and arguments.

  python experiments/grouped_matmul.py      # ~5 minutes on 2 CPU cores

Writes experiments/results/grouped_matmul.json (``--out``), the machine recorded
(``bench.machine.describe``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from transformer_jax import backends, models
from transformer_jax.bench import machine
from transformer_jax.layers.moe import MoE, MoEKind
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPACITY_FACTOR = 1.25


def variant(name: str, num_experts: int) -> tuple[MoEKind, backends.Backend]:
  """The layer's kind and backend for way ``name``."""
  kind = MoEKind(num_experts=num_experts, top_k=2, d_ff=256)
  cpu = backends.current()
  match name.split("_"):
    case ["grouped"]:  # the backend's own grouped product, whatever the platform
      return kind, cpu
    case ["ragged", "dot"]:
      return kind, dataclasses.replace(cpu, grouped_block=None)
    case ["blocked", b]:  # blocks of up to b rows (fewer for few rows per expert)
      return kind, dataclasses.replace(cpu, grouped_block=int(b))
    case ["dense"]:
      return dataclasses.replace(kind, impl="dense"), cpu
    case ["capacity"]:
      return dataclasses.replace(kind, capacity_factor=CAPACITY_FACTOR), cpu
  raise ValueError(f"unknown way {name!r}")


def measure(name: str, num_experts: int, tokens: int, reps: int, backward: bool = True) -> dict:
  """``{"seconds", "temp_bytes", "argument_bytes"}`` of one forward+backward (``backward``) or
  forward pass."""
  kind, backend = variant(name, num_experts)
  layer = MoE(
    128, kind, activation="silu", init_std=0.02, out_init_std=0.02, dtype=jnp.float32,
    param_dtype=jnp.float32, rngs=nnx.Rngs(0), backend=backend,
  )  # fmt: skip
  graphdef, params = nnx.split(layer)
  x = jax.random.normal(jax.random.key(1), (1, tokens, 128))

  def loss(params, x):
    y, stats = nnx.merge(graphdef, params)(x)
    return jnp.sum(y**2) + stats["load_balancing"]

  options = backend.step_compiler_options()
  with backend.compiling():
    compiled = (
      jax.jit(
        jax.grad(loss, argnums=(0, 1)) if backward else loss, compiler_options=options or None
      )
      .lower(params, x)
      .compile()
    )
  step = backend.hold(compiled, options)
  mem = compiled.memory_analysis()
  jax.block_until_ready(step(params, x))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, x))
    times.append(time.perf_counter() - t0)
  return {
    "seconds": float(np.median(times)),
    "temp_bytes": int(mem.temp_size_in_bytes),
    "argument_bytes": int(mem.argument_size_in_bytes),
  }


# Train steps of whole models (the configs of docs/moe.md's ``tjax bench train`` rows):
# (name, preset, overrides, batch, seq_len).
STEPS = (
  ("moe-tiny", "moe-tiny", {}, 4, 128),
  (
    "mixtral_mid",
    "mixtral-8x7b",
    dict(num_layers=2, d_model=512, num_heads=8, num_kv_heads=2, expert_d_ff=1024),
    4,
    256,
  ),
)


def train_steps(reps: int) -> dict:
  """Median seconds of an AdamW train step of each ``STEPS`` model with ``ragged_dot`` and with
  the blocked product, the two timed in turn (one of each per round) so that other jobs on the
  machine slow both alike."""
  out = {}
  for name, preset, overrides, b, t in STEPS:
    config = models.get_config(preset, **overrides)
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32)
    batch = dict(
      tokens=tok, labels=tok, segment_ids=jnp.ones_like(tok), loss_mask=jnp.ones((b, t), bool),
      positions=jnp.broadcast_to(jnp.arange(t), (b, t)),
    )  # fmt: skip
    steps = {}
    for way in ("ragged_dot", "blocked_128"):
      _, backend = variant(way, config.num_experts)
      graphdef, params = nnx.split(models.GPT(config, rngs=nnx.Rngs(0), backend=backend), nnx.Param)
      opt = optax.adamw(1e-4)
      fn = backend.jit_step(step_lib.make_train_step(graphdef, tasks.GPTTask(), opt, seed=0))
      state = step_lib.create_state(params, opt)
      with backend.compiling():
        jax.block_until_ready(fn(state, batch))
      steps[way] = (fn, state)
    times = {way: [] for way in steps}
    for _ in range(reps):
      for way, (fn, state) in steps.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(state, batch))
        times[way].append(time.perf_counter() - t0)
    out[name] = {
      "batch": [b, t],
      "overrides": overrides,
      **{way: float(np.median(v)) for way, v in times.items()},
    }
    print("train step", name, json.dumps(out[name]), flush=True)
  return out


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--experts", type=int, nargs="+", default=[8, 64])
  p.add_argument(
    "--ways",
    nargs="+",
    default=["ragged_dot", "blocked_32", "blocked_64", "blocked_128", "dense", "capacity"],
  )
  p.add_argument("--step-reps", type=int, default=5, help="train steps timed per way (0: none)")
  p.add_argument("--decode-tokens", type=int, default=8, help="forward only, as in decoding")
  p.add_argument("--out", default=os.path.join(ROOT, "experiments/results/grouped_matmul.json"))
  args = p.parse_args(argv)
  result = {
    "command": "python experiments/grouped_matmul.py",
    "argv": list(sys.argv[1:] if argv is None else argv),
    "layer": {"tokens": args.tokens, "d_model": 128, "expert_d_ff": 256, "top_k": 2},
    "capacity_factor": CAPACITY_FACTOR,
    "rows": {},
  }
  for e in args.experts:
    for way in args.ways:
      row = measure(way, e, args.tokens, args.reps)
      result["rows"].setdefault(f"{e}_experts", {})[way] = row
      print(e, way, json.dumps(row), flush=True)
  # A decoding step's few rows: the forward pass only; blocks of one row each here.
  result["decode_forward"] = {"tokens": args.decode_tokens}
  for e in args.experts:
    for way in ("ragged_dot", "blocked_128", "dense"):
      row = measure(way, e, args.decode_tokens, 20, backward=False)
      result["decode_forward"].setdefault(f"{e}_experts", {})[way] = row
      print("decode", e, way, json.dumps(row), flush=True)
  if args.step_reps:
    result["train_step_seconds"] = train_steps(args.step_reps)
  result["machine"] = machine.describe()
  machine.write_json(args.out, result)
  return result


if __name__ == "__main__":
  main()
