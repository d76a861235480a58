"""Peak memory and time of attention's forward + backward, per implementation; one JSON.

    python experiments/attention_memory.py            # T = 4096, 8192, 16384 and the auto sweep
    python experiments/attention_memory.py --lengths 4096 --sweep-lengths "" --out x.json

Each measurement runs in a fresh Python process (so that ``ru_maxrss``, the peak resident set size,
belongs to that one computation): ``jax.jit(jax.grad(lambda q, k, v: sum(
ops.dot_product_attention(q, k, v, causal=True, implementation=X))))`` on float32 ``q, k, v``
``[1, T, 12, 64]`` (one GPT-2-small layer's heads), for X in default (``None``), "chunked" and
"xla". Reported: the peak RSS of the process, the first call (compilation included) and the median
of the following calls. A process is limited to ``--memory-limit-gib`` of address space so that
the dense kernel at long lengths fails cleanly (recorded as an error) instead of exhausting a
shared machine.

The sweep (``--sweep-lengths``) times "chunked" against "xla" at shorter lengths: where chunked
stops being slower is the documented threshold ``ops.dispatch.AUTO_CHUNKED_MIN_TS`` of the default.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
HEADS, HEAD_DIM = 12, 64


def worker(impl: str, t: int, reps: int, block_q: int | None, block_k: int | None) -> dict:
  """Runs in the child process: one implementation at one length."""
  sys.path.insert(0, ROOT)
  import jax
  import jax.numpy as jnp

  from transformer_jax import backends, ops

  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (1, t, HEADS, HEAD_DIM), jnp.float32) for key in keys)
  jax.block_until_ready((q, k, v))
  rss_inputs = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  block = backends.current().chunk_block  # the backend's blocks where none are given
  extra = {} if impl == "xla" else {"block_q": block_q or block, "block_k": block_k or block}

  def loss(q, k, v):
    if impl == "default":  # the backend's choice, in its blocks
      return jnp.sum(backends.current().attention(q, k, v, causal=True))
    return jnp.sum(ops.dot_product_attention(q, k, v, causal=True, implementation=impl, **extra))

  step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  start = time.perf_counter()
  jax.block_until_ready(step(q, k, v))
  first = time.perf_counter() - start
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(step(q, k, v))
    times.append(time.perf_counter() - start)
  return {
    "first_call_s": first,
    "seconds": statistics.median(times),
    "all_seconds": times,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_after_inputs_bytes": rss_inputs,
  }


def measure(impl: str, t: int, reps: int, args: argparse.Namespace) -> dict:
  """Runs ``worker`` in a fresh process under the address-space limit."""
  cmd = [
    sys.executable,
    os.path.abspath(__file__),
    "--worker",
    impl,
    str(t),
    str(reps),
    str(args.block_q or 0),
    str(args.block_k or 0),
  ]
  limit = int(args.memory_limit_gib * 2**30)

  def limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limit_memory, env=env)
  row = {"implementation": impl, "T": t}
  if proc.returncode == 0:
    row.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    row["peak_rss_gib"] = round(row["peak_rss_bytes"] / 2**30, 3)
  else:
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
    row["error"] = f"exit {proc.returncode}: " + (lines[-1][:300] if lines else "(no stderr)")
  print(json.dumps(row), flush=True)
  return row


def _cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor()


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--lengths", default="4096,8192,16384")
  p.add_argument("--implementations", default="default,chunked,xla")
  p.add_argument("--sweep-lengths", default="256,512,768,1024,2048")
  p.add_argument("--reps", type=int, default=2, help="timed calls after the first, per length")
  p.add_argument("--sweep-reps", type=int, default=5)
  p.add_argument("--block-q", type=int, default=None)
  p.add_argument("--block-k", type=int, default=None)
  p.add_argument("--memory-limit-gib", type=float, default=16.0)
  p.add_argument("--out", default=os.path.join(ROOT, "experiments/results/attention_memory.json"))
  args = p.parse_args(argv)

  def ints(s):
    return [int(x) for x in s.split(",") if x]

  load_before = os.getloadavg()
  sweep = [
    measure(impl, t, args.sweep_reps, args)
    for t in ints(args.sweep_lengths)
    for impl in ("chunked", "xla")
  ]
  rows = [
    measure(impl, t, args.reps, args)
    for t in ints(args.lengths)
    for impl in args.implementations.split(",")
  ]
  sys.path.insert(0, ROOT)
  import jax

  from transformer_jax import backends
  from transformer_jax.ops import dispatch

  result = {
    "what": "jax.grad of sum(ops.dot_product_attention(q, k, v, causal=True, implementation=X))"
    f", q/k/v float32 [1, T, {HEADS}, {HEAD_DIM}], each in a fresh process",
    "command": " ".join(
      ["python", "experiments/attention_memory.py"] + (sys.argv[1:] if argv is None else list(argv))
    ),
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": {
      "cpu": _cpu_name(),
      "cpu_count": os.cpu_count(),
      "platform": platform.platform(),
      "jax_backend": jax.default_backend(),
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "load_average_before": load_before,
      "load_average_after": os.getloadavg(),
      "note": "shared machine: other processes ran at the same time, so seconds are "
      "noisy (the load averages bracket the run); peak RSS is not affected",
    },
    "settings": {
      "reps": args.reps,
      "sweep_reps": args.sweep_reps,
      "memory_limit_gib": args.memory_limit_gib,
      "block_q": args.block_q or backends.current().chunk_block,
      "block_k": args.block_k or backends.current().chunk_block,
      "auto_chunked_min_ts": dispatch.AUTO_CHUNKED_MIN_TS,
    },
    "versions": {d: importlib.metadata.version(d) for d in ("jax", "jaxlib", "numpy")}
    | {"python": platform.python_version()},
    "rows": rows,
    "auto_threshold_sweep": sweep,
  }
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  if len(sys.argv) > 1 and sys.argv[1] == "--worker":
    impl, t, reps, bq, bk = sys.argv[2], *map(int, sys.argv[3:7])
    print(json.dumps(worker(impl, t, reps, bq or None, bk or None)))
  else:
    main()
