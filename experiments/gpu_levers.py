"""A/B of the accelerator levers in one process: the train step and generation's compile time.

    python experiments/gpu_levers.py --json OUT.json                      # GPT-2 small, 16 x 1024
    python experiments/gpu_levers.py --preset gpt2-tiny --batch-size 2 --seq-len 64 --steps 2 \\
        --generate-batches 1 --new-tokens 8                               # a quick run anywhere

Train step (ours only; ``tjax bench train`` sets the default against PyTorch): the GPT task's real
step (AdamW, clipping, token-mean cross-entropy) on one random batch, compiled once per variant:

  default         the library's defaults for this backend
  logits_head     ``train.loss_head: logits`` (the [B, T, V] float32 logits, then the loss)
  fused_head      ``train.loss_head: fused`` (``ops.linear_cross_entropy``)
  scanned         ``scan_layers: true``
  no_segment_ids  the batch without segment ids (no packed-document mask)
  triton_gemm_on  the step compiled with ``xla_gpu_enable_triton_gemm: true`` (GPUs)
  triton_gemm_off the same, ``false``
  cublaslt        the step compiled with ``xla_gpu_enable_cublaslt: true`` (cuBLASLt's epilogues)
  autotune_level_1 the step compiled with ``xla_gpu_autotune_level: 1`` (no buffer checks)
  vocab_pad_128   the tied vocabulary product padded to a multiple of 128 columns
                  (the kernel table's ``pad_cols``)
  packed_segments_4, packed_segments_16  segment ids to cuDNN as up to 4 (16) packed sequences
                  per row instead of a [B, 1, T, T] mask (``cudnn_packed_segments``; the step's
                  conditionals in CUDA graphs, as ``GpuBackend.step_compiler_options`` then asks)
  packed_segments_16_host_cond  the same with XLA's default command buffers: each attention's
                  conditional outside the graphs, its predicate read by the host
  cudnn_layer_norm  layer norms (forward and backward) as cuDNN kernels
                  (``xla_gpu_enable_cudnn_layer_norm: true``)
  command_buffer_off  no CUDA graphs (``xla_gpu_enable_command_buffer: ""``): how much of the
                  launch time XLA's command buffers already save

Every variant is a kernel table (``backends.KernelTable``): compile options are its
``step_options``, laid over the backend's own. Each variant: compile seconds, the median of
``--steps`` steps after 3 warm-up steps, tokens/s, and the step's temporaries. Generation: greedy
``generate`` of ``--new-tokens`` tokens for each batch size and dtype, with the decoding loop
compiled with the library's options and with each of ``DECODE_VARIANTS`` over them (the table's
``decode_options``); ``compile_s`` = first call - median of two more.

Every variant runs in a process of its own: XLA:GPU keeps its autotuning results for the
process's lifetime, so a second program with the same products would compile faster than a
user's first one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import backends, models, runtime
from transformer_jax.train import step as step_lib
from transformer_jax.train import tasks as tasks_lib
from transformer_jax.train.config import TrainConfig
from transformer_jax.train.optim import make_optimizer

DECODE_VARIANTS = {
  "triton_gemm_off": {"xla_gpu_enable_triton_gemm": False},
  "autotune_level_1": {"xla_gpu_autotune_level": 1},
  "autotune_level_0": {"xla_gpu_autotune_level": 0},
}


class _NoSegments(tasks_lib.GPTTask):
  """The GPT task with the segment ids left out of the model's call."""

  def sums(self, model, batch, rng, **kw):
    return super().sums(model, {**batch, "segment_ids": None}, rng, **kw)


def _batch(config, b: int, t: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  ids = lambda: jnp.asarray(rng.integers(0, config.vocab_size, (b, t)), jnp.int32)  # noqa: E731
  return {
    "tokens": ids(),
    "labels": ids(),
    "segment_ids": jnp.ones((b, t), jnp.int32),
    "positions": jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)),
    "loss_mask": jnp.ones((b, t), bool),
  }


def train_variant(
  preset: str,
  dtype: str,
  b: int,
  t: int,
  steps: int,
  *,
  overrides=None,
  loss_head: str = "logits",
  segments: bool = True,
  table: dict | None = None,
) -> dict:
  """Compile and time one variant of the train step, built with the kernel table ``table``
  (``backends.KernelTable`` fields); returns its row."""
  config = models.get_config(preset, dtype=dtype, dropout_rate=0.0, **(overrides or {}))
  tcfg = TrainConfig(
    steps=1000, batch_size=b, seq_len=t, lr=1e-4, warmup_steps=0, schedule="constant"
  )
  optimizer = make_optimizer(tcfg)
  task = (tasks_lib.GPTTask if segments else _NoSegments)(loss_head=loss_head)
  state = step_lib.create_state(models.init(config, jax.random.key(0)), optimizer)
  batch = _batch(config, b, t)
  backend = backends.current(backends.KernelTable.from_dict(table))
  options = backend.step_compiler_options()
  fn = jax.jit(
    step_lib.make_train_step(models.graphdef(config, None, backend), task, optimizer, seed=0),
    donate_argnums=(0,),
  )
  start = time.perf_counter()
  with backend.compiling():
    compiled = backend.hold(
      fn.lower(state, batch).compile(compiler_options=options or None), options
    )
  compile_s = time.perf_counter() - start
  temp = runtime.temp_bytes(compiled)
  times, losses = [], []
  for i in range(3 + steps):
    start = time.perf_counter()
    state, metrics = compiled(state, batch)
    losses.append(float(metrics["loss"]))  # blocks until the step is done
    if i >= 3:
      times.append(time.perf_counter() - start)
  step_s = statistics.median(times)
  flops = models.train_flops_per_token(config, t) * b * t
  del state, compiled
  layers = "unrolled" if models.unrolls_layers(config) else "scanned"
  return {
    "compile_s": compile_s,
    "step_s": step_s,
    "all_s": times,
    "tokens_per_sec": b * t / step_s,
    "model_flops_per_sec": flops / step_s,
    "temp_bytes": temp,
    "first_loss": losses[0],
    "last_loss": losses[-1],
    "table": table or {},
    "layers": layers,
    "loss_head": loss_head,
    "options": options,
  }


def generate_variant(preset: str, dtype: str, batch: int, new_tokens: int, options: dict) -> dict:
  """Greedy generation's first call (compile) and steady call with the decoding loop compiled
  with ``options`` over the library's (the kernel table's ``decode_options``)."""
  from transformer_jax.generate import decode

  config = models.get_config(preset, dtype=dtype, param_dtype=dtype)
  backend = backends.current(backends.KernelTable(decode_options=tuple(options.items())))
  model = nnx.merge(models.graphdef(config, None, backend), models.init(config, jax.random.key(0)))
  prompt = np.random.default_rng(0).integers(0, config.vocab_size, (batch, 32))
  calls = []
  for _ in range(3):
    start = time.perf_counter()
    np.asarray(decode.generate(model, prompt, max_new_tokens=new_tokens))
    calls.append(time.perf_counter() - start)
  steady = statistics.median(calls[1:])
  return {
    "first_call_s": calls[0],
    "steady_s": steady,
    "compile_s": calls[0] - steady,
    "tokens_per_sec": batch * new_tokens / steady,
    "options": backend.decode_compiler_options(),
  }


def _options(**options) -> dict:
  """A variant whose kernel table lays ``options`` over the step's own compile options."""
  return {"table": {"step_options": options}}


VARIANTS = {
  "default": {},
  "logits_head": {"loss_head": "logits"},
  "fused_head": {"loss_head": "fused"},
  "scanned": {"overrides": {"scan_layers": True}},
  "no_segment_ids": {"segments": False},
  "triton_gemm_on": _options(xla_gpu_enable_triton_gemm=True),
  "triton_gemm_off": _options(xla_gpu_enable_triton_gemm=False),
  "cublaslt": _options(xla_gpu_enable_cublaslt=True),
  "autotune_level_1": _options(xla_gpu_autotune_level=1),
  "vocab_pad_128": {"table": {"pad_cols": 128}},
  "packed_segments_4": {"table": {"cudnn_packed_segments": 4}},
  "packed_segments_16": {"table": {"cudnn_packed_segments": 16}},
  "packed_segments_16_host_cond": {
    "table": {
      "cudnn_packed_segments": 16,
      "step_options": {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"},
    }
  },
  "cudnn_layer_norm": _options(xla_gpu_enable_cudnn_layer_norm=True),
  "command_buffer_off": _options(xla_gpu_enable_command_buffer=""),
}


def _one(args) -> dict:
  """One variant, in this process: ``args.one`` is ``train:NAME`` or
  ``generate:DTYPE:BATCH:NAME``."""
  kind, *rest = args.one.split(":")
  if kind == "train":
    return train_variant(
      args.preset, args.dtype, args.batch_size, args.seq_len, args.steps, **VARIANTS[rest[0]]
    )
  dtype, batch, name = rest
  options = {} if name == "default" else DECODE_VARIANTS[name]
  return generate_variant(args.preset, dtype, int(batch), args.new_tokens, options)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="gpt2-small")
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=1024)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument(
    "--variants",
    default="default,fused_head,scanned,no_segment_ids,triton_gemm_on",
    help=f"comma-separated, of {', '.join(VARIANTS)}",
  )
  p.add_argument("--generate-batches", default="1,8", help="comma-separated; empty: none")
  p.add_argument("--generate-dtypes", default="float32")
  p.add_argument("--new-tokens", type=int, default=128)
  p.add_argument("--json", default=None)
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a variant's own process
  args = p.parse_args(argv)
  if args.one:
    row = _one(args)
    with open(args.json, "w") as f:
      json.dump(row, f)
    return row
  backend = backends.current()
  result = {
    "device_kind": jax.devices()[0].device_kind,
    "platform": backends.platform(),
    "jax": jax.__version__,
    "preset": args.preset,
    "dtype": args.dtype,
    "batch_size": args.batch_size,
    "seq_len": args.seq_len,
    "step_compiler_options": backend.step_compiler_options(),
    "decode_compiler_options": backend.decode_compiler_options(),
    "train": {},
    "generate": {},
  }
  jobs = [("train", f"train:{v}") for v in args.variants.split(",") if v]
  for dtype in [d for d in args.generate_dtypes.split(",") if d]:
    for batch in [b for b in args.generate_batches.split(",") if b]:
      for name in ("default", *DECODE_VARIANTS):
        jobs.append(("generate", f"generate:{dtype}:{batch}:{name}"))
  base = [
    sys.executable,
    os.path.abspath(__file__),
    "--preset",
    args.preset,
    "--dtype",
    args.dtype,
    "--batch-size",
    str(args.batch_size),
    "--seq-len",
    str(args.seq_len),
    "--steps",
    str(args.steps),
    "--new-tokens",
    str(args.new_tokens),
  ]
  for kind, job in jobs:
    key = job.split(":", 1)[1].replace(":", "_batch", 1).replace(":", "_", 1)
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
      done = subprocess.run(
        [*base, "--one", job, "--json", tmp.name], capture_output=True, text=True
      )
      if done.returncode == 0:
        with open(tmp.name) as f:
          row = json.load(f)
      else:
        row = {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:2000]}
    result[kind][key] = row
    print(kind, key, json.dumps({k: v for k, v in row.items() if k != "all_s"}), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  base_s = result["train"].get("default", {}).get("step_s")
  print(f"\n{result['device_kind']}: {args.preset} {args.batch_size}x{args.seq_len} {args.dtype}")
  for name, row in result["train"].items():
    if "error" in row:
      print(f"  {name:<18s} error: {row['error'][:160]}")
      continue
    rel = f"{row['step_s'] / base_s:6.3f}x default" if base_s else ""
    print(
      f"  {name:<18s} {1e3 * row['step_s']:8.2f} ms  {row['tokens_per_sec']:9.0f} tok/s  "
      f"compile {row['compile_s']:5.1f} s  {rel}"
    )
  for key, row in result["generate"].items():
    if "error" in row:
      print(f"  {key:<28s} error: {row['error'][:160]}")
    else:
      print(f"  {key:<28s} compile {row['compile_s']:5.1f} s  {row['tokens_per_sec']:8.0f} tok/s")
  return result


if __name__ == "__main__":
  main()
