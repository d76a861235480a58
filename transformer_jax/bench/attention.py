"""``tjax bench attention``: forward + backward of the backend's attention per implementation.

Causal self-attention on ``[batch, T, heads, head_dim]`` inputs (GPT-2 small's layer by default),
each implementation at each length, jitted with the train step's compile options
(``Backend.step_compiler_options``: oneDNN products on CPU), best and median of ``--reps`` after a
compiling call. "auto" names ``implementation=None``, the backend's own choice
(``Backend.attention``). The
attention core's FLOPs (``4 * B * N * T * S * H`` forward, 2.5x that forward + backward, halved for
causal masking's useful half) are set against the matmul limit measured in the same run (on a GPU
or TPU: also a large square product in ``--dtype``, ``machine.run_matmul_limit``) and, where
``hardware.PEAK_FLOPS`` knows the device, against the datasheet's peak.

A cell that fails (out of memory: dense "xla" scores at long lengths; an implementation the device
lacks) is recorded as ``{"T", "implementation", "error"}`` and the table goes on.

``--against torch`` (the default on a GPU) also times PyTorch's
``scaled_dot_product_attention(is_causal=True)`` forward + backward on JAX's device, same shapes
and dtype in torch's ``[B, N, T, H]`` layout, synchronized before the clock is read at both ends:
rows with implementation "torch_sdpa". On a TPU, or a GPU where torch has no CUDA, it is left out
(``left_out`` says why). On accelerators float32 products run at full float32 precision on
both sides (the models' default ``matmul_precision``, and PyTorch's).

Memory per length is ``experiments/attention_memory.py``'s job (a process per cell); this is the
quick time table.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from transformer_jax import backends, hardware
from transformer_jax.bench import machine

# --implementations when not given, by platform ("auto": the library's choice).
DEFAULT_IMPLEMENTATIONS = {
  "cpu": "xla,chunked",
  "gpu": "xla,chunked,cudnn,auto",
  "tpu": "xla,chunked,auto",
}
RIVALS = ("torch", "none")


def add_args(p: argparse.ArgumentParser) -> None:
  p.add_argument("--lengths", default="256,1024,2048", help="comma-separated sequence lengths")
  p.add_argument("--batch-size", type=int, default=1)
  p.add_argument(
    "--batch-sizes",
    default=None,
    help="comma-separated batch sizes, one per --lengths entry (default: --batch-size "
    "at every length)",
  )
  p.add_argument("--heads", type=int, default=12)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument(
    "--implementations",
    default=None,
    help="comma-separated: xla, chunked, cudnn, auto (the library's choice); default "
    + "; ".join(f"{k}: {v}" for k, v in DEFAULT_IMPLEMENTATIONS.items()),
  )
  p.add_argument(
    "--against",
    default=None,
    help="torch (scaled_dot_product_attention on the same device) or none; default "
    "torch on a GPU, none elsewhere",
  )
  p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
  p.add_argument("--reps", type=int, default=3)
  p.add_argument(
    "--inner",
    type=int,
    default=1,
    help="calls per timed repetition, issued back to back with one wait at the end "
    "(both sides): short kernels are then timed without each call's launch and "
    "wait; a time is the repetition's seconds / --inner",
  )


def batch_sizes(lengths: list[int], batch_size: int, spec: str | None) -> list[int]:
  """The batch size of each length: ``spec`` (``--batch-sizes``, comma-separated, one per length)
  or ``batch_size`` at every length.

  Raises:
    ValueError: when ``spec`` does not give one positive integer per length.
  """
  if spec is None:
    sizes = [batch_size] * len(lengths)
  else:
    try:
      sizes = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
      raise ValueError(f"--batch-sizes {spec!r}: expected comma-separated integers") from None
    if len(sizes) != len(lengths):
      raise ValueError(
        f"--batch-sizes {spec!r}: {len(sizes)} sizes for {len(lengths)} --lengths "
        f"({','.join(map(str, lengths))}); give one per length"
      )
  if min(sizes, default=1) < 1:
    flag = f"--batch-sizes {spec!r}" if spec is not None else f"--batch-size {batch_size}"
    raise ValueError(f"{flag}: batch sizes must be positive")
  return sizes


def _error(e: BaseException) -> str:
  """An exception as one short line (XLA's out-of-memory reports run to pages)."""
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:400]}" + ("..." if len(text) > 400 else "")


def _times(call, sync, reps: int, inner: int = 1) -> tuple[float, list[float]]:
  """The first call's seconds and, for each of ``reps`` repetitions, the seconds per call of
  ``inner`` calls issued back to back; ``sync()`` waits for the device at both ends of each
  repetition (``call`` itself returns without waiting)."""
  sync()
  start = time.perf_counter()
  call()
  sync()
  first = time.perf_counter() - start
  times = []
  for _ in range(reps):
    sync()
    start = time.perf_counter()
    for _ in range(inner):
      call()
    sync()
    times.append((time.perf_counter() - start) / inner)
  return first, times


def ours_cell(
  b: int,
  t: int,
  n: int,
  h: int,
  dtype: str,
  impl: str,
  reps: int,
  backend: backends.Backend,
  inner: int = 1,
) -> tuple[float, list[float]]:
  """Forward + backward of ``backend.attention`` (``impl``; "auto": None, its choice) on ``[b, t,
  n, h]`` inputs, jitted with its step options: the first call's seconds and ``reps`` later
  repetitions' (``_times``)."""
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(key, (b, t, n, h), jnp.float32).astype(dtype) for key in keys)
  implementation = None if impl == "auto" else impl

  def loss(q, k, v):
    return jnp.sum(
      backend.attention(q, k, v, causal=True, implementation=implementation).astype(jnp.float32)
    )

  step = backend.jit_step(jax.grad(loss, argnums=(0, 1, 2)))
  pending = []  # the latest call's gradients, waited for at a repetition's end

  def call():
    pending[:] = [step(q, k, v)]

  def sync():
    if pending:
      jax.block_until_ready(pending.pop())

  return _times(call, sync, reps, inner)


def torch_cell(
  b: int, t: int, n: int, h: int, dtype: str, reps: int, device: str, inner: int = 1
) -> tuple[float, list[float]]:
  """Forward + backward of ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on
  ``[b, n, t, h]`` inputs on ``device``: the first call's seconds and ``reps`` later
  repetitions' (``_times``)."""
  import torch  # noqa: PLC0415 - torch is optional (the hf extra)

  gen = torch.Generator(device=device).manual_seed(0)
  q, k, v = (
    torch.randn((b, n, t, h), generator=gen, device=device, dtype=torch.float32)
    .to(getattr(torch, dtype))
    .requires_grad_()
    for _ in range(3)
  )

  def call():
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out.float().sum(), (q, k, v))

  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
  return _times(call, sync, reps, inner)


def run(args) -> dict:
  """Runs the benchmark described by ``args`` (see ``add_args``); returns the result dict."""
  hardware.share_gpu_memory()  # before JAX starts its backend, where it has not yet
  if args.reps < 1:
    raise ValueError(f"--reps {args.reps}: must be at least 1")
  inner = getattr(args, "inner", 1)
  if inner < 1:
    raise ValueError(f"--inner {inner}: must be at least 1")
  lengths = [int(x) for x in args.lengths.split(",") if x]
  sizes = batch_sizes(lengths, args.batch_size, getattr(args, "batch_sizes", None))
  platform, kind = backends.platform(), hardware.device_kind()
  spec = args.implementations
  if spec is None:
    spec = DEFAULT_IMPLEMENTATIONS.get(platform, "xla,chunked")
  impls = [x for x in spec.split(",") if x]
  against = getattr(args, "against", None)
  if against is None:
    against = "torch" if platform == "gpu" else "none"
  if against not in RIVALS:
    raise ValueError(f"--against {against!r}: not one of {', '.join(RIVALS)}")
  n, h = args.heads, args.head_dim
  # The core's own matmul shapes: scores [T, H] x [H, S] and outputs [T, S] x [S, H].
  t_max = max(lengths)
  core = [(t_max, h, t_max), (t_max, t_max, h)]
  limit = (
    machine.matmul_limit(core, dtype="float32")
    if platform == "cpu"
    else machine.run_matmul_limit(core, dtype=args.dtype)
  )
  peak = hardware.peak_flops(kind, limit["dtype"])
  backend = backends.current()
  # Accelerators: float32 products at full precision, as the models' default and PyTorch.
  precision = (
    (lambda: contextlib.nullcontext())
    if platform == "cpu"
    else (lambda: jax.default_matmul_precision("float32"))
  )
  device, why_not = machine.torch_device() if against == "torch" else (None, "")
  left_out = {"torch_sdpa": why_not} if against == "torch" and device is None else {}
  cells = [(impl, None) for impl in impls] + ([("torch_sdpa", device)] if device else [])
  rows = []
  for t, b in zip(lengths, sizes):
    useful = 2.5 * 4 * b * n * t * t * h / 2  # causal: half the pairs
    for impl, torch_on in cells:
      row = {"T": t, "implementation": impl}
      if len(set(sizes)) > 1:
        row["batch_size"] = b
      try:
        if impl == "torch_sdpa":
          first, times = torch_cell(b, t, n, h, args.dtype, args.reps, torch_on, inner)
        else:
          with precision():
            first, times = ours_cell(b, t, n, h, args.dtype, impl, args.reps, backend, inner)
      except Exception as e:  # noqa: BLE001 - a failing cell is recorded, the others still run
        row["error"] = _error(e)
        print(f"# T={t} {impl}: {row['error']}", file=sys.stderr)
        if torch_on == "cuda":
          import torch  # noqa: PLC0415 - torch is optional (the hf extra)

          torch.cuda.empty_cache()
        rows.append(row)
        continue
      best = min(times)
      row.update(
        {
          "first_call_s": first,
          "best_s": best,
          "median_s": statistics.median(times),
          "useful_flops_per_sec": useful / best,
          "fraction_of_matmul_limit": useful / best / limit["flops_per_sec"],
        }
      )
      if peak:
        row["fraction_of_peak"] = useful / best / peak
      rows.append(row)
  result = {
    "benchmark": "attention forward+backward, causal",
    "batch_size": sizes[0] if len(set(sizes)) == 1 else None,
    "heads": n,
    "head_dim": h,
    "dtype": args.dtype,
    "rows": rows,
    "limit": {"matmul": limit},
    "device_kind": kind,
    "platform": platform,
    "batch_sizes": sizes,
    "inner": inner,
  }
  if peak:
    result["limit"]["peak_flops"] = peak
  if device:
    result["torch_device"] = device
  if left_out:
    result["left_out"] = left_out
  return result


def table(result: dict) -> str:
  """The result as aligned lines, one per (length, implementation)."""
  b = result["batch_size"] if result["batch_size"] is not None else "B"
  where = "" if result.get("platform", "cpu") == "cpu" else f" on {result['device_kind']}"
  lines = [
    f"attention fwd+bwd, causal, [{b}, T, {result['heads']}, "
    f"{result['head_dim']}] {result['dtype']}{where}"
  ]
  for r in result["rows"]:
    size = f" B={r['batch_size']:<3d}" if "batch_size" in r else ""
    head = f"  T={r['T']:<6d}{size} {r['implementation']:<10s}"
    if "error" in r:
      lines.append(f"{head} failed: {r['error'][:120]}")
      continue
    peak = f", {100 * r['fraction_of_peak']:5.1f}% of peak" if "fraction_of_peak" in r else ""
    lines.append(
      f"{head} {r['best_s']:8.3f} s  "
      f"{r['useful_flops_per_sec'] / 1e9:6.1f} GFLOP/s  "
      f"{100 * r['fraction_of_matmul_limit']:5.1f}% of the matmul limit{peak}"
    )
  for name, why in result.get("left_out", {}).items():
    lines.append(f"  {name}: left out ({why})")
  return "\n".join(lines)
