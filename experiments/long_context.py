"""Long-context training: a small RoPE GPT at 8k and 16k tokens, "chunked" attention against "xla".

Each (implementation, length) runs in a fresh process that trains a few AdamW steps on one row of
the embedded corpus (the Python standard library's sources, prepared by `tjax prepare` on first use)
and reports seconds per step and its peak resident memory. The parent watches each child's memory
and stops it above a cap (default 16 GiB), so the dense kernel failing at 16k is recorded, not
fatal.

  python experiments/long_context.py                  # writes experiments/results/long_context.json
  python experiments/long_context.py --lengths 4096 --steps 2 --json /tmp/lc.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_DATA = os.path.join(_ROOT, "runs", "data", "stdlib-4k")


def _cpu() -> dict:
  model, flags = platform.processor(), []
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
          flags = line.split(":", 1)[1].split()
          break
  except OSError:
    pass
  wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
  return {"model": model, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def _worker(args) -> None:
  """One configuration in this process; prints one JSON line."""
  import resource

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  import transformer_jax as tj
  from transformer_jax import data, ops

  dataset = data.load_dataset(args.data)
  tokens = np.asarray(dataset.stream("train").tokens[: args.seq_len + 1], np.int32)
  if tokens.size < args.seq_len + 1:
    raise SystemExit(f"the dataset at {args.data} has fewer than {args.seq_len + 1} tokens")
  inputs, targets = jnp.asarray(tokens[None, :-1]), jnp.asarray(tokens[None, 1:])
  config = tj.models.get_config(
    "gpt2-tiny",
    vocab_size=dataset.vocab_size,
    d_model=args.d_model,
    num_layers=args.layers,
    num_heads=args.heads,
    d_ff=4 * args.d_model,
    max_len=args.seq_len,
    position="rope",
    attention_impl=args.impl,
  )
  params = tj.models.init(config, jax.random.key(0))
  optimizer = optax.adamw(1e-3)
  opt_state = optimizer.init(params)

  def loss_fn(p):
    logits = tj.models.apply(config, p, inputs)
    loss, _ = ops.cross_entropy(logits, targets)
    return loss

  @jax.jit
  def step(p, o):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, o = optimizer.update(grads, o, p)
    return optax.apply_updates(p, updates), o, loss

  t0 = time.perf_counter()
  params, opt_state, loss = step(params, opt_state)
  losses = [float(loss)]
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(args.steps):
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
    times.append(time.perf_counter() - t0)
  print(
    json.dumps(
      {
        "first_step_s": compile_s,
        "step_s": float(np.median(times)),
        "step_times_s": times,
        "losses": losses,
        "finite": bool(np.isfinite(losses).all()),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
      }
    ),
    flush=True,
  )


def _rss_gib(pid: int) -> float:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  return 0.0


def _run_child(args, impl: str, seq_len: int) -> dict:
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    "--impl",
    impl,
    "--seq-len",
    str(seq_len),
    "--steps",
    str(args.steps),
    "--data",
    args.data,
    "--d-model",
    str(args.d_model),
    "--layers",
    str(args.layers),
    "--heads",
    str(args.heads),
  ]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  peak, killed = 0.0, False
  while proc.poll() is None:
    peak = max(peak, _rss_gib(proc.pid))
    if peak > args.cap_gib:
      proc.kill()
      killed = True
      break
    time.sleep(0.05)
  out, err = proc.communicate()
  if killed:
    return {
      "ok": False,
      "error": f"stopped: resident memory above the {args.cap_gib} GiB cap",
      "peak_rss_gib": peak,
    }
  if proc.returncode != 0:
    return {"ok": False, "error": (err.strip().splitlines() or ["?"])[-1], "peak_rss_gib": peak}
  result = json.loads(out.strip().splitlines()[-1])
  result["ok"] = True
  return result


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
  parser.add_argument("--impls", nargs="+", default=["chunked", "xla"])
  parser.add_argument("--steps", type=int, default=3, help="timed steps after the first (compile)")
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--cap-gib", type=float, default=16.0)
  parser.add_argument("--data", default=_DATA)
  parser.add_argument("--json", default=os.path.join(_HERE, "results", "long_context.json"))
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--impl", help=argparse.SUPPRESS)
  parser.add_argument("--seq-len", type=int, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    _worker(args)
    return

  import jax

  from transformer_jax import data

  if not os.path.exists(os.path.join(args.data, "metadata.json")):
    data.prepare(["stdlib"], args.data, compact_vocab=4096)
  results = {}
  for seq_len in args.lengths:
    for impl in args.impls:
      r = _run_child(args, impl, seq_len)
      results.setdefault(str(seq_len), {})[impl] = r
      shown = (
        f"{r['step_s']:.2f} s/step, peak {r['peak_rss_gib']:.2f} GiB, loss "
        f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}"
        if r["ok"]
        else r["error"]
      )
      print(f"T={seq_len:6d} {impl:8s} {shown}", flush=True)
  out = {
    "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
    "cpu": _cpu(),
    "jax": jax.__version__,
    "platform": jax.default_backend(),
    "model": {
      "d_model": args.d_model,
      "num_layers": args.layers,
      "num_heads": args.heads,
      "position": "rope",
      "batch": 1,
      "optimizer": "adamw",
    },
    "results": results,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {args.json}")


if __name__ == "__main__":
  main()
