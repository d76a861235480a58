"""Times the jitted training step of a preset and prints one JSON object.

    python experiments/bench_train.py                                  # gpt2-small, batch 4, seq 128
    python experiments/bench_train.py --preset t5-small --batch-size 8 --seq-len 256 --steps 10
    python experiments/bench_train.py --preset bert-base --dtype bfloat16 --out bench.json

What is timed is the real training step (``make_train_step`` + ``jit_train_step`` on a data mesh over
all devices, AdamW from ``make_optimizer``) on random batches built with numpy and placed on the
devices once, so host data loading and host-to-device transfer are not included. Every timed step
ends with ``jax.block_until_ready`` on the new state and metrics.

Numbers reported:
  * ``compile_s``: ``lower`` + ``compile`` of the step; ``first_step_s``: first call of the compiled
    step (any remaining one-time work shows up as ``first_step_s - median_step_s``).
  * ``step_s``: median / min / max / all of ``--steps`` timed steps after ``--warmup`` steps.
  * ``tokens_per_sec``: ``batch * seq_len / median_step_s``. For seq2seq (S = T = seq_len) source and
    target tokens are both counted (``2 * batch * seq_len`` per step).
  * ``model_flops_per_sec`` = ``flops_per_token * tokens_per_sec``, where ``flops_per_token`` comes
    from ``models.train_flops_per_token(config, seq_len)`` (6 N + attention; for seq2seq that
    function counts one source plus one target token, so it is halved per counted token).
  * ``matmul_flops_per_sec``: this machine's measured matmul rate in the same run (median of jitted
    ``a @ b`` calls, float32 inputs; and bfloat16 inputs with float32 accumulation), and
    ``mfu = model_flops_per_sec / matmul_flops_per_sec[compute dtype]``: utilisation against a
    measured peak rather than a datasheet one, so it compares across machines.

No targets here: this only measures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from transformer_jax import models  # noqa: E402
from transformer_jax.models.config import BERTConfig, GPTConfig, Seq2SeqConfig  # noqa: E402
from transformer_jax.train import step as step_lib  # noqa: E402
from transformer_jax.train import tasks as tasks_lib  # noqa: E402
from transformer_jax.train.config import TrainConfig  # noqa: E402
from transformer_jax.train.optim import make_optimizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--preset", default="gpt2-small", help="model preset (models.list_presets())")
  p.add_argument("--batch-size", type=int, default=4, help="global batch (rows per step)")
  p.add_argument("--seq-len", type=int, default=128,
                 help="sequence length (seq2seq: source and target length)")
  p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's")
  p.add_argument("--steps", type=int, default=5, help="timed steps")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                 help="compute dtype (parameters stay float32)")
  p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation in the step")
  p.add_argument("--remat", choices=("none", "full", "dots"), default="none")
  p.add_argument("--matmul-size", type=int, default=None,
                 help="square matmul size for the machine's FLOP/s (default: 2048 on CPU, 8192 "
                      "on accelerators)")
  p.add_argument("--matmul-reps", type=int, default=5, help="timed matmul calls per dtype")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None, help="also write the JSON here")
  args = p.parse_args(argv)
  for name in ("batch_size", "seq_len", "steps", "microbatches", "matmul_reps"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
  if args.warmup < 0:
    p.error(f"--warmup={args.warmup} must be >= 0")
  return args


# -------------------------------------------------------------------------------------------------
# Random batches (numpy), shaped like the data loaders' output.


def random_batch(config, batch: int, seq_len: int, seed: int) -> tuple[dict[str, np.ndarray], str]:
  rng = np.random.default_rng(seed)
  v = config.vocab_size
  ids = lambda: rng.integers(0, v, (batch, seq_len), dtype=np.int32)  # noqa: E731
  match config:
    case GPTConfig():
      return {
          "tokens": ids(),
          "labels": ids(),
          "segment_ids": np.ones((batch, seq_len), np.int32),
          "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch, seq_len)).copy(),
          "loss_mask": np.ones((batch, seq_len), bool),
      }, "gpt"
    case BERTConfig():
      half = seq_len // 2
      token_types = np.zeros((batch, seq_len), np.int32)
      token_types[:, half:] = 1
      mlm_mask = rng.random((batch, seq_len)) < 0.15
      mlm_mask[:, 0] = True  # at least one prediction per row
      return {
          "tokens": ids(),
          "token_types": token_types,
          "attention_mask": np.ones((batch, seq_len), bool),
          "mlm_labels": np.where(mlm_mask, ids(), 0).astype(np.int32),
          "mlm_mask": mlm_mask,
          "nsp_labels": rng.integers(0, 2, (batch,), dtype=np.int32),
      }, "bert"
    case Seq2SeqConfig():
      return {
          "src": ids(),
          "src_mask": np.ones((batch, seq_len), bool),
          "tgt_in": ids(),
          "tgt_out": ids(),
          "tgt_mask": np.ones((batch, seq_len), bool),
      }, "seq2seq"
    case _:
      raise TypeError(f"not a model config: {type(config).__name__}")


# -------------------------------------------------------------------------------------------------
# The machine's matmul rate.


def measure_matmul(n: int, reps: int, in_dtype) -> dict:
  """Median FLOP/s of a jitted ``[n,n] @ [n,n]`` with ``in_dtype`` inputs and fp32 accumulation."""
  ka, kb = jax.random.split(jax.random.key(1))
  a = jax.random.normal(ka, (n, n), jnp.float32).astype(in_dtype)
  b = jax.random.normal(kb, (n, n), jnp.float32).astype(in_dtype)
  mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  jax.block_until_ready(mm(a, b))  # compile
  jax.block_until_ready(mm(a, b))  # warm
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(mm(a, b))
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  flops = 2.0 * n ** 3
  return {"size": n, "input_dtype": jnp.dtype(in_dtype).name, "accumulate": "float32",
          "median_s": med, "min_s": min(times), "flops_per_sec": flops / med,
          "best_flops_per_sec": flops / min(times)}


# -------------------------------------------------------------------------------------------------


def _version(dist: str) -> str | None:
  try:
    return importlib.metadata.version(dist)
  except importlib.metadata.PackageNotFoundError:
    return None


def main(argv=None) -> dict:
  args = parse_args(argv)
  overrides = {"dtype": args.dtype, "remat": args.remat}
  if args.vocab_size is not None:
    overrides["vocab_size"] = args.vocab_size
  config = models.get_config(args.preset, **overrides)
  max_len = getattr(config, "max_len", None)
  uses_table = not (isinstance(config, Seq2SeqConfig) and config.position == "relative") and not (
      isinstance(config, GPTConfig) and config.position in ("rope", "alibi"))
  if uses_table and max_len is not None and args.seq_len > max_len:
    raise SystemExit(f"--seq-len={args.seq_len} exceeds {args.preset}'s max_len={max_len}")

  devices = jax.devices()
  mesh = step_lib.make_mesh({"data": -1})
  n_data = mesh.shape["data"]
  if args.batch_size % (n_data * args.microbatches):
    raise SystemExit(f"--batch-size={args.batch_size} must be divisible by {n_data} devices x "
                     f"--microbatches={args.microbatches}")

  host_batch, task_name = random_batch(config, args.batch_size, args.seq_len, args.seed)
  task = tasks_lib.get_task(task_name)
  tcfg = TrainConfig(steps=1000, batch_size=args.batch_size, seq_len=args.seq_len,
                     microbatches=args.microbatches, seed=args.seed, dtype=args.dtype)
  optimizer = make_optimizer(tcfg)

  t0 = time.perf_counter()
  params = models.init(config, jax.random.key(args.seed))
  state = step_lib.create_state(params, optimizer)
  state = jax.device_put(state, step_lib.replicated(mesh))
  jax.block_until_ready(state)
  init_s = time.perf_counter() - t0
  batch = step_lib.shard_batch(host_batch, mesh, task.keys)

  jitted = step_lib.jit_train_step(
      step_lib.make_train_step(models.graphdef(config), task, optimizer, seed=args.seed,
                               microbatches=args.microbatches), mesh, state)
  t0 = time.perf_counter()
  lowered = jitted.lower(state, batch)
  lower_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  train_step = lowered.compile()
  compile_only_s = time.perf_counter() - t0

  def run_step(state):
    t0 = time.perf_counter()
    state, metrics = train_step(state, batch)
    jax.block_until_ready((state, metrics))
    return state, metrics, time.perf_counter() - t0

  state, metrics, first_step_s = run_step(state)
  for _ in range(args.warmup):
    state, metrics, _ = run_step(state)
  times = []
  for _ in range(args.steps):
    state, metrics, dt = run_step(state)
    times.append(dt)
  final_loss = float(metrics["loss"])
  del state

  median = statistics.median(times)
  rows_tokens = args.batch_size * args.seq_len
  is_s2s = isinstance(config, Seq2SeqConfig)
  tokens_per_step = 2 * rows_tokens if is_s2s else rows_tokens
  fn_flops = models.train_flops_per_token(config, args.seq_len)
  # train_flops_per_token counts a seq2seq "token" as one source plus one target token.
  flops_per_token = fn_flops / 2 if is_s2s else fn_flops
  tokens_per_sec = tokens_per_step / median
  model_flops_per_sec = flops_per_token * tokens_per_sec

  platform_name = devices[0].platform
  mm_size = args.matmul_size or (2048 if platform_name == "cpu" else 8192)
  mm32 = measure_matmul(mm_size, args.matmul_reps, jnp.float32)
  mm16 = measure_matmul(mm_size, args.matmul_reps, jnp.bfloat16)
  reference = mm16 if args.dtype == "bfloat16" else mm32

  pc = models.param_count(config)
  result = {
      "preset": args.preset,
      "family": type(config).__name__,
      "config": {
          "params": pc.total, "non_embedding_params": pc.non_embedding,
          "vocab_size": config.vocab_size, "d_model": config.d_model,
          "num_layers": getattr(config, "num_layers", None),
          "num_encoder_layers": getattr(config, "num_encoder_layers", None),
          "num_decoder_layers": getattr(config, "num_decoder_layers", None),
          "num_heads": config.num_heads, "d_ff": config.d_ff,
          "dtype": config.dtype, "param_dtype": config.param_dtype, "remat": config.remat,
          "dropout_rate": config.dropout_rate,
      },
      "batch_size": args.batch_size,
      "seq_len": args.seq_len,
      "dtype": args.dtype,
      "microbatches": args.microbatches,
      "remat": args.remat,
      "devices": {"count": len(devices), "platform": platform_name,
                  "kind": devices[0].device_kind, "mesh": dict(mesh.shape),
                  "host_cpus": os.cpu_count()},
      "versions": {"jax": jax.__version__, "jaxlib": _version("jaxlib"), "flax": flax.__version__,
          "optax": optax.__version__, "numpy": np.__version__,
          "python": platform.python_version()},
      "default_matmul_precision": jax.config.jax_default_matmul_precision,
      "init_s": init_s,
      "lower_s": lower_s,
      "compile_s": lower_s + compile_only_s,
      "first_step_s": first_step_s,
      "warmup_steps": args.warmup,
      "timed_steps": args.steps,
      "step_s": {"median": median, "min": min(times), "max": max(times), "all": times},
      "median_step_s": median,
      "tokens_per_step": tokens_per_step,
      "tokens_per_sec": tokens_per_sec,
      "train_flops_per_token_fn": fn_flops,
      "flops_per_token": flops_per_token,
      "model_flops_per_step": flops_per_token * tokens_per_step,
      "model_flops_per_sec": model_flops_per_sec,
      "matmul_flops_per_sec": {"float32": mm32["flops_per_sec"],
                               "bfloat16": mm16["flops_per_sec"]},
      "matmul": {"float32": mm32, "bfloat16": mm16},
      "mfu_reference": reference["input_dtype"],
      "mfu": model_flops_per_sec / reference["flops_per_sec"],
      "final_loss": final_loss,
      "notes": (
          ("seq2seq: tokens count source + target (2 * batch * seq_len per step); "
           "flops_per_token = train_flops_per_token(config, seq_len) / 2. " if is_s2s else "")
          + "Steps reuse one device-resident random batch: host loading and transfer excluded. "
            "mfu is relative to the measured matmul rate of this run, not a datasheet peak."),
      "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
  }
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return result


if __name__ == "__main__":
  main()
